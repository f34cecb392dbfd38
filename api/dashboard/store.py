"""A study's trials as light rows, read straight from Optuna's tables and cached until the study
changes. The dashboard sorts, filters, pages and downsamples these rows in memory."""

from __future__ import annotations

import datetime as dt
import json
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from optuna.distributions import CategoricalDistribution, json_to_distribution
from sqlalchemy import Column, Integer, MetaData, Select, String, Table, Text, func, select
from sqlalchemy.orm import Session

# Optuna owns these tables; api.trials declares the columns both readers use.
from api.trials import params as params_t
from api.trials import studies as studies_t
from api.trials import trials as trials_t
from api.trials import user_attrs as attrs_t
from api.trials import values as values_t

# Optuna's own storage API builds a FrozenTrial per trial (0.4 to 1 ms each: 4 to 10 s for a
# 10,000-trial study). The dashboard needs a handful of columns, so it reads those in bulk.

# Not declared in api.trials: the study's own attributes (tuner.study stores the fingerprint there).
study_attrs_t = Table(
    "study_user_attributes",
    MetaData(),
    Column("study_id", Integer),
    Column("key", String),
    Column("value_json", Text),
)

FAILED = ("oom", "error", "timeout")
# Step-time breakdown categories, in stacking order (the `breakdown` user attr of a profiled trial).
CATEGORIES = ("compute", "attention", "communication", "optimizer", "idle")


@dataclass
class TrialRow:
    number: int
    state: str  # Optuna state, lower case: complete, running, pruned, fail, waiting
    status: str  # measured status (ok, oom, error, timeout, pruned), else the Optuna state
    values: list[float | None]
    params: dict[str, Any]
    attrs: dict[str, Any]
    started_at: dt.datetime | None
    finished_at: dt.datetime | None

    @property
    def tokens_per_s(self) -> float | None:
        measured = self.attrs.get("tokens_per_s")
        if isinstance(measured, (int, float)):
            return float(measured)
        return self.values[0] if self.values and self.state == "complete" else None

    @property
    def duration_s(self) -> float | None:
        if self.started_at and self.finished_at:
            return (self.finished_at - self.started_at).total_seconds()
        return None

    @property
    def failed(self) -> bool:
        return self.status in FAILED or self.state == "fail"

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
        """What one row of the trials table shows."""
        return {
            "number": self.number,
            "state": self.state,
            "status": self.status,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.attrs.get("mfu"),
            "peak_mem_allocated_bytes": self.attrs.get("peak_mem_allocated_bytes"),
            "estimated_peak_mem_bytes": self.attrs.get("estimated_peak_mem_bytes"),
            "step_time_s": self.attrs.get("step_time_s"),
            "duration_s": self.duration_s,
            # Why it failed or was pruned (estimated OOM, infeasible, duplicate): the status's tooltip.
            "error": self.attrs.get("error") or self.attrs.get("pruned_reason"),
            "params": self.params,
        }

    def detail(self) -> dict[str, Any]:
        """Everything the dashboard shows for one trial (best card, failure, comparison)."""
        return {**self.summary(), "attrs": self.attrs, "values": self.values}


@dataclass
class StudyRows:
    """Every trial of one study, in number order, and aggregates computed from them (per version)."""

    study_name: str
    version: tuple[Any, ...]
    rows: list[TrialRow]
    distributions: dict[str, Any] = field(default_factory=dict)  # param name -> Optuna distribution
    fingerprint: dict[str, Any] = field(default_factory=dict)  # device, torch, driver... of the study
    derived: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


@lru_cache(maxsize=1024)
def _distribution(distribution_json: str) -> Any:
    return json_to_distribution(distribution_json)


@lru_cache(maxsize=4096)
def _external(distribution_json: str, internal: float) -> Any:
    return _distribution(distribution_json).to_external_repr(internal)


def _merged(dist_jsons: list[str]) -> Any:
    """One distribution per param for the whole study. A categorical knob recorded with different
    choices (dp is single-choice next to the split label; overrides narrow a domain) gets the union."""
    dists = [_distribution(d) for d in dist_jsons]
    if len(dists) > 1 and all(isinstance(d, CategoricalDistribution) for d in dists):
        choices: list[Any] = []
        for d in dists:
            choices.extend(c for c in d.choices if c not in choices)
        return CategoricalDistribution(choices)
    return dists[-1]


def _attr(value_json: str) -> Any:
    try:
        return json.loads(value_json)
    except ValueError:
        return value_json


def _fetch(session: Session, stmt: Select) -> list[tuple[Any, ...]]:
    """All rows of `stmt` as plain tuples from the driver's cursor. SQLAlchemy's result rows cost
    three times as much as the query itself for the ~300,000 param and attribute rows of a
    10,000-trial study. Only integer ids are bound, so literal binds are safe."""
    conn = session.connection()
    sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
    cursor = conn.connection.dbapi_connection.cursor()
    try:
        cursor.execute(sql)
        return cursor.fetchall()
    finally:
        cursor.close()


def _version(session: Session, sid: int) -> tuple[Any, ...]:
    # Changes when a trial is added, finishes or changes state: cheap enough to ask per request.
    row = session.execute(
        select(
            func.count(),
            func.count(trials_t.c.datetime_complete),
            func.max(trials_t.c.datetime_complete),
            func.max(trials_t.c.trial_id),
        ).where(trials_t.c.study_id == sid)
    ).one()
    return tuple(row)


def _read(session: Session, sid: int) -> tuple[list[TrialRow], dict[str, Any]]:
    by_id: dict[int, TrialRow] = {}
    for r in session.execute(select(trials_t).where(trials_t.c.study_id == sid).order_by(trials_t.c.number)):
        by_id[r.trial_id] = TrialRow(
            number=r.number,
            state=str(r.state).lower(),
            status="",
            values=[],
            params={},
            attrs={},
            started_at=r.datetime_start,
            finished_at=r.datetime_complete,
        )
    in_study = select(trials_t.c.trial_id).where(trials_t.c.study_id == sid)
    # Ordered by objective, so values[0] is throughput (objective 0 of every recipe).
    for tid, value in _fetch(
        session,
        select(values_t.c.trial_id, values_t.c.value)
        .where(values_t.c.trial_id.in_(in_study))
        .order_by(values_t.c.trial_id, values_t.c.objective),
    ):
        row = by_id.get(tid)
        if row is not None:
            row.values.append(value)
    dist_json: dict[str, set[str]] = {}
    for tid, name, internal, dist in _fetch(
        session,
        select(
            params_t.c.trial_id, params_t.c.param_name, params_t.c.param_value, params_t.c.distribution_json
        ).where(params_t.c.trial_id.in_(in_study)),
    ):
        row = by_id.get(tid)
        if row is not None:
            row.params[name] = _external(dist, internal)
            dist_json.setdefault(name, set()).add(dist)
    for tid, key, value_json in _fetch(
        session,
        select(attrs_t.c.trial_id, attrs_t.c.key, attrs_t.c.value_json).where(
            attrs_t.c.trial_id.in_(in_study)
        ),
    ):
        row = by_id.get(tid)
        if row is not None:
            row.attrs[key] = _attr(value_json)
    for row in by_id.values():
        status = row.attrs.get("status")
        row.status = status if isinstance(status, str) and status else row.state
    distributions = {name: _merged(sorted(d)) for name, d in dist_json.items()}
    return sorted(by_id.values(), key=lambda r: r.number), distributions


_cache: dict[tuple[str, str], StudyRows] = {}
_cache_lock = threading.Lock()
_loading: dict[tuple[str, str], threading.Lock] = {}


def load_study_rows(session: Session, study_name: str) -> StudyRows | None:
    """The study's rows, re-read only when the study changed since the last call; None if no study."""
    sid = session.scalar(select(studies_t.c.study_id).where(studies_t.c.study_name == study_name))
    if sid is None:
        return None
    key = (str(session.get_bind().url), study_name)
    with _cache_lock:
        loading = _loading.setdefault(key, threading.Lock())
    # One reader per study: a page asks for table, plots and overview at once, and three cold
    # reads of a large study would only compete for the same cores.
    with loading:
        version = _version(session, sid)
        with _cache_lock:
            cached = _cache.get(key)
        if cached is not None and cached.version == version:
            return cached
        rows, distributions = _read(session, sid)
        fingerprint = session.scalar(
            select(study_attrs_t.c.value_json).where(
                study_attrs_t.c.study_id == sid, study_attrs_t.c.key == "fingerprint"
            )
        )
        fresh = StudyRows(
            study_name=study_name,
            version=version,
            rows=rows,
            distributions=distributions,
            fingerprint=_attr(fingerprint) if fingerprint else {},
        )
        with _cache_lock:
            _cache[key] = fresh
        return fresh
