"""A study's finished trials kept in one compressed row of `study_snapshots`, so a process with
nothing cached (a freshly started API server, another replica) reads one row instead of ~25
Optuna parameter and attribute rows per trial. The worker writes it when a job ends; the reader
writes it back after fetching many trials. A cache: unreadable or written by another version, it
is ignored."""

from __future__ import annotations

import contextlib
import json
import logging
import zlib
from typing import Any

from sqlalchemy import exc, inspect, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from tuner.db import DatabaseError, StudySnapshot, session_scope, utcnow
from tuner.record.importance import importances
from tuner.record.reader import ROW_ATTRS, Finished, collector_paused, read_trials, study_id
from tuner.record.trial import TrialRecord

log = logging.getLogger(__name__)

FORMAT = 2  # 2: records carry their constraints and the status words of tuner.record.status


def _encode(finished: Finished) -> bytes:
    payload = {
        "format": FORMAT,
        "row_attrs": list(ROW_ATTRS),
        "dists": {name: sorted(d) for name, d in finished.dists.items()},
        "importance": finished.importance,
        "rows": [
            [tid, r.number, r.state, r.status, r.values, r.params, r.attrs, r.constraints]
            for tid, r in finished.rows.items()
        ],
    }
    return zlib.compress(json.dumps(payload, separators=(",", ":")).encode(), 1)


def _decode(data: bytes) -> Finished | None:
    with collector_paused():
        payload: dict[str, Any] = json.loads(zlib.decompress(data))
        if payload.get("format") != FORMAT or payload.get("row_attrs") != list(ROW_ATTRS):
            return None  # written by another version: read the study afresh
        rows = {
            tid: TrialRecord(number, state, status, values, params, attrs, None, None, tid, constraints)
            for tid, number, state, status, values, params, attrs, constraints in payload["rows"]
        }
        importance = payload.get("importance")
        return Finished(
            rows,
            {name: set(d) for name, d in payload["dists"].items()},
            (int(importance[0]), dict(importance[1])) if importance else None,
        )


_has_table: set[str] = set()  # database URLs known to hold study_snapshots


def _snapshots_exist(session: Session) -> bool:
    """Whether this database has the snapshot table: one made by Optuna alone (a study run
    without `tuner db upgrade`) does not, and then there is simply no snapshot."""
    url = session.get_bind().url.render_as_string(hide_password=False)
    if url not in _has_table and inspect(session.connection()).has_table(StudySnapshot.__tablename__):
        _has_table.add(url)  # only a yes is kept: the table appears once the schema is upgraded
    return url in _has_table


def load(session: Session, study_name: str) -> Finished | None:
    """The study's finished trials as last snapshotted, or None (none, or unreadable)."""
    if not _snapshots_exist(session):
        return None
    data = session.scalar(select(StudySnapshot.data).where(StudySnapshot.study_name == study_name))
    if data is None:
        return None
    try:
        return _decode(data)
    except (ValueError, TypeError, KeyError, zlib.error) as err:
        log.warning("ignoring the unreadable snapshot of study %s: %s", study_name, err)
        return None


def save(url: str | None, study_name: str, finished: Finished) -> None:
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


def save_quietly(url: str, study_name: str, finished: Finished) -> None:
    """`save`, logging instead of raising: a cache, the next read works without it."""
    try:
        with session_scope(url) as s:
            if not _snapshots_exist(s):
                return
        save(url, study_name, finished)
    except (DatabaseError, SQLAlchemyError) as err:
        log.warning("could not snapshot study %s: %s", study_name, err)


def snapshot_study(url: str | None, study_name: str) -> int:
    """Read the study (from its snapshot on) and snapshot its finished trials and knob importance;
    returns how many trials. The worker calls this when a job ends, so the first dashboard view of
    a large job reads one row instead of every trial and computes no importance."""
    with session_scope(url) as s:
        sid = study_id(s, study_name)
        if sid is None:
            return 0
        if not _snapshots_exist(s):
            return 0
        rows, finished, fetched = read_trials(s, sid, load(s, study_name))
    before = finished.importance
    importances(rows, finished, finished.distributions())
    if fetched or finished.importance != before:
        with contextlib.suppress(exc.IntegrityError):  # another writer stored it first
            save(url, study_name, finished)
    return len(finished.rows)
