"""The job page's plot data, aggregated on the server: a downsampled set of trials (at most 500
points), the best-so-far line by the study's ranking (`tuner.record.ranking`), knob importance from
Optuna's PED-ANOVA evaluator, and the Pareto front.

The browser draws these series with Plotly. Optuna's own `optuna.visualization` figures were the
first choice, but they deep-copy every trial per trace and validate every point in Python: 5 s
for a 1,000-trial sample and ~0.4 MB of JSON per plot, against a 2 s budget for the whole page.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from tuner.perf.predictor import prediction_error
from tuner.record import keys
from tuner.record.importance import INDICATIVE_BELOW, RESAMPLES, uncertainty
from tuner.record.importance import importances as knob_importances
from tuner.record.ranking import Ranking
from tuner.record.reader import StudyRecord
from tuner.record.trial import TrialRecord

SAMPLE_LIMIT = 500  # points per plot: 0.3 s to draw the four plots in Chromium here (1,000: 0.55 s)
PARALLEL_LIMIT = 300  # lines in parallel coordinates: more is unreadable
PARALLEL_PARAMS = 6  # the most important knobs get an axis each


def _evenly(items: list[TrialRecord], k: int) -> list[TrialRecord]:
    if k <= 0:
        return []
    if len(items) <= k:
        return list(items)
    step = len(items) / k
    return [items[int(i * step)] for i in range(k)]


def _tput(r: TrialRecord) -> float | None:
    return r.tokens_per_s if r.completed else None


def _mem(r: TrialRecord) -> float | None:
    value = r.attrs.get(keys.PEAK_MEM_ALLOCATED_BYTES)
    return float(value) if isinstance(value, (int, float)) else None


def _est(r: TrialRecord) -> float | None:
    value = r.attrs.get(keys.ESTIMATED_PEAK_MEM_BYTES)
    return float(value) if isinstance(value, (int, float)) else None


def pareto_front(rows: list[TrialRecord]) -> list[TrialRecord]:
    """Completed trials no other trial beats on both tokens/s (higher) and peak memory (lower),
    by decreasing tokens/s."""
    # Each value computed once: this runs over every trial of the study.
    points = [(t, m, r) for r in rows if (t := _tput(r)) is not None and (m := _mem(r)) is not None]
    points.sort(key=lambda p: (-p[0], p[1]))
    front, lowest = [], None
    for _, m, r in points:
        if lowest is None or m < lowest:
            front.append(r)
            lowest = m
    return front


def downsample(rows: list[TrialRecord], ranking: Ranking, limit: int = SAMPLE_LIMIT) -> list[TrialRecord]:
    """At most `limit` finished trials, in number order: every step of the best-so-far line
    (`Ranking.improvements`: the ranking's rule, so the line drawn from the sample is exact) and
    every Pareto-optimal trial, failures (up to a quarter of the points), the rest evenly spaced."""
    finished = [r for r in rows if r.finished]
    if len(finished) <= limit:
        return finished
    keep = {e.trial for e in ranking.improvements()}
    keep.update(r.number for r in pareto_front(finished))
    failed = [r for r in finished if r.failed]
    keep.update(r.number for r in _evenly(failed, limit // 4))
    skip = keep | {r.number for r in failed}
    rest = [r for r in finished if r.number not in skip]
    keep.update(r.number for r in _evenly(rest, limit - len(keep)))
    return [r for r in finished if r.number in keep]


def history(sample: list[TrialRecord], ranking: Ranking) -> dict[str, Any]:
    """Each sampled trial's first measurement, and the best-so-far line: at each trial, the best of
    the trials up to it as the study ranks them now (`Ranking.improvements`), so the line ends at
    the trial every view names as best. A point above the line says why in its `note` (re-measured
    lower, loss drift, memory) and is not `eligible`."""
    done = [r for r in sample if _tput(r) is not None]
    steps = ranking.improvements()
    step_trials = [e.trial for e in steps]
    at = [bisect.bisect_right(step_trials, r.number) - 1 for r in done]
    notes, eligible = _notes(ranking), {e.trial for e in ranking.ranked}
    failed = [r for r in sample if r.failed]
    return {
        "number": [r.number for r in done],
        "tokens_per_s": [_tput(r) for r in done],
        "best": [steps[i].tokens_per_s if i >= 0 else None for i in at],
        "best_trial": [steps[i].trial if i >= 0 else None for i in at],
        "eligible": [r.number in eligible for r in done],
        "note": [notes.get(r.number) or _excluded(r, eligible) for r in done],
        "failed": {
            "number": [r.number for r in failed],
            "status": [r.status for r in failed],
            "error": [str(r.attrs.get(keys.ERROR) or "")[:200] for r in failed],
        },
    }


def _notes(ranking: Ranking) -> dict[int, str]:
    """Why a trial's point and the line part: the ranking's median over re-measurements, or its
    reason the trial cannot win."""
    notes = {e.trial: f"cannot win: {e.flag}" for e in ranking.flagged}
    for e in ranking.ranked:
        if e.remeasured_tokens_per_s:
            notes[e.trial] = f"ranked at its median over re-measurements: {e.tokens_per_s:,.0f} tokens/s"
    return notes


def _excluded(r: TrialRecord, eligible: set[int]) -> str:
    """Why a completed trial the ranking left out, and did not flag, cannot win ('' when ranked)."""
    if r.number in eligible:
        return ""
    if not r.constraint_ok:
        return "cannot win: over the memory budget"
    return "cannot win: not a measured throughput"  # zero, or inf from another program


def importances(study: StudyRecord) -> dict[str, float]:
    """Knob importance for tokens/s, most important first (kept across versions of the study)."""
    return knob_importances(study.trials, study.finished, study.distributions)


def importance(study: StudyRecord, ranked: dict[str, float]) -> dict[str, Any]:
    """Knob importance, most important first; below `INDICATIVE_BELOW` completed trials marked
    indicative, with each knob's 10-90% range over bootstrap resamples."""
    spread = uncertainty(study.trials, study.distributions)
    out: dict[str, Any] = {
        "params": list(ranked),
        "values": list(ranked.values()),
        "completed": spread.completed,
        "indicative": spread.indicative,
        "min_trials": INDICATIVE_BELOW,
    }
    if spread.indicative and ranked:
        out.update(
            low=[spread.low.get(k, 0.0) for k in ranked],
            high=[spread.high.get(k, 0.0) for k in ranked],
            resamples=RESAMPLES,
        )
    return out


def parallel(sample: list[TrialRecord], knobs: list[str]) -> dict[str, Any]:
    done = [r for r in sample if _tput(r) is not None]
    top = sorted(done, key=lambda r: -_tput(r))[: PARALLEL_LIMIT // 5]
    chosen = sorted(
        {r.number: r for r in top + _evenly(done, PARALLEL_LIMIT - len(top))}.values(), key=lambda r: r.number
    )
    dims = []
    for name in knobs[:PARALLEL_PARAMS]:
        values = [_label(r.params.get(name)) for r in chosen]
        dims.append({"name": name, "values": values, "choices": sorted(set(values), key=_sort_key)})
    return {
        "number": [r.number for r in chosen],
        "tokens_per_s": [_tput(r) for r in chosen],
        "dimensions": dims,
    }


def _label(value: Any) -> str:
    if value is None:
        return "n/a"  # a conditional knob that did not apply
    return str(value).lower() if isinstance(value, bool) else str(value)


def _sort_key(label: str) -> tuple[int, float | str]:
    try:
        return (0, float(label))
    except ValueError:
        return (1, label)


def pareto(sample: list[TrialRecord]) -> dict[str, Any]:
    points = [r for r in sample if _tput(r) is not None and _mem(r) is not None]
    front = pareto_front(points)
    return {
        "all": _points(points),
        "front": _points(sorted(front, key=lambda r: _mem(r))),
    }


def _points(rows: list[TrialRecord]) -> dict[str, list[Any]]:
    return {
        "number": [r.number for r in rows],
        "tokens_per_s": [_tput(r) for r in rows],
        "peak_mem_bytes": [_mem(r) for r in rows],
    }


def memory(sample: list[TrialRecord]) -> dict[str, list[Any]]:
    pts = [r for r in sample if _mem(r) is not None and _est(r) is not None]
    return {
        "number": [r.number for r in pts],
        "status": [r.status for r in pts],
        "estimated": [_est(r) for r in pts],
        "measured": [_mem(r) for r in pts],
    }


def _predicted(r: TrialRecord) -> float | None:
    value = r.attrs.get(keys.PREDICTED_TOKENS_PER_S)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if ok else None


def predictions(study: StudyRecord) -> dict[str, Any]:
    """Each completed trial's tokens/s as the performance model predicted it before the run, against
    what it measured: the error and the interval's coverage over every such trial, the points of
    at most `SAMPLE_LIMIT` of them (evenly spaced)."""
    pts = [r for r in study.trials if _tput(r) and _predicted(r) is not None]
    out: dict[str, Any] = {"total": len(pts), "sampled": 0}
    if not pts:
        return out
    predicted = np.array([_predicted(r) for r in pts])
    measured = np.array([_tput(r) for r in pts])
    spans = [r.attrs.get(keys.PREDICTED_INTERVAL) for r in pts]
    has = [isinstance(s, list) and len(s) == 2 for s in spans]
    inside = [s[0] <= m <= s[1] for s, m, h in zip(spans, measured, has, strict=True) if h]
    shown = _evenly(pts, SAMPLE_LIMIT)
    out.update(
        sampled=len(shown),
        median_error=float(np.median(prediction_error(predicted, measured))),
        inside_interval=sum(inside) / len(inside) if inside else None,
        number=[r.number for r in shown],
        predicted=[_predicted(r) for r in shown],
        measured=[_tput(r) for r in shown],
        interval=[r.attrs.get(keys.PREDICTED_INTERVAL) for r in shown],
        chosen_by=[r.attrs.get(keys.CHOSEN_BY) or "unknown" for r in shown],
    )
    return out


def _varying(study: StudyRecord) -> list[str]:
    seen: dict[str, set[str]] = {}
    for r in study.trials:
        for k, v in r.params.items():
            seen.setdefault(k, set()).add(_label(v))
    return [k for k, values in sorted(seen.items()) if len(values) > 1]


def plot_data(study: StudyRecord) -> dict[str, Any]:
    """Every plot of the job page, computed once per study version."""

    def compute() -> dict[str, Any]:
        ranking = study.ranking()
        sample = downsample(study.trials, ranking)
        ranked = importances(study)
        return {
            "total": sum(r.finished for r in study.trials),
            "sampled": len(sample),
            "history": history(sample, ranking),
            "importance": importance(study, ranked),
            # Before importance can be computed (4 trials), every knob that varies gets an axis.
            "parallel": parallel(sample, list(ranked) or _varying(study)),
            "pareto": pareto(sample),
            "memory": memory(sample),
            "predictions": predictions(study),
        }

    return study.cached("plots", compute)
