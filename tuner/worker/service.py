"""The worker: claims queued jobs one at a time and runs each (`JobRun`), re-queueing the jobs of
workers that died. Run several workers (processes or hosts) for more jobs at once."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tuner.db import DatabaseError
from tuner.settings import Settings, artifact_dir
from tuner.stopping import StopFlag
from tuner.worker.queue import (
    HEARTBEAT_S,
    MAX_ATTEMPTS,
    RETRY_S,
    STALE_AFTER_S,
    STUDY_BUSY_RETRY_S,
    claim_job,
    new_worker_id,
    recover_jobs,
)

log = logging.getLogger("tuner.worker")


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
    """Claims and runs jobs until `shutdown` is set. One job at a time."""

    def __init__(self, settings: WorkerSettings, executor: Any = None, worker_id: str | None = None):
        self.settings = settings
        self.worker_id = worker_id or new_worker_id()
        # Set by the SIGTERM/SIGINT handler of `tuner worker`: a StopFlag, which needs no lock.
        self.shutdown = StopFlag()
        self._executor = executor
        # Jobs whose study another driver holds: id -> when to look again (`hold_back`).
        self._held: dict[int, float] = {}

    @property
    def executor(self) -> Any:
        if self._executor is None:
            from tuner.executors import make_executor

            self._executor = make_executor(self.settings.executor)
        return self._executor

    def start_executor(self) -> None:
        """Join the Ray cluster now, at the worker's start (`tuner worker` exits 2 on its error):
        joined at a job's claim instead, a cluster that did not answer failed every queued job in
        turn within milliseconds. The local executor has nothing to reach; it is made at the first
        job, as before (it starts its warm helper, a torch import)."""
        if self.settings.executor == "ray":
            _ = self.executor

    def executor_lost(self) -> str | None:
        """Why this worker's executor cannot run trials now (its Ray cluster no longer answers),
        or None. A job that failed meanwhile goes back to the queue (`JobRun`), and no job is
        claimed until the cluster answers again: the fault is the worker's, not the job's."""
        address = os.environ.get("RAY_ADDRESS")
        if self.settings.executor != "ray" or not address:
            return None  # a local Ray runtime lives and dies with this process
        from tuner.executors.ray_address import check_cluster

        try:
            check_cluster(address, "RAY_ADDRESS")
        except ConnectionError as err:
            return str(err)
        return None

    def hold_back(self, job_id: int) -> bool:
        """Claim `job_id` again only after STUDY_BUSY_RETRY_S: its study has another live driver
        (`tuner.resume.StudyBusy`). Claimed at once, the job would go back and forth between
        queued and running until that driver ends. True the first time, when the job says why."""
        first = job_id not in self._held
        self._held[job_id] = time.monotonic() + STUDY_BUSY_RETRY_S
        return first

    def cancel_trials(self) -> None:
        """Stop the trials in flight (from the job's heartbeat thread). An executor not made yet
        runs none: it is not made here, where the job's own thread may be making it."""
        if self._executor is not None:
            self._executor.cancel()

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
        from tuner.worker.job import JobRun

        lost = self.executor_lost()
        if lost:
            log.error("worker %s: claiming no job until the cluster answers: %s", self.worker_id, lost)
            self.shutdown.wait(RETRY_S)
            return None
        now = time.monotonic()
        waiting = [job for job, until in self._held.items() if until > now]
        job_id = claim_job(self.settings.database_url, self.worker_id, skip=waiting)
        if job_id is not None:
            JobRun(self, job_id).run()
            if self._held.get(job_id, now) <= now:
                self._held.pop(job_id, None)  # it ran (or ended) this time: no longer waiting
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
