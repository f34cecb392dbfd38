"""One stored trial as every reader sees it (`TrialRecord`), whether it came from the bulk reader
of Optuna's tables or from Optuna's own `FrozenTrial` (the study driver's view)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tuner.record import keys
from tuner.record.status import COMPLETE_STATE, FAILURES, FINISHED_STATES, Status, status_of

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

    from tuner.config import Config


@dataclass
class TrialRecord:
    """A trial. `attrs` holds the reader's light attributes (`reader.ROW_ATTRS`) unless the record
    was read whole (`reader.with_all_attrs`, or made from a FrozenTrial)."""

    number: int
    state: str  # Optuna state, lower case: complete, running, pruned, fail, waiting
    status: Status
    values: list[float | None]
    params: dict[str, Any]
    attrs: dict[str, Any]
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    trial_id: int | None = None  # Optuna's row id
    constraints: dict[str, float] = field(default_factory=dict)  # Optuna's: feasible when all <= 0

    @property
    def completed(self) -> bool:
        """Optuna told it with a value: it ran and measured."""
        return self.state == COMPLETE_STATE

    @property
    def finished(self) -> bool:
        """In a state it never leaves (complete, fail, pruned)."""
        return self.state in FINISHED_STATES

    @property
    def tokens_per_s(self) -> float | None:
        measured = self.attrs.get(keys.TOKENS_PER_S)
        if isinstance(measured, (int, float)) and not isinstance(measured, bool):
            return float(measured)
        return self.values[0] if self.values and self.completed else None

    @property
    def role(self) -> str | None:
        return self.attrs.get(keys.ROLE)

    @property
    def duration_s(self) -> float | None:
        if self.started_at and self.finished_at:
            return (self.finished_at - self.started_at).total_seconds()
        return None

    @property
    def failed(self) -> bool:
        return self.status in FAILURES

    @property
    def constraint_ok(self) -> bool:
        return all(v <= 0 for v in self.constraints.values())

    def config(self) -> Config | None:
        """The knob setting of this trial; None when its params are not a config of this version."""
        from tuner.config import ConfigError
        from tuner.space import config_from_params

        try:
            return config_from_params(self.params)
        except (ConfigError, TypeError, ValueError):
            return None

    def metric(self, name: str) -> Any:
        if name == "number":
            return self.number
        if name == "status":
            return self.status
        if name == "tokens_per_s":
            return self.tokens_per_s
        if name == "duration_s":
            return self.duration_s
        return self.attrs.get(name)

    def summary(self) -> dict[str, Any]:
        """What one row of a trials table shows."""
        return {
            "number": self.number,
            "state": self.state,
            "status": self.status,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.attrs.get(keys.MFU),
            "peak_mem_allocated_bytes": self.attrs.get(keys.PEAK_MEM_ALLOCATED_BYTES),
            "estimated_peak_mem_bytes": self.attrs.get(keys.ESTIMATED_PEAK_MEM_BYTES),
            "step_time_s": self.attrs.get(keys.STEP_TIME_S),
            "duration_s": self.duration_s,
            # Where it ran: the host of a one-node trial, and how many nodes a multi-node one spanned.
            "node": self.attrs.get(keys.NODE),
            "nodes": self.attrs.get(keys.NODES),
            # Why it failed or was pruned (estimated OOM, infeasible, duplicate): the status's tooltip.
            "error": self.attrs.get(keys.ERROR) or self.attrs.get(keys.PRUNED_REASON),
            "params": self.params,
        }

    def detail(self) -> dict[str, Any]:
        """Everything shown for one trial (best card, failure, comparison)."""
        return {**self.summary(), "attrs": self.attrs, "values": self.values}


def from_frozen(t: FrozenTrial) -> TrialRecord:
    """A record of Optuna's own view of a trial, read whole."""
    state = t.state.name.lower()
    attrs = dict(t.user_attrs)
    return TrialRecord(
        number=t.number,
        state=state,
        status=status_of(state, attrs),
        values=list(t.values or []),
        params=dict(t.params),
        attrs=attrs,
        started_at=t.datetime_start,
        finished_at=t.datetime_complete,
        trial_id=t._trial_id,
        constraints={
            k[len(keys.CONSTRAINT_PREFIX) :]: float(v)
            for k, v in t.system_attrs.items()
            if k.startswith(keys.CONSTRAINT_PREFIX)
        },
    )
