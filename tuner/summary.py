"""What a study found, read back from storage: the trustworthy winner, the baseline, the speedup
(or a tie), the top configs, the Pareto front, and what the search cost. The winner is
`tuner.record.rank_trials`'s; this module adds the cost and the presentation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tuner.record import keys
from tuner.record.ranking import LOSS_TOLERANCE, Ranked
from tuner.record.reader import StudyRecord, read_study
from tuner.settings import shown_url
from tuner.storage import default_storage_url

__all__ = ["LOSS_TOLERANCE", "StudySummary", "summarize", "summarize_record"]


@dataclass
class StudySummary:
    study_name: str
    storage_url: str
    best: Ranked | None = None
    baseline: Ranked | None = None
    speedup: float | None = None  # best / baseline tokens/s
    tie: bool = False  # best is within measurement noise of the runner-up
    runner_up: Ranked | None = None
    top_k: list[Ranked] = field(default_factory=list)
    pareto: list[Ranked] = field(default_factory=list)
    flagged: list[Ranked] = field(default_factory=list)  # loss drifted; cannot win
    counts: dict[str, int] = field(default_factory=dict)  # trials by status word
    device_seconds: dict[str, float] = field(default_factory=dict)
    payback_hours: float | None = None  # training hours at the found speed that repay the search
    n_trials: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The summary as JSON-ready data (CLI --json, the job's stored summary, REST), its
        database URL's password hidden (`shown_url`: a job row, a cron's mailed log)."""
        return {**asdict(self), "storage_url": shown_url(self.storage_url)}


def _pareto(record: StudyRecord) -> list[int]:
    """Completed, feasible trials no other beats on both objectives (tokens/s up, memory down)."""
    points = [
        (t.values[0], t.values[1], t.number)
        for t in record.trials
        if t.completed and len(t.values) == 2 and None not in t.values and t.constraint_ok
    ]
    return [n for a, b, n in points if not any(x >= a and y <= b and (x, y) != (a, b) for x, y, _ in points)]


def _costs(record: StudyRecord) -> dict[str, float]:
    spent: dict[str, float] = {}
    for t in record.trials:
        cost = t.attrs.get(keys.DEVICE_SECONDS) or 0.0
        if cost:
            spent[t.status] = spent.get(t.status, 0.0) + cost
    remeasure = record.user_attrs.get(keys.REMEASURE_DEVICE_SECONDS, 0.0)
    if remeasure:
        spent["remeasure"] = remeasure
    spent["total"] = sum(spent.values())
    return spent


def summarize_record(record: StudyRecord, storage_url: str, top_k: int = 5) -> StudySummary:
    """The summary of one read of a study."""
    ranking = record.ranking()
    s = StudySummary(study_name=record.study_name, storage_url=storage_url, n_trials=len(record.trials))
    s.top_k, s.flagged = list(ranking.ranked[:top_k]), list(ranking.flagged)
    s.best, s.runner_up, s.baseline = ranking.best, ranking.runner_up, ranking.baseline
    s.speedup, s.tie, s.counts = ranking.speedup, ranking.tie, dict(ranking.counts)
    if (record.user_attrs.get(keys.OBJECTIVE) or "throughput") == "throughput_memory":
        by_number = {e.trial: e for e in ranking.ranked}
        s.pareto = [by_number[n] for n in _pareto(record) if n in by_number]
    s.device_seconds = _costs(record)
    devices = record.recipe.get("hardware", {}).get("devices", 1)
    if s.speedup and s.speedup > 1:
        # Training H hours on `devices` devices at the found speed saves H*(speedup-1) hours of
        # every device; the search paid for itself once that equals its device time.
        s.payback_hours = s.device_seconds["total"] / 3600 / (devices * (s.speedup - 1))
    return s


def summarize(study_name: str, storage_url: str | None = None, top_k: int = 5) -> StudySummary:
    """Read a study back from storage (`tuner show`, the driver, the worker, the REST service).
    Raises KeyError when there is no such study."""
    from tuner.db import session_scope

    url = storage_url or default_storage_url()
    with session_scope(url) as session:
        record = read_study(session, study_name)
    if record is None:
        raise KeyError(study_name)
    return summarize_record(record, url, top_k)
