"""Reads Optuna's tables with SQLAlchemy directly, one page at a time: the Optuna API would load
every trial of a study (slow with 10,000 trials) to show twenty."""

from __future__ import annotations

import datetime as dt
import json
import threading
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from api.schemas import TrialPublic
from tuner.optuna_tables import params, studies, study_attrs, trials, user_attrs, values  # noqa: F401
from tuner.result import RESULT_KEYS
from tuner.study_rows import external_value, parse_attr, study_id

SORTS = ("number", "-number", "tokens_per_s", "-tokens_per_s")
STATES = ("running", "complete", "pruned", "fail", "waiting")
STATUSES = ("ok", "oom", "error", "timeout", "pruned")


def _throughput():
    # Objective 0 is throughput (tokens/s) for both objectives a recipe may ask for.
    return values.alias("v0")


def read_trials(
    session: Session,
    study_name: str,
    *,
    limit: int = 50,
    offset: int = 0,
    status: str | None = None,
    sort: str = "number",
) -> tuple[list[TrialPublic], int]:
    """One page of a study's trials and the total matching the filter."""
    sid = study_id(session, study_name)
    if sid is None:
        return [], 0
    v0 = _throughput()
    query = (
        select(trials, v0.c.value)
        .select_from(trials)
        .outerjoin(v0, and_(v0.c.trial_id == trials.c.trial_id, v0.c.objective == 0))
        .where(trials.c.study_id == sid)
    )
    if status in STATES:
        query = query.where(trials.c.state == status.upper())
    elif status in STATUSES:
        ua = user_attrs.alias("ua")
        query = query.join(
            ua,
            and_(
                ua.c.trial_id == trials.c.trial_id,
                ua.c.key == "status",
                ua.c.value_json == json.dumps(status),
            ),
        )
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    order = {
        "number": [trials.c.number.asc()],
        "-number": [trials.c.number.desc()],
        "tokens_per_s": [v0.c.value.is_(None), v0.c.value.asc(), trials.c.number.asc()],
        "-tokens_per_s": [v0.c.value.is_(None), v0.c.value.desc(), trials.c.number.asc()],
    }[sort]
    rows = session.execute(query.order_by(*order).limit(limit).offset(offset)).all()
    return _hydrate(session, rows), total


_summaries: dict[tuple[str, str], tuple[tuple[int, int, int], dict[str, Any]]] = {}
_summaries_lock = threading.Lock()


def study_summary(session: Session, url: str, study_name: str) -> dict[str, Any] | None:
    """tuner.summary's verdict on a study, recomputed only when the study changed: summarising
    reads every trial (seconds for 10,000), while a job's page polls it."""
    sid = study_id(session, study_name)
    if sid is None:
        return None
    finished = select(func.count()).where(trials.c.study_id == sid, trials.c.state != "RUNNING")
    running = select(func.count()).where(trials.c.study_id == sid, trials.c.state == "RUNNING")
    attrs = select(func.count()).where(study_attrs.c.study_id == sid)  # re-measurements live here
    version = (session.scalar(finished) or 0, session.scalar(running) or 0, session.scalar(attrs) or 0)
    with _summaries_lock:
        cached = _summaries.get((url, study_name))
    if cached and cached[0] == version:
        return cached[1]
    from tuner.summary import summarize

    summary = summarize(study_name, url).to_dict()
    with _summaries_lock:
        if len(_summaries) > 256:  # a bound, not an LRU: refilling costs one summarize per study
            _summaries.clear()
        _summaries[(url, study_name)] = (version, summary)
    return summary


def _hydrate(session: Session, rows) -> list[TrialPublic]:
    ids = [r.trial_id for r in rows]
    by_params: dict[int, dict[str, Any]] = {i: {} for i in ids}
    by_attrs: dict[int, dict[str, Any]] = {i: {} for i in ids}
    if ids:
        for p in session.execute(select(params).where(params.c.trial_id.in_(ids))):
            by_params[p.trial_id][p.param_name] = external_value(p.distribution_json, p.param_value)
        for a in session.execute(select(user_attrs).where(user_attrs.c.trial_id.in_(ids))):
            by_attrs[a.trial_id][a.key] = parse_attr(a.value_json)
    out = []
    for r in rows:
        attrs = by_attrs[r.trial_id]
        config = (
            attrs.get("config") if isinstance(attrs.get("config"), dict) else _config(by_params[r.trial_id])
        )
        start, end = r.datetime_start, r.datetime_complete
        out.append(
            TrialPublic(
                number=r.number,
                state=str(r.state).lower(),
                status=attrs.get("status"),
                tokens_per_s=r.value if r.value is not None else attrs.get("tokens_per_s"),
                config=config,
                result={k: attrs[k] for k in RESULT_KEYS if k in attrs},
                started_at=_utc(start),
                finished_at=_utc(end),
                duration_s=(end - start).total_seconds() if start and end else None,
            )
        )
    return out


def _config(trial_params: dict[str, Any]) -> dict[str, Any]:
    """The full knob setting of a trial, in knob names (the stored params hold only sampled knobs)."""
    from tuner.config import ConfigError
    from tuner.space import config_from_params

    try:
        return config_from_params(trial_params).to_dict()
    except (ConfigError, TypeError, ValueError):
        return trial_params


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    return value.replace(tzinfo=dt.timezone.utc) if value is not None and value.tzinfo is None else value


def trial_counts_and_durations(session: Session) -> tuple[dict[str, int], list[float]]:
    """Trials by measured status (or Optuna state when unmeasured), and finished trials' durations,
    across all studies: what /metrics exports."""
    status_attr = user_attrs.alias("s")
    rows = session.execute(
        select(trials.c.state, status_attr.c.value_json, func.count())
        .select_from(trials)
        .outerjoin(
            status_attr, and_(status_attr.c.trial_id == trials.c.trial_id, status_attr.c.key == "status")
        )
        .group_by(trials.c.state, status_attr.c.value_json)
    ).all()
    counts: dict[str, int] = {}
    for state, status_json, n in rows:
        try:
            key = json.loads(status_json) if status_json else str(state).lower()
        except ValueError:
            key = str(state).lower()
        counts[str(key)] = counts.get(str(key), 0) + n
    durations = [
        (end - start).total_seconds()
        for start, end in session.execute(
            select(trials.c.datetime_start, trials.c.datetime_complete).where(
                trials.c.datetime_complete.is_not(None), trials.c.datetime_start.is_not(None)
            )
        )
    ]
    return counts, durations
