"""A study's trials as light rows, read in bulk from Optuna's tables, and the study snapshot that
lets the next reader (a freshly started API server too) read only what changed.

Optuna refuses to update a finished trial, so a reader that holds a study's finished trials needs
only the trials that are new or were still running. `read_rows` takes those it holds and reads the
rest. A snapshot keeps the finished rows in one compressed row of `study_snapshots`: the worker
writes it when a job ends, and the dashboard writes it back after reading many trials. Without
one, a 10,000-trial study is ~250,000 parameter and attribute rows; with one, a single row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import gc
import json
import logging
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from optuna.distributions import CategoricalDistribution, json_to_distribution
from sqlalchemy import Select, exc, func, select
from sqlalchemy.orm import Session

from tuner.db import StudySnapshot, session_scope, utcnow
from tuner.optuna_tables import params as params_t
from tuner.optuna_tables import studies as studies_t
from tuner.optuna_tables import trials as trials_t
from tuner.optuna_tables import user_attrs as attrs_t
from tuner.optuna_tables import values as values_t
from tuner.result import BREAKDOWN_CATEGORIES

log = logging.getLogger(__name__)

FAILED = ("oom", "error", "timeout")
FINISHED = ("complete", "fail", "pruned")  # Optuna states a trial never leaves
CATEGORIES = BREAKDOWN_CATEGORIES  # of the `breakdown` user attr of a profiled trial
# The user attrs read for every trial: what the trials table, its sorting, the plots and the
# comparison metrics use. The rest (per-step losses and times, the log tail: most of a stored
# trial's bytes) is read only for the few trials shown whole (`with_all_attrs`).
ROW_ATTRS = (
    "status",
    "role",
    "error",
    "pruned_reason",
    "tokens_per_s",
    "samples_per_s",
    "step_time_s",
    "tflops",
    "mfu",
    "peak_mem_allocated_bytes",
    "peak_mem_reserved_bytes",
    "estimated_peak_mem_bytes",
)
SNAPSHOT_FORMAT = 1
_IN_LIST = 500  # trials read by id list; more are read study-wide
IMPORTANCE_LIMIT = 1000  # completed trials, evenly spaced, the importance evaluator sees


@dataclass
class TrialRow:
    """One trial. `attrs` holds the ROW_ATTRS only, unless the row came from `with_all_attrs`."""

    number: int
    state: str  # Optuna state, lower case: complete, running, pruned, fail, waiting
    status: str  # measured status (ok, oom, error, timeout, pruned), else the Optuna state
    values: list[float | None]
    params: dict[str, Any]
    attrs: dict[str, Any]
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    trial_id: int | None = None  # Optuna's row id

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
class Finished:
    """The finished trials a reader holds (by Optuna trial id) and each param's distributions."""

    rows: dict[int, TrialRow] = field(default_factory=dict)
    dists: dict[str, set[str]] = field(default_factory=dict)  # param -> distribution JSONs seen
    # Knob importance and how many completed trials it was computed from (see `importances`).
    importance: tuple[int, dict[str, float]] | None = None

    def distributions(self) -> dict[str, Any]:
        """One Optuna distribution per param for the whole study (`merged_distribution`)."""
        return {name: merged_distribution(d) for name, d in self.dists.items()}


@lru_cache(maxsize=1024)
def distribution(distribution_json: str) -> Any:
    return json_to_distribution(distribution_json)


@lru_cache(maxsize=4096)
def external_value(distribution_json: str, internal: float) -> Any:
    """A param as the user sees it, from Optuna's stored (internal) value and distribution."""
    return distribution(distribution_json).to_external_repr(internal)


def merged_distribution(dist_jsons: set[str]) -> Any:
    """One distribution per param for the whole study. A categorical knob recorded with different
    choices (dp is single-choice next to the split label; overrides narrow a domain) gets the union."""
    dists = [distribution(d) for d in sorted(dist_jsons)]
    if len(dists) > 1 and all(isinstance(d, CategoricalDistribution) for d in dists):
        choices: list[Any] = []
        for d in dists:
            choices.extend(c for c in d.choices if c not in choices)
        return CategoricalDistribution(choices)
    return dists[-1]


def parse_attr(value_json: str) -> Any:
    try:
        return json.loads(value_json)
    except ValueError:
        return value_json


def _fetch(session: Session, stmt: Select) -> list[tuple[Any, ...]]:
    """All rows of `stmt` as plain tuples from the driver's cursor. SQLAlchemy's result rows cost
    three times as much as the query itself for the ~300,000 param and attribute rows of a
    10,000-trial study. Only integers and fixed key names are bound, so literal binds are safe."""
    conn = session.connection()
    sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
    cursor = conn.connection.dbapi_connection.cursor()
    try:
        cursor.execute(sql)
        return cursor.fetchall()
    finally:
        cursor.close()


def study_id(session: Session, study_name: str) -> int | None:
    return session.scalar(select(studies_t.c.study_id).where(studies_t.c.study_name == study_name))


def study_version(session: Session, sid: int) -> tuple[Any, ...]:
    """Changes when a trial is added, finishes or changes state: cheap enough to ask per request."""
    row = session.execute(
        select(
            func.count(),
            func.count(trials_t.c.datetime_complete),
            func.max(trials_t.c.datetime_complete),
            func.max(trials_t.c.trial_id),
        ).where(trials_t.c.study_id == sid)
    ).one()
    return tuple(row)


def _batches(session: Session, sid: int, todo: dict[int, TrialRow], make) -> list[tuple[Any, ...]]:
    """Rows of the statement `make(trial_id_filter)` for the trials in `todo`: by id list when
    few, else study-wide from the lowest id on (new trials have the highest ids)."""
    ids = sorted(todo)
    if len(ids) <= _IN_LIST:
        return _fetch(session, make(lambda col: col.in_(ids))) if ids else []
    in_study = select(trials_t.c.trial_id).where(trials_t.c.study_id == sid, trials_t.c.trial_id >= ids[0])
    return _fetch(session, make(lambda col: col.in_(in_study)))


def read_rows(
    session: Session, sid: int, known: Finished | None = None
) -> tuple[list[TrialRow], Finished, int]:
    """Every trial of study `sid` in number order, reusing the finished trials in `known` and
    reading the rest. Returns the rows, the finished trials now known, and how many finished
    trials had to be read from Optuna's tables."""
    with _collector_paused():
        return _read_rows(session, sid, known or Finished())


def _read_rows(session: Session, sid: int, known: Finished) -> tuple[list[TrialRow], Finished, int]:
    rows: list[TrialRow] = []
    todo: dict[int, TrialRow] = {}
    heads = session.execute(
        select(
            trials_t.c.trial_id,
            trials_t.c.number,
            trials_t.c.state,
            trials_t.c.datetime_start,
            trials_t.c.datetime_complete,
        )
        .where(trials_t.c.study_id == sid)
        .order_by(trials_t.c.number)
    )
    for tid, number, state, started, completed in heads:
        state = str(getattr(state, "name", state)).lower()
        row = known.rows.get(tid)
        if row is not None and row.number == number and row.state == state:
            if row.started_at is None:  # snapshot rows carry no times: the trials table has them
                row.started_at, row.finished_at = started, completed
        else:
            row = TrialRow(number, state, "", [], {}, {}, started, completed, tid)
            todo[tid] = row
        rows.append(row)

    dists = {name: set(d) for name, d in known.dists.items()}
    # Ordered by objective, so values[0] is throughput (objective 0 of every recipe).
    for tid, value in _batches(
        session,
        sid,
        todo,
        lambda where: (
            select(values_t.c.trial_id, values_t.c.value)
            .where(where(values_t.c.trial_id))
            .order_by(values_t.c.trial_id, values_t.c.objective)
        ),
    ):
        if tid in todo:
            todo[tid].values.append(value)
    for tid, name, internal, dist in _batches(
        session,
        sid,
        todo,
        lambda where: select(
            params_t.c.trial_id, params_t.c.param_name, params_t.c.param_value, params_t.c.distribution_json
        ).where(where(params_t.c.trial_id)),
    ):
        if tid in todo:
            todo[tid].params[name] = external_value(dist, internal)
            dists.setdefault(name, set()).add(dist)
    for tid, key, value_json in _batches(
        session,
        sid,
        todo,
        lambda where: select(attrs_t.c.trial_id, attrs_t.c.key, attrs_t.c.value_json).where(
            where(attrs_t.c.trial_id), attrs_t.c.key.in_(ROW_ATTRS)
        ),
    ):
        if tid in todo:
            todo[tid].attrs[key] = parse_attr(value_json)
    for row in todo.values():
        status = row.attrs.get("status")
        row.status = status if isinstance(status, str) and status else row.state
    finished = Finished({r.trial_id: r for r in rows if r.state in FINISHED}, dists, known.importance)
    return rows, finished, sum(r.state in FINISHED for r in todo.values())


def importances(rows: list[TrialRow], finished: Finished, distributions: dict[str, Any]) -> dict[str, float]:
    """Knob importance for tokens/s (Optuna's PED-ANOVA: fast, no model to fit), most important
    first. Reuses the importance in `finished` while the completed trials grew by at most 2%
    since (for a large study, one more trial does not move it), else computes and keeps it."""
    done = [r for r in rows if r.state == "complete" and r.tokens_per_s is not None]
    if finished.importance is not None and 0 <= len(done) - finished.importance[0] <= 0.02 * len(done):
        return finished.importance[1]
    ranked = _ped_anova(done, distributions)
    finished.importance = (len(done), ranked)
    return ranked


def _ped_anova(done: list[TrialRow], distributions: dict[str, Any]) -> dict[str, float]:
    import optuna
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances
    from optuna.trial import TrialState, create_trial

    if len(done) < 4:
        return {}
    step = max(1.0, len(done) / IMPORTANCE_LIMIT)
    chosen = [done[int(i * step)] for i in range(min(len(done), IMPORTANCE_LIMIT))]
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    frozen = []
    for r in chosen:
        names = [k for k in r.params if k in distributions]
        try:
            frozen.append(
                create_trial(
                    state=TrialState.COMPLETE,
                    params={k: r.params[k] for k in names},
                    distributions={k: distributions[k] for k in names},
                    value=r.tokens_per_s,
                )
            )
        except ValueError:
            continue  # a param outside its recorded domain: leave the trial out
    present = {k for t in frozen for k in t.params}
    # Single-choice params (dp/tp/pp are recorded next to the split label) carry no information.
    params = [k for k, d in distributions.items() if k in present and not d.single()]
    if not params or len(frozen) < 4:
        return {}
    study = optuna.create_study(direction="maximize")
    study.add_trials(frozen)
    ranked = get_param_importances(study, evaluator=PedAnovaImportanceEvaluator(), params=params)
    return {k: float(v) for k, v in ranked.items()}


def with_all_attrs(session: Session, rows: list[TrialRow]) -> list[TrialRow]:
    """Copies of `rows` with every user attr of their trials (one query for all of them)."""
    ids = [r.trial_id for r in rows if r.trial_id is not None]
    full: dict[int, dict[str, Any]] = {i: {} for i in ids}
    if ids:
        stmt = select(attrs_t.c.trial_id, attrs_t.c.key, attrs_t.c.value_json).where(
            attrs_t.c.trial_id.in_(ids)
        )
        for tid, key, value_json in _fetch(session, stmt):
            full[tid][key] = parse_attr(value_json)
    return [dataclasses.replace(r, attrs=full.get(r.trial_id, r.attrs)) for r in rows]


def _encode(finished: Finished) -> bytes:
    payload = {
        "format": SNAPSHOT_FORMAT,
        "row_attrs": list(ROW_ATTRS),
        "dists": {name: sorted(d) for name, d in finished.dists.items()},
        "importance": finished.importance,
        "rows": [
            [tid, r.number, r.state, r.status, r.values, r.params, r.attrs]
            for tid, r in finished.rows.items()
        ],
    }
    return zlib.compress(json.dumps(payload, separators=(",", ":")).encode(), 1)


@contextlib.contextmanager
def _collector_paused():
    """Building ~100,000 dicts and lists in one go sets off the cyclic garbage collector dozens of
    times for nothing (these hold no cycles): 40% of decoding a 10,000-trial snapshot."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _decode(data: bytes) -> Finished | None:
    with _collector_paused():
        return _decode_payload(json.loads(zlib.decompress(data)))


def _decode_payload(payload: dict[str, Any]) -> Finished | None:
    if payload.get("format") != SNAPSHOT_FORMAT or payload.get("row_attrs") != list(ROW_ATTRS):
        return None  # written by another version: read the study afresh
    rows = {
        tid: TrialRow(number, state, status, values, params, attrs, None, None, tid)
        for tid, number, state, status, values, params, attrs in payload["rows"]
    }
    importance = payload.get("importance")
    return Finished(
        rows,
        {name: set(d) for name, d in payload["dists"].items()},
        (int(importance[0]), dict(importance[1])) if importance else None,
    )


def load_snapshot(session: Session, study_name: str) -> Finished | None:
    """The study's finished trials as last snapshotted, or None (none, or unreadable)."""
    data = session.scalar(select(StudySnapshot.data).where(StudySnapshot.study_name == study_name))
    if data is None:
        return None
    try:
        return _decode(data)
    except (ValueError, TypeError, KeyError, zlib.error) as err:
        log.warning("ignoring the unreadable snapshot of study %s: %s", study_name, err)
        return None


def save_snapshot(url: str | None, study_name: str, finished: Finished) -> None:
    """Store `finished` as the study's snapshot, replacing an older one."""
    data = _encode(finished)
    with session_scope(url) as s:
        snap = s.get(StudySnapshot, study_name)
        if snap is None:
            s.add(
                StudySnapshot(study_name=study_name, trials=len(finished.rows), data=data, saved_at=utcnow())
            )
        elif snap.trials <= len(finished.rows):  # never replace a fuller one (two writers racing)
            snap.trials, snap.data, snap.saved_at = len(finished.rows), data, utcnow()


def snapshot_study(url: str | None, study_name: str) -> int:
    """Read the study (from its snapshot on) and snapshot its finished trials and knob importance;
    returns how many trials. The worker calls this when a job ends, so the first dashboard view of
    a large job reads one row instead of every trial and computes no importance."""
    with session_scope(url) as s:
        sid = study_id(s, study_name)
        if sid is None:
            return 0
        rows, finished, fetched = read_rows(s, sid, load_snapshot(s, study_name))
    before = finished.importance
    importances(rows, finished, finished.distributions())
    if fetched or finished.importance != before:
        with contextlib.suppress(exc.IntegrityError):  # another writer stored it first
            save_snapshot(url, study_name, finished)
    return len(finished.rows)
