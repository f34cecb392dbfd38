"""Request and response shapes of the REST API, kept apart from the database tables."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import BaseModel, Field

from tuner.db import Job, JobState

# Job ids are database integers (PostgreSQL INTEGER); a larger number is a 422, not a driver error.
JobId = Annotated[int, Path(ge=1, le=2_147_483_647, description="The job's id.")]


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
    state: JobState
    recipe_hash: str
    study_name: str | None
    trials_done: int
    trials_total: int
    best_tokens_per_s: float | None
    baseline_tokens_per_s: float | None = Field(description="Throughput of the default config.")
    speedup: float | None = Field(description="best_tokens_per_s / baseline_tokens_per_s.")
    error: str | None
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
            state=job.state,
            recipe_hash=job.recipe_hash,
            study_name=job.study_name,
            trials_done=job.trials_done,
            trials_total=job.trials_total,
            best_tokens_per_s=job.best_tokens_per_s,
            baseline_tokens_per_s=job.baseline_tokens_per_s,
            speedup=job.speedup,
            error=job.error,
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
            },
        )


class JobPage(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null at the end.")


class TrialPublic(BaseModel):
    number: int
    state: str = Field(description="Optuna state: running, complete, pruned, fail, waiting.")
    status: str | None = Field(
        description="The trial's status word: ok, oom, error, timeout (measured), pruned, duplicate, "
        "failed (stopped without a measurement), running, waiting."
    )
    tokens_per_s: float | None
    config: dict[str, Any]
    result: dict[str, Any]
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    duration_s: float | None


class TrialPage(BaseModel):
    items: list[TrialPublic]
    total: int = Field(description="Trials matching the filter.")
    next_cursor: str | None


class BestPublic(BaseModel):
    job_id: int
    study_name: str
    trial: int = Field(description="Trial number of the winner.")
    config: dict[str, Any] = Field(description="The winning knob setting (knobs that apply).")
    tokens_per_s: float = Field(description="Median over the trial and its re-measurements.")
    metrics: dict[str, Any] = Field(description="The winner's measured result keys.")
    noise: float | None = None
    baseline_tokens_per_s: float | None
    speedup: float | None = Field(description="Best over the default config's throughput.")
    tie: bool = Field(False, description="The runner-up is within measurement noise.")
    counts: dict[str, int] = Field(default_factory=dict, description="Trials by status.")


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
