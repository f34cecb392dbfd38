"""The job queue in the database: a worker claims the oldest queued job (safely when several
workers run), and jobs whose worker died are re-queued (their study resumes) or failed."""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import uuid
from collections.abc import Collection

from sqlalchemy import func, select, update

from tuner.db import CANCELLED, FAILED, QUEUED, RUNNING, Job, add_event, session_scope, utcnow
from tuner.resume import STALE_AFTER_S as DRIVER_STALE_AFTER_S
from tuner.resume import pid_dead

log = logging.getLogger("tuner.worker")

HEARTBEAT_S = 2.0
# A running job whose heartbeat is older than this lost its worker (on another host; on this host a
# dead pid is noticed at once). The study's own rule for its trials' driver, not a shorter one: a
# job re-queued sooner found its dead driver's trials still alive to the study, left them
# `running`, and could fill its budget before they counted as dead.
STALE_AFTER_S = DRIVER_STALE_AFTER_S
MAX_ATTEMPTS = 3
RETRY_S = 5.0  # after the database was unreachable
STUDY_BUSY_RETRY_S = 10.0  # a job whose study another driver holds is looked at again after this
CLAIM_WINDOW = 20  # queued jobs a claim looks at, oldest first (those waiting their study's turn skipped)


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def worker_is_dead(
    worker_id: str | None, heartbeat: dt.datetime, now: dt.datetime, stale_after_s: float
) -> bool:
    host, _, rest = (worker_id or "").partition(":")
    pid = rest.partition(":")[0]
    if host == socket.gethostname() and pid.isdigit() and pid_dead(int(pid)):
        return True
    return (now - heartbeat).total_seconds() > stale_after_s


def recover_jobs(
    url: str | None = None, *, stale_after_s: float = STALE_AFTER_S, max_attempts: int = MAX_ATTEMPTS
) -> list[tuple[int, str]]:
    """Re-queue running jobs whose worker died (their study resumes under the same name), or fail
    them after `max_attempts`; one whose cancel was asked for ends cancelled, as its worker would
    have ended it (never queued again). Returns [(job id, new state)]."""
    changed = []
    with session_scope(url) as s:
        now = utcnow()
        running = s.execute(
            select(Job.id, Job.worker_id, Job.updated_at, Job.attempts, Job.cancel_requested).where(
                Job.state == RUNNING
            )
        )
        for job_id, worker_id, heartbeat, attempts, cancel in running.all():
            if not worker_is_dead(worker_id, heartbeat, now, stale_after_s):
                continue
            if cancel:
                reason = f"cancelled; its worker {worker_id} died before it stopped"
                values = {"state": CANCELLED, "finished_at": now}
                event = ("done", {"state": CANCELLED, "reason": reason})
            elif attempts >= max_attempts:
                error = f"its worker died {attempts} times while running it (limit {max_attempts}); giving up"
                values = {"state": FAILED, "finished_at": now, "error": error}
                event = ("done", {"state": FAILED, "error": error})
            else:
                values = {"state": QUEUED}
                event = ("requeued", {"reason": f"worker {worker_id} died", "attempts": attempts})
            # Compare-and-set: several workers may recover at once; only one may move the job, and
            # not one whose heartbeat came in since it was read (its worker lives after all).
            hit = s.execute(
                update(Job)
                .where(
                    Job.id == job_id,
                    Job.state == RUNNING,
                    Job.worker_id == worker_id,
                    Job.updated_at == heartbeat,
                )
                .values(worker_id=None, updated_at=now, **values)
            )
            if hit.rowcount == 1:
                add_event(s, job_id, *event)
                changed.append((job_id, values["state"]))
    for job_id, state in changed:
        log.warning("job %s: worker died; now %s", job_id, state)
    return changed


def _shares_a_running_study(s, candidates: list[tuple[int, str, dict]]) -> set[int]:
    """The candidates (id, recipe hash, recipe) that would drive a study another job is driving
    now: a recipe that reuses its study (`search.reuse`, the default) names the same study as a
    running job of the same recipe and name on the same kind of worker (`tuner.study.study_name`:
    the name's slug, the hash, the fingerprint). Two drivers of one study overrun its trial budget
    and overwrite each other's re-measurements, so the second waits its turn. A job of the same
    recipe under another name (a nightly's `<recipe>@nightly-<night>`) has a study of its own and
    runs beside it: keyed by the hash alone, it waited, with workers idle, for a study it never
    touches (and the nightly cancels a job still unfinished past its timeout and grace)."""
    from tuner.study.naming import name_slug

    def study_key(recipe_hash: str, recipe: dict | None) -> tuple[str, str] | None:
        recipe = recipe or {}
        if not (recipe.get("search") or {}).get("reuse", True):
            return None  # the job's own study, `<study>-job<ID>`
        return name_slug(str(recipe.get("name") or "")), recipe_hash

    running = s.execute(select(Job.recipe_hash, Job.recipe).where(Job.state == RUNNING)).all()
    shared = {study_key(recipe_hash, recipe) for recipe_hash, recipe in running} - {None}
    return {job_id for job_id, recipe_hash, recipe in candidates if study_key(recipe_hash, recipe) in shared}


def claim_job(url: str | None, worker_id: str, skip: Collection[int] = ()) -> int | None:
    """Take the oldest queued job for this worker that no running job's study holds (see
    `_shares_a_running_study`) and is not in `skip` (jobs the worker holds back); None when there
    is none. Two workers never get the same job:
    PostgreSQL skips rows another worker has locked, SQLite compares-and-sets."""
    now = utcnow()
    claimed = {
        "state": RUNNING,
        "worker_id": worker_id,
        "attempts": Job.attempts + 1,
        "started_at": func.coalesce(Job.started_at, now),
        "updated_at": now,
    }
    queued = select(Job.id, Job.recipe_hash, Job.recipe).where(Job.state == QUEUED).order_by(Job.id)
    if skip:
        queued = queued.where(Job.id.not_in(list(skip)))
    with session_scope(url) as s:
        job_id = None
        if s.bind.dialect.name == "postgresql":
            candidates = s.execute(queued.limit(CLAIM_WINDOW).with_for_update(skip_locked=True)).all()
            busy = _shares_a_running_study(s, candidates)
            job_id = next((c[0] for c in candidates if c[0] not in busy), None)
            if job_id is None:
                return None
            s.execute(update(Job).where(Job.id == job_id).values(**claimed))
        else:
            candidates = s.execute(queued.limit(CLAIM_WINDOW)).all()
            busy = _shares_a_running_study(s, candidates)
            for candidate, _, _ in candidates:
                if candidate in busy:
                    continue
                hit = s.execute(update(Job).where(Job.id == candidate, Job.state == QUEUED).values(**claimed))
                if hit.rowcount == 1:
                    job_id = candidate
                    break
            if job_id is None:
                return None
        attempts = s.scalar(select(Job.attempts).where(Job.id == job_id))
        add_event(s, job_id, "state", {"state": RUNNING, "worker": worker_id, "attempt": attempts})
    return job_id
