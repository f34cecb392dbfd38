"""The job worker: the queue in the database (`queue`), the worker that claims jobs (`service`), and
one claimed job run through the study and the build (`job`)."""

from tuner.worker.job import JobRun, Outcome
from tuner.worker.queue import claim_job, new_worker_id, recover_jobs, worker_is_dead
from tuner.worker.service import Worker, WorkerSettings

__all__ = [
    "JobRun",
    "Outcome",
    "Worker",
    "WorkerSettings",
    "claim_job",
    "new_worker_id",
    "recover_jobs",
    "worker_is_dead",
]
