"""The /v1 views of a study, from the one reader (`tuner.record.reader.read_study`, cached until
the study changes): a page of its trials, sorted and filtered in memory and paged by position in
that order (a keyset cursor), and its winner (`tuner.record.winner`)."""

from __future__ import annotations

import bisect
import datetime as dt
import re
from functools import lru_cache
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tuner.db import FINAL_STATES, Build, Job
from tuner.record import keys
from tuner.record.ranking import finite_runs
from tuner.record.reader import StudyRecord, read_study
from tuner.record.status import COMPLETE_STATE, OK, STATES, STATUSES
from tuner.record.trial import TrialRecord
from tuner.record.winner import Verdict, job_verdict

SORTS = ("number", "-number", "tokens_per_s", "-tokens_per_s")
_BY_NUMBER = ("number", "-number")
# What ?status= takes: a status word, or an Optuna state (`matches_status`).
STATUS_FILTERS = tuple(dict.fromkeys((*STATUSES, *STATES)))
# A value sort's cursor: the throughput as Python writes it (an exponent without its `+`, which a
# query string reads as a space) or nothing for a trial without one, `_`, the trial number.
_VALUE_CURSOR = re.compile(r"(-?(?:inf|[0-9]+(?:\.[0-9]*)?(?:e-?[0-9]+)?))?_([0-9]{1,9})")
_NEW_START = "start again without a cursor"

Key = tuple[float, ...]


class CursorError(ValueError):
    """A cursor this list did not give; the message says what to do instead."""


def _value(t: TrialRecord) -> float | None:
    """Objective 0 (throughput) as Optuna stored it."""
    return t.values[0] if t.values else None


def _key(sort: str, number: int, value: float | None) -> Key:
    """A trial's place in `sort`'s order, as a key that ascends along the list and differs for
    every trial: the trial number breaks ties, and trials without a throughput come last."""
    sign = -1 if sort.startswith("-") else 1
    if sort in _BY_NUMBER:
        return (sign * number,)
    return (1, 0.0, number) if value is None else (0, sign * value, number)


def matches_status(t: TrialRecord, word: str) -> bool:
    """Whether a status filter's `word` (`STATUS_FILTERS`) takes trial `t`: a status word by the
    trial's status, an Optuna state no status word spells (complete, fail) by its state. `pruned`
    is both, and means the status: state `pruned` also holds the duplicates, which a filter on
    `pruned` listed though their status says `duplicate` and the counts beside it do not count them.
    The /v1 trials list and the dashboard's table filter by this one rule."""
    return t.status == word or (word not in STATUSES and t.state == word)


def _ordered(study: StudyRecord, status: str | None, sort: str) -> tuple[list[TrialRecord], list[Key]]:
    def compute() -> tuple[list[TrialRecord], list[Key]]:
        rows = study.trials
        if status is not None:
            rows = [t for t in rows if matches_status(t, status)]
        keyed = sorted(((_key(sort, t.number, _value(t)), t) for t in rows), key=lambda kt: kt[0])
        return [t for _, t in keyed], [k for k, _ in keyed]

    return study.cached(("v1-order", status, sort), compute)


def cursor_of(t: TrialRecord, sort: str) -> str:
    """The cursor of the page that starts at `t`: its place in the order (its number, and its
    throughput in a value sort), not an offset, so trials added meanwhile shift no later page. A
    number-sorted page's cursor is the trial number it starts at, which the old offset cursors
    of an ascending, unfiltered list also were."""
    if sort in _BY_NUMBER:
        return str(t.number)
    value = _value(t)
    return f"{'' if value is None else repr(value).replace('e+', 'e')}_{t.number}"


def cursor_key(cursor: str, sort: str) -> Key:
    """Where the page of `cursor` starts in `sort`'s order; CursorError when no page of this sort
    gave it."""
    by_number = re.fullmatch(r"[0-9]{1,9}", cursor)
    by_value = _VALUE_CURSOR.fullmatch(cursor)
    if sort in _BY_NUMBER and by_number:
        return _key(sort, int(cursor), None)
    if sort not in _BY_NUMBER and by_value:
        value = by_value.group(1)
        return _key(sort, int(by_value.group(2)), float(value) if value else None)
    if by_number or by_value:
        made_for = "number" if by_number else "tokens_per_s"
        raise CursorError(f"a cursor of a page sorted by {made_for}, not {sort}: {_NEW_START}")
    raise CursorError(f"not a cursor of this list: pass a page's next_cursor unchanged, or {_NEW_START}")


def read_trials(
    session: Session,
    study_name: str,
    *,
    limit: int = 50,
    start: Key | None = None,
    status: str | None = None,
    sort: str = "number",
) -> tuple[list[dict[str, Any]], int, str | None]:
    """One page of a study's trials (each `TrialPublic` in its JSON form) from `start`
    (`cursor_key`; None: the first page), the total matching the filter, and the next page's
    cursor (None after the last page)."""
    study = read_study(session, study_name)
    if study is None:
        return [], 0, None
    ordered, keys = _ordered(study, status, sort)
    first = 0 if start is None else bisect.bisect_left(keys, start)
    public = study.cached("v1-public", dict)  # trial number -> its JSON form, for this version
    page = []
    for t in ordered[first : first + limit]:
        item = public.get(t.number)
        if item is None:
            # Built once per trial and study version: validating and dumping the model for every
            # row of every page was most of a page's time with 10,000 trials.
            item = public[t.number] = public_item(t, study.remeasured.get(t.number, []))
        page.append(item)
    after = first + limit
    return page, len(ordered), cursor_of(ordered[after], sort) if after < len(ordered) else None


def public_item(t: TrialRecord, remeasured: list[float]) -> dict[str, Any]:
    """A trial as `TrialPublic`'s JSON, built by hand: pydantic's validate-then-dump of each row was
    most of a page's time (tests/test_api.py checks the two agree). `remeasured`: the study's
    re-measurements of the trial's config."""
    stored = t.attrs.get(keys.CONFIG)
    value = _value(t)
    return {
        "number": t.number,
        "state": t.state,
        "status": t.status,
        "tokens_per_s": value if value is not None else t.attrs.get(keys.TOKENS_PER_S),
        "remeasured_tokens_per_s": finite_runs(remeasured),
        "config": stored if isinstance(stored, dict) else _config(t.params),
        "result": {
            k: t.attrs[k] for k in (*keys.RESULT_KEYS, *keys.WHERE_KEYS, keys.MEASURE_STOP) if k in t.attrs
        },
        "started_at": _iso(t.started_at),
        "finished_at": _iso(t.finished_at),
        "duration_s": t.duration_s,
    }


def _config(params: dict[str, Any]) -> dict[str, Any]:
    try:
        key = tuple(sorted(params.items()))
        hash(key)
    except TypeError:
        key = None
    if key is None:
        return _config_of(params)
    return _cached_config(key)


@lru_cache(maxsize=20_000)
def _cached_config(key: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    # Many trials share a config (duplicates, re-queued ones); callers copy nothing: read only.
    return _config_of(dict(key))


def _config_of(params: dict[str, Any]) -> dict[str, Any]:
    config = TrialRecord(0, COMPLETE_STATE, OK, [], params, {}, None, None).config()
    return config.to_dict() if config else params


def _iso(value: dt.datetime | None) -> str | None:
    """Pydantic's JSON form of a UTC datetime (`Z`); naive database times are UTC."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.isoformat().replace("+00:00", "Z")


def winner(session: Session, job: Job, *, with_study: bool = False) -> tuple[Verdict, StudyRecord | None]:
    """The job's winner (`tuner.record.winner.job_verdict`) and, when the winner needed it or
    `with_study`, its study as read now (a finished job's winner is the one it recorded)."""
    recorded = job.state in FINAL_STATES and (job.summary or {}).get("best")
    need = job.study_name and (with_study or not recorded)
    study = read_study(session, job.study_name) if need else None
    build = session.scalar(
        select(Build.trial_number).where(Build.job_id == job.id).order_by(Build.id.desc()).limit(1)
    )
    return job_verdict(job.state, job.summary, study, build), study
