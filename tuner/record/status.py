"""The status words of a trial, and the one rule that turns a stored trial into one of them.

A trial run reports one of the measured statuses (`ok`, `oom`, `error`, `timeout`). A stored
trial has one word more of each of these: `pruned` (never ran: infeasible or predicted out of
memory), `duplicate` (its config was measured by another trial), `failed` (stopped without a
measured status: cancelled, or its driver died), `running` and `waiting`.

A pure module: trial ranks may import it without loading Optuna.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

from tuner.record.keys import DUPLICATE_OF, STATUS

MeasuredStatus = Literal["ok", "oom", "error", "timeout"]
Status = Literal["ok", "oom", "error", "timeout", "pruned", "duplicate", "failed", "running", "waiting"]

# What an allocator says when memory runs out: CUDA's and Ascend's "out of memory", torch's
# OutOfMemoryError, its CPU allocator's "DefaultCPUAllocator: can't allocate memory" and the OS's
# ENOMEM text. One list for the rank that catches the error and the executor that reads its log.
OOM_TEXTS = ("out of memory", "outofmemoryerror", "can't allocate memory", "cannot allocate memory")


def is_oom_text(text: str) -> bool:
    """Whether an error message says memory ran out (`OOM_TEXTS`, any case)."""
    low = text.lower()
    return any(t in low for t in OOM_TEXTS)


OK: MeasuredStatus = "ok"
OOM: MeasuredStatus = "oom"
ERROR: MeasuredStatus = "error"
TIMEOUT: MeasuredStatus = "timeout"
PRUNED: Status = "pruned"
DUPLICATE: Status = "duplicate"
FAILED: Status = "failed"
RUNNING: Status = "running"
WAITING: Status = "waiting"

MEASURED: tuple[MeasuredStatus, ...] = get_args(MeasuredStatus)
STATUSES: tuple[Status, ...] = get_args(Status)
# A trial that ran and did not finish ok (the dashboard's failure list, the search's failed cost).
FAILURES: tuple[Status, ...] = (OOM, ERROR, TIMEOUT, FAILED)

# Optuna's trial states, lower case, as the tables and FrozenTrial.state name them.
STATES = ("complete", "pruned", "fail", "running", "waiting")
COMPLETE_STATE = "complete"
FINISHED_STATES = ("complete", "fail", "pruned")  # a trial never leaves these


def status_of(state: str, attrs: Mapping[str, Any]) -> Status:
    """The status word of a stored trial from its Optuna state and its user attributes."""
    state = state.lower()
    if state == COMPLETE_STATE:
        return OK
    if state == "pruned":
        return DUPLICATE if DUPLICATE_OF in attrs else PRUNED
    if state == "fail":
        measured = attrs.get(STATUS)
        return measured if measured in (OOM, ERROR, TIMEOUT) else FAILED
    if state == "running":
        return RUNNING
    if state == "waiting":
        return WAITING
    raise ValueError(f"unknown Optuna trial state {state!r}; expected one of {', '.join(STATES)}")
