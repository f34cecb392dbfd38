"""Every study in the database: as one listing row each (`StudyListing`): what it tunes, how many trials
it holds, when it last changed and which jobs ran it, so a study the CLI or the nightly ran is as
visible as a REST job's (one SQL query for the counts, one for the jobs); and the trial counts
and durations over every study that /metrics exports."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from tuner.optuna_tables import studies as studies_t
from tuner.optuna_tables import trials as trials_t
from tuner.optuna_tables import user_attrs as attrs_t
from tuner.record import keys
from tuner.record.reader import has_studies, parse_attr, study_attrs_of_all
from tuner.record.status import status_of

# Where a study came from: a job of the service, a nightly run, else a run of `tuner tune`.
JOB, NIGHTLY, CLI = "job", "nightly", "cli"


@dataclass
class StudyListing:
    """One study as the studies list shows it."""

    name: str
    recipe_name: str
    recipe_hash: str | None
    trials: int  # every trial the study holds
    finished: int  # trials in a state they never leave
    last_change: dt.datetime | None  # the latest trial start or finish
    source: str  # JOB, NIGHTLY or CLI
    job_ids: list[int] = field(default_factory=list)  # newest first
    fingerprint: dict[str, Any] = field(default_factory=dict)


def _counts(session: Session) -> dict[str, tuple[int, int, dt.datetime | None]]:
    stmt = (
        select(
            studies_t.c.study_name,
            func.count(trials_t.c.trial_id),
            func.count(trials_t.c.datetime_complete),
            func.max(func.coalesce(trials_t.c.datetime_complete, trials_t.c.datetime_start)),
        )
        .select_from(studies_t)
        .outerjoin(trials_t, trials_t.c.study_id == studies_t.c.study_id)
        .group_by(studies_t.c.study_name)
    )
    return {name: (n, done, last) for name, n, done, last in session.execute(stmt)}


def list_studies(session: Session) -> list[StudyListing]:
    """Every study, most recently changed first."""
    from tuner.db import Job, NightlyResult

    if not has_studies(session):
        return []
    counts = _counts(session)
    attrs = study_attrs_of_all(session, (keys.RECIPE, keys.RECIPE_HASH, keys.FINGERPRINT))
    jobs: dict[str, list[int]] = {}
    for job_id, name in session.execute(
        select(Job.id, Job.study_name).where(Job.study_name.is_not(None)).order_by(Job.id.desc())
    ):
        jobs.setdefault(name, []).append(job_id)
    nightly = set(
        session.scalars(select(NightlyResult.study_name).where(NightlyResult.study_name.is_not(None)))
    )
    out = []
    for name, (n, done, last) in counts.items():
        a = attrs.get(name, {})
        recipe = a.get(keys.RECIPE) if isinstance(a.get(keys.RECIPE), dict) else {}
        source = JOB if name in jobs else NIGHTLY if name in nightly else CLI
        fp = a.get(keys.FINGERPRINT)
        out.append(
            StudyListing(
                name,
                str(recipe.get("name") or name),
                a.get(keys.RECIPE_HASH),
                n,
                done,
                last,
                source,
                jobs.get(name, []),
                fp if isinstance(fp, dict) else {},
            )  # fmt: skip
        )
    never = dt.datetime.min
    out.sort(key=lambda s: (s.last_change or never, s.name), reverse=True)
    return out


def trial_counts_and_durations(session: Session) -> tuple[dict[str, int], list[float]]:
    """Trials by status word (`status_of`) across every study, and finished trials' durations:
    what /metrics exports. Grouped in SQL: one row per (state, status attr, duplicate or not)."""
    if not has_studies(session):
        return {}, []
    status_attr, dup_attr = attrs_t.alias("s"), attrs_t.alias("d")
    rows = session.execute(
        select(trials_t.c.state, status_attr.c.value_json, dup_attr.c.trial_id.is_not(None), func.count())
        .select_from(trials_t)
        .outerjoin(status_attr, and_(status_attr.c.trial_id == trials_t.c.trial_id, status_attr.c.key == keys.STATUS))
        .outerjoin(dup_attr, and_(dup_attr.c.trial_id == trials_t.c.trial_id, dup_attr.c.key == keys.DUPLICATE_OF))
        .group_by(trials_t.c.state, status_attr.c.value_json, dup_attr.c.trial_id.is_not(None))
    ).all()  # fmt: skip
    counts: dict[str, int] = {}
    for state, status_json, duplicate, n in rows:
        attrs: dict[str, Any] = {keys.STATUS: parse_attr(status_json)} if status_json else {}
        if duplicate:
            attrs[keys.DUPLICATE_OF] = True
        word = status_of(str(getattr(state, "name", state)), attrs)
        counts[word] = counts.get(word, 0) + n
    durations = [
        (end - start).total_seconds()
        for start, end in session.execute(
            select(trials_t.c.datetime_start, trials_t.c.datetime_complete).where(
                trials_t.c.datetime_complete.is_not(None), trials_t.c.datetime_start.is_not(None)
            )
        )
    ]
    return counts, durations


def job_fingerprints(session: Session, limit: int = 50) -> list[tuple[int, dict[str, Any], Any]]:
    """(job id, fingerprint, recorded device priors or None) of the newest job of each of the
    service's newest studies (at most `limit` studies) whose study records a fingerprint, newest
    first, one per fingerprint: the devices the service's workers ran on (a Ray cluster's nodes, or
    the workers' own machines), which the API host need not have, and what those devices measured
    of themselves (`keys.DEVICE_PRIORS`). Counted by study, so a nightly re-running one recipe takes
    one place."""
    from tuner.db import Job

    newest = func.max(Job.id)
    rows = session.execute(
        select(newest, Job.study_name)
        .where(Job.study_name.is_not(None))
        .group_by(Job.study_name)
        .order_by(newest.desc())
        .limit(limit)
    ).all()
    if not rows or not has_studies(session):
        return []
    from tuner.fingerprint import fingerprint_hash

    wanted = (keys.FINGERPRINT, keys.DEVICE_PRIORS)
    attrs = study_attrs_of_all(session, wanted, {name for _, name in rows})
    out, seen = [], set()
    for job_id, name in rows:
        fp = attrs.get(name, {}).get(keys.FINGERPRINT)
        if isinstance(fp, dict) and (key := fingerprint_hash(fp)) not in seen:
            seen.add(key)
            out.append((job_id, fp, attrs[name].get(keys.DEVICE_PRIORS)))
    return out


def study_fingerprint(session: Session, study_name: str) -> tuple[dict[str, Any], str | None]:
    """The fingerprint a study records (the devices and software its trials ran on) and its hash,
    or ({}, None): two attributes, without reading the study's trials."""
    if not has_studies(session):
        return {}, None
    found = study_attrs_of_all(session, (keys.FINGERPRINT, keys.FINGERPRINT_HASH), [study_name])
    fp, fp_hash = (found.get(study_name, {}).get(k) for k in (keys.FINGERPRINT, keys.FINGERPRINT_HASH))
    if not isinstance(fp, dict):
        return {}, None
    return fp, fp_hash if isinstance(fp_hash, str) else None
