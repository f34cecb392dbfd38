"""The one reader of Optuna's tables: a study's trials as `TrialRecord`s, read in bulk with SQL,
incrementally (a finished trial is never read twice), from the study's snapshot when a process has
nothing cached, and cached per process until the study changes (one cache policy for every caller:
the summary, the REST API, the dashboard, the nightly).

Optuna's storage API builds a FrozenTrial per trial (0.4 to 1 ms each: seconds for a 10,000-trial
study); the readers need a handful of columns. Optuna refuses to update a finished trial, so a
reader holding a study's finished trials only reads those that are new or were still running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from optuna.distributions import CategoricalDistribution, json_to_distribution
from sqlalchemy import Select, and_, func, inspect, select
from sqlalchemy.orm import Session

from tuner.optuna_tables import params as params_t
from tuner.optuna_tables import studies as studies_t
from tuner.optuna_tables import study_attrs as study_attrs_t
from tuner.optuna_tables import system_attrs as system_attrs_t
from tuner.optuna_tables import trials as trials_t
from tuner.optuna_tables import user_attrs as attrs_t
from tuner.optuna_tables import values as values_t
from tuner.record import keys
from tuner.record.ranking import Ranking, rank_trials
from tuner.record.status import FINISHED_STATES, WAITING, status_of
from tuner.record.trial import TrialRecord

log = logging.getLogger(__name__)

# The user attrs read for every trial: what tables, sorting, plots, comparisons and the ranking
# use. The rest (per-step times, the log tail: most of a stored trial's bytes) is read only for
# the few trials shown whole (`with_all_attrs`).
ROW_ATTRS = (
    *keys.RESULT_KEYS,
    *keys.WHERE_KEYS,  # the /v1 trial listing says where each ran
    keys.ROLE,
    keys.PRUNED_REASON,
    keys.DUPLICATE_OF,
    keys.DEVICE_SECONDS,
    keys.LOSSES,  # the ranking's loss-drift check
    keys.CHOSEN_BY,  # the dashboard's predicted-against-measured plot
    keys.PREDICTED_TOKENS_PER_S,
    keys.PREDICTED_INTERVAL,
)
_IN_LIST = 500  # trials read by id list; more are read study-wide


@dataclass
class Finished:
    """The finished trials a reader holds (by Optuna trial id) and each param's distributions."""

    rows: dict[int, TrialRecord] = field(default_factory=dict)
    dists: dict[str, set[str]] = field(default_factory=dict)  # param -> distribution JSONs seen
    # Knob importance and how many completed trials it was computed from (tuner.record.importance).
    importance: tuple[int, dict[str, float]] | None = None

    def distributions(self) -> dict[str, Any]:
        """One Optuna distribution per param for the whole study (`merged_distribution`)."""
        return {name: merged_distribution(d) for name, d in self.dists.items()}


@dataclass
class StudyRecord:
    """Every trial of one study in number order, its user attributes, and what is derived from
    them (computed once per version of the study, under `lock`)."""

    study_name: str
    version: tuple[Any, ...]
    trials: list[TrialRecord]
    user_attrs: dict[str, Any] = field(default_factory=dict)
    distributions: dict[str, Any] = field(default_factory=dict)  # param name -> Optuna distribution
    finished: Finished = field(default_factory=Finished)  # what the next read reuses
    derived: dict[str, Any] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)  # re-entrant: derived may use derived

    @property
    def fingerprint(self) -> dict[str, Any]:
        fp = self.user_attrs.get(keys.FINGERPRINT)
        return fp if isinstance(fp, dict) else {}

    @property
    def recipe(self) -> dict[str, Any]:
        recipe = self.user_attrs.get(keys.RECIPE)
        return recipe if isinstance(recipe, dict) else {}

    @property
    def remeasured(self) -> dict[int, list[float]]:
        """Each trial's re-measurements (study attrs: Optuna refuses to update finished trials)."""
        return keys.per_trial(self.user_attrs, keys.REMEASURED_PREFIX)

    @property
    def remeasured_ci(self) -> dict[int, list[float]]:
        """Each re-measurement's step interval, in the order of `remeasured`."""
        return keys.per_trial(self.user_attrs, keys.REMEASURED_CI_PREFIX)

    def open_ids(self) -> list[int]:
        """Trial ids of the trials this version holds unfinished (the only ones that can change)."""
        return self.cached(
            "open-ids", lambda: [t.trial_id for t in self.trials if not t.finished and t.trial_id is not None]
        )

    def ranking(self) -> Ranking:
        """`rank_trials` of this version of the study."""
        family = self.fingerprint.get("family")
        return self.cached(
            "ranking", lambda: rank_trials(self.trials, self.remeasured, family, self.remeasured_ci)
        )

    def cached(self, key: str, compute: Callable[[], Any]) -> Any:
        with self.lock:
            if key not in self.derived:
                self.derived[key] = compute()
            return self.derived[key]

    def find(self, number: int) -> TrialRecord | None:
        for t in self.trials:
            if t.number == number:
                return t
        return None


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


def fetch(session: Session, stmt: Select) -> list[tuple[Any, ...]]:
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


_with_tables: set[str] = set()  # database URLs known to hold Optuna's tables


def has_studies(session: Session) -> bool:
    """Whether Optuna has made its tables in this database (it does on its first study)."""
    url = session.get_bind().url.render_as_string(hide_password=False)
    if url not in _with_tables and inspect(session.connection()).has_table(studies_t.name):
        _with_tables.add(url)  # only a yes is kept: the tables appear with the first study
    return url in _with_tables


def study_id(session: Session, study_name: str) -> int | None:
    """The study's id; None when there is no such study (or no study at all in this database)."""
    if not has_studies(session):
        return None
    return session.scalar(select(studies_t.c.study_id).where(studies_t.c.study_name == study_name))


def study_names(session: Session) -> list[str]:
    if not has_studies(session):
        return []
    return list(session.scalars(select(studies_t.c.study_name).order_by(studies_t.c.study_id)))


def _state(state: Any) -> str:
    return str(getattr(state, "name", state)).lower()


def study_version(session: Session, sid: int, open_ids: list[int]) -> tuple[Any, ...]:
    """What changes when a trial is added or one of the trials held unfinished (`open_ids`, see
    `StudyRecord.open_ids`) starts, finishes
    or changes state, or the study's attributes change (a re-measurement adds one or grows one):
    its highest trial id (read from the study's index), the state of each trial held unfinished
    (by primary key), the study attributes' count and the length of their JSON together (an
    attribute updated in place, a re-measurement appended to its trial's list, keeps the count).
    Optuna never changes a finished trial, so this is enough, and it costs the same for 10 trials
    as for 10,000 (a scan of the study was 17 ms there)."""
    top = session.scalar(select(func.max(trials_t.c.trial_id)).where(trials_t.c.study_id == sid))
    states: tuple[Any, ...] = ()
    if open_ids:
        stmt = (
            select(trials_t.c.trial_id, trials_t.c.state, trials_t.c.datetime_complete)
            .where(trials_t.c.trial_id.in_(open_ids))
            .order_by(trials_t.c.trial_id)
        )
        states = tuple((tid, _state(state), done) for tid, state, done in session.execute(stmt))
    size = select(func.count(), func.coalesce(func.sum(func.length(study_attrs_t.c.value_json)), 0))
    count, chars = session.execute(size.where(study_attrs_t.c.study_id == sid)).one()
    return (top, states, (count, int(chars)))


def held_version(rows: list[TrialRecord], attrs_size: tuple[int, int]) -> tuple[Any, ...]:
    """`study_version` of the study as these rows and the attributes of size `attrs_size` (see
    `sized_study_user_attrs`) hold it."""
    ids = [r.trial_id for r in rows if r.trial_id is not None]
    states = tuple(
        sorted(
            (r.trial_id, r.state, r.finished_at) for r in rows if not r.finished and r.trial_id is not None
        )
    )
    return (max(ids) if ids else None, states, attrs_size)


def _batches(session: Session, sid: int, todo: dict[int, TrialRecord], make) -> list[tuple[Any, ...]]:
    """Rows of the statement `make(trial_id_filter)` for the trials in `todo`: by id list when
    few, else study-wide from the lowest id on (new trials have the highest ids)."""
    ids = sorted(todo)
    if len(ids) <= _IN_LIST:
        return fetch(session, make(lambda col: col.in_(ids))) if ids else []
    in_study = select(trials_t.c.trial_id).where(trials_t.c.study_id == sid, trials_t.c.trial_id >= ids[0])
    return fetch(session, make(lambda col: col.in_(in_study)))


def read_trials(
    session: Session, sid: int, known: Finished | None = None
) -> tuple[list[TrialRecord], Finished, int]:
    """Every trial of study `sid` in number order, reusing the finished trials in `known` and
    reading the rest. Returns the trials, the finished trials now known, and how many finished
    trials had to be read from Optuna's tables."""
    with collector_paused():
        return _read_trials(session, sid, known or Finished())


def _heads(session: Session, sid: int, known: Finished) -> tuple[list[TrialRecord], dict[int, TrialRecord]]:
    """Every trial's head row; the known finished ones reused, the others new records to fill."""
    out, todo = [], {}
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
        state = _state(state)
        row = known.rows.get(tid)
        if row is not None and row.number == number and row.state == state:
            if row.started_at is None:  # snapshot rows carry no times: the trials table has them
                row.started_at, row.finished_at = started, completed
        else:
            row = TrialRecord(number, state, WAITING, [], {}, {}, started, completed, tid)
            todo[tid] = row
        out.append(row)
    return out, todo


def _read_trials(session: Session, sid: int, known: Finished) -> tuple[list[TrialRecord], Finished, int]:
    rows, todo = _heads(session, sid, known)
    dists = {name: set(d) for name, d in known.dists.items()}
    # Ordered by objective, so values[0] is throughput (objective 0 of every recipe).
    for tid, value in _batches(
        session, sid, todo,
        lambda where: select(values_t.c.trial_id, values_t.c.value)
        .where(where(values_t.c.trial_id)).order_by(values_t.c.trial_id, values_t.c.objective),
    ):  # fmt: skip
        if tid in todo:
            todo[tid].values.append(value)
    for tid, name, internal, dist in _batches(
        session, sid, todo,
        lambda where: select(params_t.c.trial_id, params_t.c.param_name, params_t.c.param_value,
                             params_t.c.distribution_json).where(where(params_t.c.trial_id)),
    ):  # fmt: skip
        if tid in todo:
            todo[tid].params[name] = external_value(dist, internal)
            dists.setdefault(name, set()).add(dist)
    for tid, key, value_json in _batches(
        session, sid, todo,
        lambda where: select(attrs_t.c.trial_id, attrs_t.c.key, attrs_t.c.value_json)
        .where(where(attrs_t.c.trial_id), attrs_t.c.key.in_(ROW_ATTRS)),
    ):  # fmt: skip
        if tid in todo:
            todo[tid].attrs[key] = parse_attr(value_json)
    for tid, key, value_json in _batches(
        session, sid, todo,
        lambda where: select(system_attrs_t.c.trial_id, system_attrs_t.c.key, system_attrs_t.c.value_json)
        .where(where(system_attrs_t.c.trial_id), system_attrs_t.c.key.like(f"{keys.CONSTRAINT_PREFIX}%")),
    ):  # fmt: skip
        if tid in todo:
            todo[tid].constraints[key[len(keys.CONSTRAINT_PREFIX) :]] = float(parse_attr(value_json))
    for row in todo.values():
        row.status = status_of(row.state, row.attrs)
    finished = Finished({r.trial_id: r for r in rows if r.state in FINISHED_STATES}, dists, known.importance)
    return rows, finished, sum(r.state in FINISHED_STATES for r in todo.values())


def sized_study_user_attrs(session: Session, sid: int) -> tuple[dict[str, Any], tuple[int, int]]:
    """The study's user attributes and their size as `study_version` counts it: how many, and the
    length of their stored JSON together."""
    stmt = select(study_attrs_t.c.key, study_attrs_t.c.value_json).where(study_attrs_t.c.study_id == sid)
    rows = fetch(session, stmt)
    size = (len(rows), sum(len(value) for _, value in rows if value is not None))
    return {key: parse_attr(value) for key, value in rows}, size


def study_attrs_of_all(
    session: Session, names: tuple[str, ...], studies: Collection[str] | None = None
) -> dict[str, dict[str, Any]]:
    """{study name: {key: value}} of the study user attrs `names`, for every study or only those
    named in `studies` (one query)."""
    stmt = (
        select(studies_t.c.study_name, study_attrs_t.c.key, study_attrs_t.c.value_json)
        .select_from(studies_t)
        .outerjoin(study_attrs_t, and_(study_attrs_t.c.study_id == studies_t.c.study_id, study_attrs_t.c.key.in_(names)))
    )  # fmt: skip
    if studies is not None:
        stmt = stmt.where(studies_t.c.study_name.in_(list(studies)))
    out: dict[str, dict[str, Any]] = {}
    for name, key, value in fetch(session, stmt):
        attrs = out.setdefault(name, {})
        if key is not None:
            attrs[key] = parse_attr(value)
    return out


def with_all_attrs(session: Session, rows: list[TrialRecord]) -> list[TrialRecord]:
    """Copies of `rows` with every user attr of their trials (one query for all of them)."""
    ids = [r.trial_id for r in rows if r.trial_id is not None]
    full: dict[int, dict[str, Any]] = {i: {} for i in ids}
    if ids:
        stmt = select(attrs_t.c.trial_id, attrs_t.c.key, attrs_t.c.value_json).where(
            attrs_t.c.trial_id.in_(ids)
        )
        for tid, key, value_json in fetch(session, stmt):
            full[tid][key] = parse_attr(value_json)
    return [dataclasses.replace(r, attrs=full.get(r.trial_id, r.attrs)) for r in rows]


@contextlib.contextmanager
def collector_paused():
    """Building ~100,000 dicts and lists in one go sets off the cyclic garbage collector dozens of
    times for nothing (these hold no cycles): 40% of decoding a 10,000-trial snapshot."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ---- the cache: one policy for every reader in this process --------------------------------------

# Studies held in memory, least recently read dropped first (a 10,000-trial study holds ~20 MiB).
CACHED_STUDIES = 32
# A read that had to fetch this many finished trials from Optuna's tables writes a snapshot, so
# the next process (a restarted server, another replica) does not fetch them again.
SNAPSHOT_AFTER = 500
_cache: OrderedDict[tuple[str, str], StudyRecord] = OrderedDict()
_cache_lock = threading.Lock()
_loading: dict[tuple[str, str], threading.Lock] = {}


def read_study(session: Session, study_name: str) -> StudyRecord | None:
    """The study, re-read (incrementally) only when it changed since this process last read it;
    None if there is no such study."""
    from tuner.record import snapshot

    sid = study_id(session, study_name)
    if sid is None:
        return None
    key = (session.get_bind().url.render_as_string(hide_password=False), study_name)
    with _cache_lock:
        loading = _loading.setdefault(key, threading.Lock())
    # One reader per study: a page asks for table, plots and overview at once, and three cold
    # reads of a large study would only compete for the same cores.
    with loading:
        with _cache_lock:
            cached = _cache.get(key)
            if cached is not None:
                _cache.move_to_end(key)
        if cached is not None and cached.version == study_version(session, sid, cached.open_ids()):
            return cached
        known = cached.finished if cached is not None else snapshot.load(session, study_name)
        rows, finished, fetched = read_trials(session, sid, known)
        user_attrs, attrs_size = sized_study_user_attrs(session, sid)
        fresh = StudyRecord(
            study_name=study_name,
            # What the rows hold, not what the tables said before reading them: a trial that
            # changed while they were read differs from it at the next request, and is re-read.
            version=held_version(rows, attrs_size),
            trials=rows,
            user_attrs=user_attrs,
            distributions=finished.distributions(),
            finished=finished,
        )
        with _cache_lock:
            _cache[key] = fresh
            _cache.move_to_end(key)
            while len(_cache) > CACHED_STUDIES:
                _cache.popitem(last=False)
        if fetched >= SNAPSHOT_AFTER:
            # Off the request: the caller is waiting for these trials, not for the snapshot.
            threading.Thread(
                target=snapshot.save_quietly, args=(key[0], study_name, finished), daemon=True
            ).start()
        return fresh


def cached_study_names() -> list[str]:
    with _cache_lock:
        return [name for _, name in _cache]
