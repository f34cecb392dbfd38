"""The /v1 views of a study, from the one reader (`tuner.record.reader.read_study`, cached until
the study changes): a page of its trials, sorted and filtered in memory, and its winner
(`tuner.record.winner`)."""

from __future__ import annotations

import datetime as dt
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
# What ?status= takes: a status word, or an Optuna state.
STATUS_FILTERS = tuple(dict.fromkeys((*STATUSES, *STATES)))


def _value(t: TrialRecord) -> float | None:
    """Objective 0 (throughput) as Optuna stored it."""
    return t.values[0] if t.values else None


def _ordered(study: StudyRecord, status: str | None, sort: str) -> list[TrialRecord]:
    def compute() -> list[TrialRecord]:
        rows = study.trials
        if status is not None:
            rows = [t for t in rows if t.status == status or t.state == status]
        if sort in ("number", "-number"):
            return sorted(rows, key=lambda t: t.number, reverse=sort == "-number")
        sign = -1.0 if sort.startswith("-") else 1.0
        with_value = sorted(
            (t for t in rows if _value(t) is not None), key=lambda t: (sign * _value(t), t.number)
        )
        return with_value + [t for t in rows if _value(t) is None]

    return study.cached(("v1-order", status, sort), compute)


def read_trials(
    session: Session,
    study_name: str,
    *,
    limit: int = 50,
    offset: int = 0,
    status: str | None = None,
    sort: str = "number",
) -> tuple[list[dict[str, Any]], int]:
    """One page of a study's trials (each `TrialPublic` in its JSON form) and the total matching
    the filter."""
    study = read_study(session, study_name)
    if study is None:
        return [], 0
    ordered = _ordered(study, status, sort)
    public = study.cached("v1-public", dict)  # trial number -> its JSON form, for this version
    page = []
    for t in ordered[offset : offset + limit]:
        item = public.get(t.number)
        if item is None:
            # Built once per trial and study version: validating and dumping the model for every
            # row of every page was most of a page's time with 10,000 trials.
            item = public[t.number] = public_item(t, study.remeasured.get(t.number, []))
        page.append(item)
    return page, len(ordered)


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
