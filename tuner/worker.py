"""The job worker: claims queued jobs (safely when several workers run), runs each through the study
and the build, records progress and state changes, and re-queues jobs whose worker died."""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import SQLAlchemyError

from tuner.db import FINAL_STATES, Build, DatabaseError, Job, add_event, session_scope, utcnow
from tuner.resume import pid_dead
from tuner.settings import Settings, artifact_dir
from tuner.study_rows import snapshot_study

log = logging.getLogger("tuner.worker")

HEARTBEAT_S = 2.0
# A running job whose heartbeat is older than this lost its worker (on another host; on this host a
# dead pid is noticed at once).
STALE_AFTER_S = 30.0
MAX_ATTEMPTS = 3
RETRY_S = 5.0  # after the database was unreachable


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
    them after `max_attempts`. Returns [(job id, new state)]."""
    changed = []
    with session_scope(url) as s:
        now = utcnow()
        running = s.execute(
            select(Job.id, Job.worker_id, Job.updated_at, Job.attempts).where(Job.state == "running")
        )
        for job_id, dead, heartbeat, attempts in running.all():
            if not worker_is_dead(dead, heartbeat, now, stale_after_s):
                continue
            if attempts >= max_attempts:
                error = f"its worker died {attempts} times while running it (limit {max_attempts}); giving up"
                values = {"state": "failed", "finished_at": now, "error": error}
                event = ("done", {"state": "failed", "error": error})
            else:
                values = {"state": "queued"}
                event = ("requeued", {"reason": f"worker {dead} died", "attempts": attempts})
            # Compare-and-set: several workers may recover at once; only one may move the job.
            hit = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.state == "running", Job.worker_id == dead)
                .values(worker_id=None, updated_at=now, **values)
            )
            if hit.rowcount == 1:
                add_event(s, job_id, *event)
                changed.append((job_id, values["state"]))
    for job_id, state in changed:
        log.warning("job %s: worker died; now %s", job_id, state)
    return changed


def claim_job(url: str | None, worker_id: str) -> int | None:
    """Take the oldest queued job for this worker; None when there is none. Two workers never get
    the same job: PostgreSQL skips rows another worker has locked, SQLite compares-and-sets."""
    now = utcnow()
    claimed = {
        "state": "running",
        "worker_id": worker_id,
        "attempts": Job.attempts + 1,
        "started_at": func.coalesce(Job.started_at, now),
        "updated_at": now,
    }
    with session_scope(url) as s:
        if s.bind.dialect.name == "postgresql":
            job_id = s.scalar(
                select(Job.id)
                .where(Job.state == "queued")
                .order_by(Job.id)
                .limit(1)
                .with_for_update(skip_locked=True)
            )
            if job_id is None:
                return None
            s.execute(update(Job).where(Job.id == job_id).values(**claimed))
        else:
            job_id = None
            for candidate in s.scalars(select(Job.id).where(Job.state == "queued").order_by(Job.id).limit(5)):
                hit = s.execute(
                    update(Job).where(Job.id == candidate, Job.state == "queued").values(**claimed)
                )
                if hit.rowcount == 1:
                    job_id = candidate
                    break
            if job_id is None:
                return None
        attempts = s.scalar(select(Job.attempts).where(Job.id == job_id))
        add_event(s, job_id, "state", {"state": "running", "worker": worker_id, "attempt": attempts})
    return job_id


@dataclass
class WorkerSettings:
    """What a worker needs: the service's settings (`tuner.settings.Settings`, read and checked once
    by the command that starts the worker) plus the worker's own timing."""

    database_url: str
    executor: str = "local"
    artifact_dir: str = field(default_factory=lambda: str(artifact_dir()))
    max_trials: int | None = None  # the service's per-job caps (TUNER_MAX_TRIALS, ...)
    max_timeout_min: float | None = None
    heartbeat_s: float = HEARTBEAT_S
    stale_after_s: float = STALE_AFTER_S
    max_attempts: int = MAX_ATTEMPTS
    poll_s: float = 1.0
    remeasure_top: int = 3  # configs measured again before naming a winner (0: trust one run)
    build: bool = True  # build the winner's kernels (TUNER_BUILD=false: e.g. no compiler on workers)

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> WorkerSettings:
        values: dict[str, Any] = {
            "database_url": settings.database_url,
            "executor": settings.executor,
            "artifact_dir": str(settings.artifact_dir),
            "max_trials": settings.max_trials,
            "max_timeout_min": settings.max_timeout_min,
            "remeasure_top": settings.remeasure_top,
            "build": settings.build,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class Worker:
    """Claims and runs jobs until `shutdown` is set. One job at a time; run several workers
    (processes or hosts) for more."""

    def __init__(self, settings: WorkerSettings, executor: Any = None, worker_id: str | None = None):
        self.settings = settings
        self.worker_id = worker_id or new_worker_id()
        self.shutdown = threading.Event()
        self._executor = executor

    @property
    def executor(self) -> Any:
        if self._executor is None:
            from tuner.executors import make_executor

            self._executor = make_executor(self.settings.executor)
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.close()

    def recover(self) -> list[tuple[int, str]]:
        return recover_jobs(
            self.settings.database_url,
            stale_after_s=self.settings.stale_after_s,
            max_attempts=self.settings.max_attempts,
        )

    def run_once(self) -> int | None:
        """Claim and run one job; returns its id, or None when the queue was empty."""
        job_id = claim_job(self.settings.database_url, self.worker_id)
        if job_id is not None:
            JobRun(self, job_id).run()
        return job_id

    def run_forever(self) -> None:
        log.info("worker %s: waiting for jobs (%s executor)", self.worker_id, self.settings.executor)
        last_recovery = 0.0
        while not self.shutdown.is_set():
            try:
                if time.monotonic() - last_recovery > self.settings.stale_after_s / 2:
                    self.recover()
                    last_recovery = time.monotonic()
                if self.run_once() is not None:
                    continue
            except DatabaseError as err:
                # The database restarting should not take the worker down; its jobs wait for it.
                log.error("worker %s: %s; retrying in %.0f s", self.worker_id, err, RETRY_S)
                self.shutdown.wait(RETRY_S)
                continue
            self.shutdown.wait(self.settings.poll_s)


class JobRun:
    """One claimed job: heartbeat and cancel watch on a thread, the study on this one."""

    def __init__(self, worker: Worker, job_id: int):
        self.worker = worker
        self.url = worker.settings.database_url
        self.job_id = job_id
        self.cancelled = threading.Event()
        self.lost = threading.Event()  # another worker took the job over: stop without writing
        self._done = threading.Event()

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or self.lost.is_set() or self.worker.shutdown.is_set()

    def _heartbeat(self) -> None:
        stopped_trials = False
        while not self._done.wait(self.worker.settings.heartbeat_s):
            try:
                with session_scope(self.url) as s:
                    mine = (Job.id == self.job_id) & (Job.worker_id == self.worker.worker_id)
                    hit = s.execute(
                        update(Job).where(mine, Job.state == "running").values(updated_at=utcnow())
                    )
                    if hit.rowcount == 0:
                        self.lost.set()
                    elif s.scalar(select(Job.cancel_requested).where(Job.id == self.job_id)):
                        self.cancelled.set()
            except Exception as err:  # noqa: BLE001 - a missed beat is not fatal; the next may succeed
                log.warning("job %s: heartbeat failed: %s", self.job_id, err)
            if self.should_stop() and not stopped_trials:
                # Stop the trials in flight now rather than after they finish on their own.
                stopped_trials = True
                self.worker.executor.cancel()

    def _on_progress(self, event: dict[str, Any]) -> None:
        kind = str(event.get("event", "progress"))
        if kind == "done":
            # The job's own `done` comes after the build; SSE clients stop at the first `done`.
            kind = "study_done"
        payload = {k: v for k, v in event.items() if k != "event"}
        with session_scope(self.url) as s:
            job = s.get(Job, self.job_id)
            if job is None or job.worker_id != self.worker.worker_id:
                self.lost.set()
                return
            if isinstance(event.get("done"), int):
                job.trials_done = event["done"]
            if isinstance(event.get("total"), int):
                job.trials_total = event["total"]
            if event.get("best_tokens_per_s") is not None:
                job.best_tokens_per_s = float(event["best_tokens_per_s"])
            job.updated_at = utcnow()
            add_event(s, self.job_id, kind, _jsonable(payload))

    def run(self) -> str:
        """Run the job to a final state (or back to queued when the worker shuts down)."""
        beat = threading.Thread(target=self._heartbeat, name=f"job-{self.job_id}-heartbeat", daemon=True)
        beat.start()
        try:
            outcome = self._run_study()
        except Exception as err:  # noqa: BLE001 - a failing job is data; the worker keeps going
            log.exception("job %s failed", self.job_id)
            # Stopping trials can make the study raise; a stop that was asked for is not a failure.
            outcome = self._stopped() or {"state": "failed", "error": f"{type(err).__name__}: {err}"}
        finally:
            self._done.set()
            beat.join()
        return self._finish(outcome)

    def _run_study(self) -> dict[str, Any]:
        from tuner.devices import resolve_family
        from tuner.fingerprint import fingerprint
        from tuner.recipe import recipe_from_dict
        from tuner.study import run_study, study_name

        with session_scope(self.url) as s:
            job = s.get(Job, self.job_id)
            recipe = recipe_from_dict(job.recipe)
        name = study_name(recipe, fingerprint(resolve_family(recipe.hardware.device)))
        with session_scope(self.url) as s:
            s.get(Job, self.job_id).study_name = name
        cfg = self.worker.settings
        trials = min(recipe.search.trials, cfg.max_trials or recipe.search.trials)
        timeout_min = min(recipe.search.timeout_min, cfg.max_timeout_min or recipe.search.timeout_min)
        summary = run_study(
            recipe,
            storage_url=self.url,
            executor=self.worker.executor,
            trials=trials,
            timeout_s=timeout_min * 60,
            progress=self._on_progress,
            should_stop=self.should_stop,
            remeasure_top=cfg.remeasure_top,
        )
        result = summary.to_dict() if hasattr(summary, "to_dict") else dict(summary)
        stopped = self._stopped()
        if stopped:
            return {**stopped, "summary": result}
        out: dict[str, Any] = {"state": "succeeded", "summary": result}
        best = _best_trial_number(result)
        if best is None:
            out.update(
                state="failed", error="no trial finished ok; GET the job's trials to see why each failed"
            )
            return out
        if cfg.build:
            out["build"] = self._build(recipe, name, best)
        else:
            out["build"] = {"error": "builds are turned off on this service (TUNER_BUILD=false)"}
        return out

    def _stopped(self) -> dict[str, Any] | None:
        """Why the study stopped early, when it was asked to: taken over, shut down or cancelled."""
        if self.lost.is_set():
            return {"state": "lost"}
        if self.worker.shutdown.is_set() and not self.cancelled.is_set():
            return {"state": "queued"}
        if self.cancelled.is_set():
            return {"state": "cancelled"}
        return None

    def _build(self, recipe: Any, name: str, trial_number: int) -> dict[str, Any]:
        try:
            from tuner.artifacts import ArtifactStore
            from tuner.build import build_trial
        except ImportError as err:
            return {"error": f"build step unavailable: {err}"}

        def say(step: int, total: int, message: str) -> None:
            self._on_progress(
                {"event": "build_progress", "step": step, "total_steps": total, "message": message}
            )

        try:
            record = build_trial(
                recipe,
                study_name=name,
                trial_number=trial_number,
                storage_url=self.url,
                store=ArtifactStore(self.worker.settings.artifact_dir),
                progress=say,
            )
        except Exception as err:  # noqa: BLE001 - the best config stands even when its build fails
            log.exception("job %s: build failed", self.job_id)
            return {"error": f"build failed: {type(err).__name__}: {err}"}
        return {
            "trial": trial_number,
            "path": str(record.path),
            "sha256": record.sha256,
            "size_bytes": record.size_bytes,
            "build_id": record.build_id,  # build_trial registers the row; the worker links it to the job
        }

    def _snapshot(self) -> None:
        """Snapshot the study's finished trials, so the dashboard's first view of a large job reads
        one row instead of every trial. A cache: a failure here is logged, never fails the job."""
        try:
            with session_scope(self.url) as s:
                job = s.get(Job, self.job_id)
                name = job.study_name if job is not None else None
            if name:
                snapshot_study(self.url, name)
        except (DatabaseError, SQLAlchemyError) as err:
            log.warning("job %s: could not snapshot study for the dashboard: %s", self.job_id, err)

    def _finish(self, outcome: dict[str, Any]) -> str:
        state = outcome["state"]
        if state == "lost":
            log.warning("job %s was taken over by another worker; leaving it", self.job_id)
            return state
        if state != "queued":
            self._snapshot()
        summary = outcome.get("summary") or {}
        with session_scope(self.url) as s:
            job = s.get(Job, self.job_id)
            if job is None or job.worker_id != self.worker.worker_id or job.state in FINAL_STATES:
                return job.state if job is not None else state
            now = utcnow()
            job.updated_at = now
            if state == "queued":
                # Graceful shutdown: hand the job back without spending one of its attempts.
                job.state, job.worker_id, job.attempts = "queued", None, max(0, job.attempts - 1)
                add_event(s, job.id, "requeued", {"reason": "worker shut down"})
                return state
            _apply_summary(job, summary)
            job.summary = _jsonable(summary) if summary else None
            build = outcome.get("build") or {}
            row = s.get(Build, build["build_id"]) if build.get("build_id") else None
            if row is not None:
                row.job_id = job.id
            elif build.get("path"):
                s.add(
                    Build(
                        job_id=job.id,
                        study_name=job.study_name,
                        trial_number=build["trial"],
                        path=build["path"],
                        sha256=build["sha256"],
                        size_bytes=build["size_bytes"],
                    )
                )
            if build.get("path"):
                add_event(s, job.id, "build", {k: build[k] for k in ("trial", "sha256", "size_bytes")})
            job.error = outcome.get("error") or build.get("error")
            job.state, job.finished_at = state, now
            add_event(
                s,
                job.id,
                "done",
                _jsonable(
                    {
                        "state": state,
                        "error": job.error,
                        "best_tokens_per_s": job.best_tokens_per_s,
                        "speedup": job.speedup,
                        "done": job.trials_done,
                        "total": job.trials_total,
                    }
                ),
            )
        log.info("job %s: %s", self.job_id, state)
        return state


def _best_trial_number(summary: dict[str, Any]) -> int | None:
    best = summary.get("best") or summary.get("best_trial")
    if isinstance(best, dict):
        number = best.get("number", best.get("trial"))
        return int(number) if number is not None else None
    number = summary.get("best_trial_number")
    return int(number) if isinstance(number, int) else None


def _apply_summary(job: Job, summary: dict[str, Any]) -> None:
    best = summary.get("best") if isinstance(summary.get("best"), dict) else {}
    best_tps = summary.get("best_tokens_per_s") or best.get("tokens_per_s") or job.best_tokens_per_s
    baseline = summary.get("baseline_tokens_per_s")
    if isinstance(summary.get("baseline"), dict):
        baseline = baseline or summary["baseline"].get("tokens_per_s")
    job.best_tokens_per_s = float(best_tps) if best_tps is not None else None
    job.baseline_tokens_per_s = float(baseline) if baseline else None
    job.speedup = (
        job.best_tokens_per_s / job.baseline_tokens_per_s if job.best_tokens_per_s and baseline else None
    )
    for key, attr in (("done", "trials_done"), ("trials_done", "trials_done"), ("total", "trials_total")):
        if isinstance(summary.get(key), int):
            setattr(job, attr, summary[key])


def _jsonable(value: Any) -> Any:
    """Payloads go into a JSON column: keep numbers, strings, lists and dicts; stringify the rest."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    return str(value)
