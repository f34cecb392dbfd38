"""A job's winner, the same in every view (REST `/best`, the dashboard's best card, the jobs list):
the winner its finished job recorded, else the trial its worker built, else the live ranking of
its study (`rank_trials`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tuner.db import FINAL_STATES
from tuner.record.ranking import Ranked, ranked
from tuner.record.reader import StudyRecord


@dataclass(frozen=True)
class Verdict:
    """What a view shows for a job's winner."""

    best: Ranked | None
    baseline_tokens_per_s: float | None = None
    speedup: float | None = None
    tie: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    source: str = "ranking"  # summary (the finished job's), build (the trial built), ranking (live)


def ranked_from_dict(data: dict[str, Any]) -> Ranked:
    """A stored summary's entry back as `Ranked`; keys an older version did not store take defaults."""
    names = {f.name for f in dataclasses.fields(Ranked)}
    values = {k: v for k, v in data.items() if k in names}
    values.setdefault("config", {})
    values.setdefault("remeasured_tokens_per_s", [])
    values.setdefault("noise", 0.0)
    values.setdefault("metrics", {})
    values.setdefault("role", None)
    values.setdefault("constraint_ok", True)
    return Ranked(**values)


def job_verdict(
    state: str, summary: dict[str, Any] | None, study: StudyRecord | None, built_trial: int | None
) -> Verdict:
    """The winner of a job in `state` with its stored `summary`, its `study` (None before it has
    one) and the trial its worker built (None before or without a build)."""
    stored = (summary or {}).get("best") if state in FINAL_STATES else None
    if stored:
        base = (summary.get("baseline") or {}).get("tokens_per_s")
        return Verdict(
            ranked_from_dict(stored), base, summary.get("speedup"), bool(summary.get("tie")),
            summary.get("counts") or {}, "summary",
        )  # fmt: skip
    if study is None:
        return Verdict(None)
    ranking = study.ranking()
    best, source = ranking.best, "ranking"
    if built_trial is not None:
        built = next((e for e in ranking.ranked if e.trial == built_trial), None)
        record = study.find(built_trial)
        if built is None and record is not None and record.tokens_per_s:
            again, cis = study.remeasured.get(built_trial, []), study.remeasured_ci.get(built_trial, ())
            built = ranked(record, again, ranking.run_noise, cis)
        if built is not None:
            best, source = built, "build"
    base = ranking.baseline.tokens_per_s if ranking.baseline else None
    speedup = best.tokens_per_s / base if best is not None and base else None
    tie = ranking.tie if best is ranking.best else False
    return Verdict(best, base, speedup, tie, dict(ranking.counts), source)
