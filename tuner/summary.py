"""What a study found, read back from storage: the trustworthy winner, the baseline, the
speedup (or a tie), the top configs, the Pareto front, and what the search cost."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.result import RESULT_KEYS
from tuner.space import config_from_params
from tuner.storage import default_storage_url, get_storage

# Largest relative gap, at any measured step, between a trial's loss and the fp32 (amp O0)
# reference trial of the same study (same seed, same data). Low-precision training drifts a
# little; a larger gap means the config computes something else and must not win.
LOSS_TOLERANCE = {"O0": 0.01, "bf16": 0.02, "fp16": 0.02}

REMEASURED_PREFIX = "remeasured:"  # study user attr per trial number: list of tokens/s


@dataclass
class StudySummary:
    study_name: str
    storage_url: str
    best: dict[str, Any] | None = None  # config, metrics, trial number
    baseline: dict[str, Any] | None = None
    speedup: float | None = None  # best / baseline tokens/s
    tie: bool = False  # best is within measurement noise of the runner-up
    runner_up: dict[str, Any] | None = None
    top_k: list[dict[str, Any]] = field(default_factory=list)
    pareto: list[dict[str, Any]] = field(default_factory=list)
    flagged: list[dict[str, Any]] = field(default_factory=list)  # loss drifted; cannot win
    counts: dict[str, int] = field(default_factory=dict)
    device_seconds: dict[str, float] = field(default_factory=dict)
    payback_hours: float | None = None  # training hours at the found speed that repay the search
    n_trials: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trial_status(t: FrozenTrial) -> str:
    """One word for a stored trial: ok, oom, error, timeout, pruned, duplicate, failed, running..."""
    if t.state == TrialState.COMPLETE:
        return "ok"
    if t.state == TrialState.PRUNED:
        return "duplicate" if "duplicate_of" in t.user_attrs else "pruned"
    if t.state == TrialState.FAIL:
        return (
            t.user_attrs.get("status")
            if t.user_attrs.get("status") in ("oom", "error", "timeout")
            else "failed"
        )
    return t.state.name.lower()


def remeasurements(study: optuna.Study) -> dict[int, list[float]]:
    attrs = study.user_attrs
    return {int(k[len(REMEASURED_PREFIX) :]): v for k, v in attrs.items() if k.startswith(REMEASURED_PREFIX)}


def _relative_spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def _entry(t: FrozenTrial, again: list[float]) -> dict[str, Any]:
    ua = t.user_attrs
    measured = [ua["tokens_per_s"], *again] if ua.get("tokens_per_s") is not None else []
    noise = max(_relative_spread(measured), ua.get("step_time_spread") or 0.0)
    return {
        "trial": t.number,
        "config": config_from_params(t.params).active_params(),
        "tokens_per_s": statistics.median(measured) if measured else None,
        "remeasured_tokens_per_s": again,
        "noise": noise,
        "metrics": {k: ua.get(k) for k in RESULT_KEYS},
        "role": ua.get("role"),
        "constraint_ok": all(v <= 0 for v in t.constraints.values()),
    }


def _loss_drift(t: FrozenTrial, ref: FrozenTrial | None) -> float | None:
    losses, ref_losses = t.user_attrs.get("losses") or [], (ref.user_attrs.get("losses") or []) if ref else []
    pairs = list(zip(losses, ref_losses, strict=False))
    if not pairs:
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)


def _tolerance(t: FrozenTrial) -> float:
    if t.params.get("amp", "O0") == "O0":
        return LOSS_TOLERANCE["O0"]
    return LOSS_TOLERANCE.get(t.params.get("amp_dtype", "bf16"), LOSS_TOLERANCE["bf16"])


def build_summary(study: optuna.Study, storage_url: str, top_k: int = 5) -> StudySummary:
    trials = study.get_trials(deepcopy=False)
    again = remeasurements(study)
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("tokens_per_s")]
    o0 = [t for t in complete if t.params.get("amp") == "O0"]
    reference = min(o0, key=lambda t: t.number) if o0 else None

    ranked, flagged = [], []
    for t in complete:
        entry = _entry(t, again.get(t.number, []))
        drift = _loss_drift(t, reference) if t is not reference else 0.0
        entry["loss_drift"] = drift
        entry["loss_reference_trial"] = reference.number if reference else None
        if drift is not None and drift > _tolerance(t):
            entry["flag"] = f"loss drifts {drift:.1%} from the fp32 reference (trial {reference.number})"
            flagged.append(entry)
        elif entry["constraint_ok"]:
            ranked.append(entry)
    ranked.sort(key=lambda e: (-e["tokens_per_s"], e["trial"]))

    s = StudySummary(study_name=study.study_name, storage_url=storage_url, n_trials=len(trials))
    s.top_k, s.flagged = ranked[:top_k], flagged
    s.best = ranked[0] if ranked else None
    base = next((t for t in complete if t.user_attrs.get("role") == "baseline"), None)
    if base is not None:
        s.baseline = _entry(base, again.get(base.number, []))
    if s.best and s.baseline:
        s.speedup = s.best["tokens_per_s"] / s.baseline["tokens_per_s"]
    if len(ranked) > 1:
        s.runner_up = ranked[1]
        gap = (ranked[0]["tokens_per_s"] - ranked[1]["tokens_per_s"]) / ranked[0]["tokens_per_s"]
        s.tie = gap <= max(ranked[0]["noise"], ranked[1]["noise"])
    if len(study.directions) > 1:
        by_number = {e["trial"]: e for e in ranked}
        s.pareto = [by_number[t.number] for t in study.best_trials if t.number in by_number]

    for t in trials:
        status = trial_status(t)
        s.counts[status] = s.counts.get(status, 0) + 1
        cost = t.user_attrs.get("device_seconds") or 0.0
        if cost:
            s.device_seconds[status] = s.device_seconds.get(status, 0.0) + cost
    remeasure_cost = study.user_attrs.get("remeasure_device_seconds", 0.0)
    if remeasure_cost:
        s.device_seconds["remeasure"] = remeasure_cost
    s.device_seconds["total"] = sum(s.device_seconds.values())
    devices = (study.user_attrs.get("recipe") or {}).get("hardware", {}).get("devices", 1)
    if s.speedup and s.speedup > 1:
        # Training H hours on `devices` devices at the found speed saves H*(speedup-1) hours of
        # every device; the search paid for itself once that equals its device time.
        s.payback_hours = s.device_seconds["total"] / 3600 / (devices * (s.speedup - 1))
    return s


def summarize(study_name: str, storage_url: str | None = None, top_k: int = 5) -> StudySummary:
    """Read a study back from storage (used by `tuner show` and the REST service)."""
    url = storage_url or default_storage_url()
    study = optuna.load_study(study_name=study_name, storage=get_storage(url))
    return build_summary(study, url, top_k=top_k)
