"""A study's trials as light rows (`tuner.study_rows`), cached per process until the study changes.
The dashboard sorts, filters, pages and downsamples these rows in memory. When the study changes,
only new and unfinished trials are read again; a server with nothing cached starts from the
study's snapshot, and writes one back after reading many trials."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from tuner.db import DatabaseError
from tuner.optuna_tables import study_attrs as study_attrs_t
from tuner.study_rows import (
    CATEGORIES,
    Finished,
    TrialRow,
    load_snapshot,
    parse_attr,
    read_rows,
    save_snapshot,
    study_id,
    study_version,
    with_all_attrs,
)

__all__ = ["CATEGORIES", "StudyRows", "TrialRow", "load_study_rows", "with_all_attrs"]

log = logging.getLogger(__name__)

# A read that had to fetch this many finished trials from Optuna's tables writes a snapshot, so
# the next server start (or another replica) does not fetch them again.
SNAPSHOT_AFTER = 500


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
    finished: Finished = field(default_factory=Finished)  # what the next read reuses


# Studies held in memory, least recently read dropped first (a 10,000-trial study holds 19 MiB).
CACHED_STUDIES = 32
_cache: OrderedDict[tuple[str, str], StudyRows] = OrderedDict()
_cache_lock = threading.Lock()
_loading: dict[tuple[str, str], threading.Lock] = {}


def load_study_rows(session: Session, study_name: str) -> StudyRows | None:
    """The study's rows, re-read (incrementally) only when the study changed since the last call;
    None if there is no such study."""
    sid = study_id(session, study_name)
    if sid is None:
        return None
    url = session.get_bind().url
    key = (url.render_as_string(hide_password=False), study_name)
    with _cache_lock:
        loading = _loading.setdefault(key, threading.Lock())
    # One reader per study: a page asks for table, plots and overview at once, and three cold
    # reads of a large study would only compete for the same cores.
    with loading:
        version = study_version(session, sid)
        with _cache_lock:
            cached = _cache.get(key)
            if cached is not None:
                _cache.move_to_end(key)
        if cached is not None and cached.version == version:
            return cached
        known = cached.finished if cached is not None else load_snapshot(session, study_name)
        rows, finished, fetched = read_rows(session, sid, known)
        fingerprint = session.scalar(
            select(study_attrs_t.c.value_json).where(
                study_attrs_t.c.study_id == sid, study_attrs_t.c.key == "fingerprint"
            )
        )
        fresh = StudyRows(
            study_name=study_name,
            version=version,
            rows=rows,
            distributions=finished.distributions(),
            fingerprint=parse_attr(fingerprint) if fingerprint else {},
            finished=finished,
        )
        with _cache_lock:
            _cache[key] = fresh
            _cache.move_to_end(key)
            while len(_cache) > CACHED_STUDIES:
                _cache.popitem(last=False)
        if fetched >= SNAPSHOT_AFTER:
            # Off the request: the page is waiting for these rows, not for the snapshot.
            threading.Thread(target=_save, args=(key[0], study_name, finished), daemon=True).start()
        return fresh


def _save(url: str, study_name: str, finished: Finished) -> None:
    try:
        save_snapshot(url, study_name, finished)
    except (DatabaseError, SQLAlchemyError) as err:  # a cache: the next read works without it
        log.warning("could not snapshot study %s: %s", study_name, err)
