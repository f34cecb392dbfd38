"""Request and response shapes of the REST API, kept apart from the database tables."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import BaseModel, Field

from tuner.db import Job, JobState
from tuner.nightly.tuners import history_name
from tuner.record.studies import StudyListing
from tuner.worker.wording import one_line, progress_line

# Job ids are database integers (PostgreSQL INTEGER); a larger number is a 422, not a driver error.
JOB_ID_MAX = 2_147_483_647  # the jobs table's 32-bit integer key
JobId = Annotated[int, Path(ge=1, le=JOB_ID_MAX, description="The job's id.")]


class FieldError(BaseModel):
    field: str = Field(description="Dotted path of the offending field, e.g. search.trials.")
    message: str


# api/errors.py builds every error through this model and declares it for every error status.
class ErrorBody(BaseModel):
    """The body of every error response."""

    detail: str = Field(description="What went wrong and what to do about it.")
    errors: list[FieldError] = Field(description="One entry per offending field; may be empty.")


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    return value.replace(tzinfo=dt.timezone.utc) if value is not None else None


class JobPublic(BaseModel):
    id: int
    name: str
    history_name: str = Field(
        description="The name its recipe's nightly history is kept under: `name` without a nightly "
        "run's `@nightly-<night>` tag (the dashboard's /ui/recipes/<history_name>)."
    )
    state: JobState
    recipe_hash: str
    study_name: str | None
    trials_done: int = Field(description="Trials of the job's budget done (at most trials_total).")
    trials_total: int
    trials_reused: int = Field(
        0, description="Measured trials found in the study when the job started (earlier runs)."
    )
    progress: str = Field(description="e.g. '6 of 6: reused from 12 measured earlier'.")
    best_tokens_per_s: float | None
    baseline_tokens_per_s: float | None = Field(description="Throughput of the default config.")
    speedup: float | None = Field(description="best_tokens_per_s / baseline_tokens_per_s.")
    error: str | None = Field(description="One line: what failed and what to do next (the log: links.log).")
    cancel_requested: bool
    attempts: int
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    updated_at: dt.datetime
    recipe: dict[str, Any]
    links: dict[str, str]

    @classmethod
    def from_row(cls, job: Job) -> JobPublic:
        base = f"/v1/jobs/{job.id}"
        return cls(
            id=job.id,
            name=job.recipe_name,
            history_name=history_name(job.recipe_name),
            state=job.state,
            recipe_hash=job.recipe_hash,
            study_name=job.study_name,
            trials_done=min(job.trials_done, job.trials_total) if job.trials_total else job.trials_done,
            trials_total=job.trials_total,
            trials_reused=job.trials_reused or 0,
            progress=progress_line(job.trials_done, job.trials_total, job.trials_reused),
            best_tokens_per_s=job.best_tokens_per_s,
            baseline_tokens_per_s=job.baseline_tokens_per_s,
            speedup=job.speedup,
            error=one_line(job.error),
            cancel_requested=job.cancel_requested,
            attempts=job.attempts,
            created_at=_utc(job.created_at),
            started_at=_utc(job.started_at),
            finished_at=_utc(job.finished_at),
            updated_at=_utc(job.updated_at),
            recipe=job.recipe,
            links={
                "self": base,
                "events": f"{base}/events",
                "trials": f"{base}/trials",
                "best": f"{base}/best",
                "build": f"{base}/build",
                "cancel": f"{base}/cancel",
                **({"log": f"{base}/log"} if job.log else {}),  # the whole failure behind `error`
            },
        )


class JobPage(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None = Field(
        description="Pass as ?cursor=, with the same state, for the next page; null at the end."
    )


class JobLog(BaseModel):
    job_id: int
    state: JobState
    error: str | None = Field(description="The one-line error the job's views show.")
    log: str = Field(description="The whole failure as the worker saw it (a traceback, a build log).")


class StudyPublic(BaseModel):
    name: str
    recipe_name: str
    recipe_hash: str | None
    source: str = Field(description="job (a REST job ran it), nightly, or cli (`tuner tune`).")
    trials: int
    finished: int
    best_tokens_per_s: float | None = Field(description="The winner's median, as every view shows it.")
    last_change: dt.datetime | None
    job_ids: list[int] = Field(description="Jobs that ran this study, newest first.")
    fingerprint: dict[str, Any]
    links: dict[str, str]

    @classmethod
    def from_listing(cls, s: StudyListing, best: float | None) -> StudyPublic:
        links = {"page": f"/ui/studies/{s.name}", "build": f"/v1/studies/{s.name}/build"}
        if s.job_ids:
            links.update(job=f"/v1/jobs/{s.job_ids[0]}", page=f"/ui/jobs/{s.job_ids[0]}")
        return cls(
            name=s.name, recipe_name=s.recipe_name, recipe_hash=s.recipe_hash, source=s.source,
            trials=s.trials, finished=s.finished, best_tokens_per_s=best, last_change=_utc(s.last_change),
            job_ids=s.job_ids, fingerprint=s.fingerprint, links=links,
        )  # fmt: skip


class StudyPage(BaseModel):
    items: list[StudyPublic]


class TrialPublic(BaseModel):
    number: int
    state: str = Field(description="Optuna state: running, complete, pruned, fail, waiting.")
    status: str | None = Field(
        description="The trial's status word: ok, oom, error, timeout (measured), pruned, duplicate, "
        "failed (stopped without a measurement), running, waiting."
    )
    tokens_per_s: float | None
    remeasured_tokens_per_s: list[float] = Field(
        description="The config measured again after the search (the winner and its rivals): the "
        "ranking takes the median over these and tokens_per_s."
    )
    config: dict[str, Any]
    result: dict[str, Any]
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    duration_s: float | None


class TrialPage(BaseModel):
    items: list[TrialPublic]
    total: int = Field(description="Trials matching the filter.")
    next_cursor: str | None = Field(
        description="Pass as ?cursor=, with the same status and sort, for the next page; null at the end."
    )


class BestPublic(BaseModel):
    job_id: int
    study_name: str
    trial: int = Field(description="Trial number of the winner.")
    config: dict[str, Any] = Field(description="The winning knob setting (knobs that apply).")
    tokens_per_s: float = Field(description="Median over the trial and its re-measurements.")
    metrics: dict[str, Any] = Field(description="The winner's measured result keys.")
    noise: float | None = Field(
        None, description="Relative: the larger of the spread over measurements and within the trial's steps."
    )
    interval: float | None = Field(
        None,
        description="Relative half-width of the throughput's 95% interval: the steps' interval and the "
        "run-to-run noise, over the runs (null for trials measured before intervals existed).",
    )
    baseline_tokens_per_s: float | None
    speedup: float | None = Field(description="Best over the default config's throughput.")
    tie: bool = Field(False, description="The runner-up is within measurement noise.")
    counts: dict[str, int] = Field(default_factory=dict, description="Trials by status.")
    fingerprint: dict[str, Any] = Field(
        default_factory=dict,
        description="What the trials ran on (device model and count, torch and driver versions, CPU): "
        "results of two fingerprints are not comparable.",
    )
    fingerprint_hash: str | None = Field(
        None, description="Short hash of `fingerprint` (part of the study name)."
    )


class SearchSpacePublic(BaseModel):
    name: str
    family: str
    knobs: dict[str, Any] = Field(
        description='Each knob\'s values; "divisors" = every divisor of the devices.'
    )


class ReadinessCheck(BaseModel):
    ok: bool
    detail: str


class Readiness(BaseModel):
    status: Literal["ready", "not ready"]
    checks: dict[str, ReadinessCheck] = Field(description="database, executor: each one's verdict.")
