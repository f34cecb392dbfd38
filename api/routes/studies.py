"""/v1/studies: every study in the database (a REST job's, a `tuner tune` run's, a nightly's), its
winner as every view shows it, and its build when one was made."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path as PathParam
from fastapi.responses import FileResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.builds import build_response
from api.deps import ReadAuth, SessionDep
from api.errors import ApiError
from api.routes import v1_router
from api.schemas import StudyPage, StudyPublic
from api.trials import winner
from tuner.db import Build, Job
from tuner.record.reader import StudyRecord, read_study
from tuner.record.studies import JOB, StudyListing, list_studies
from tuner.record.winner import Verdict, job_verdict

router = v1_router("/studies", tags=["studies"])

# Study names hold only build-safe characters (tuner.study.naming).
StudyName = Annotated[
    str, PathParam(pattern=r"^[A-Za-z0-9._-]{1,512}$", description="The study's name, from GET /v1/studies.")
]
_404 = {404: {"description": "No study has this name."}}


def latest_build(session: Session, study_name: str) -> Build | None:
    """The study's newest build (a job's or one `tuner build` registered)."""
    stmt = select(Build).where(Build.study_name == study_name).order_by(Build.id.desc()).limit(1)
    return session.scalar(stmt)


def get_study(session: Session, name: str) -> StudyRecord:
    study = read_study(session, name)
    if study is None:
        raise ApiError(
            404, f"study {name!r} not found", [("name", "no such study; GET /v1/studies lists them")]
        )
    return study


def study_verdict(session: Session, study: StudyRecord) -> Verdict:
    """The winner of a study that is not a job's: the trial its build was made of while that is
    still the ranking's best or tied with it, else the ranking (`tuner.record.winner.job_verdict`,
    the rule every view of a job uses too). A study tuned further after its build has moved on:
    naming the old build's trial would contradict `tuner show`."""
    build = latest_build(session, study.study_name)
    built = build.trial_number if build else None
    if built is not None:
        ranking = study.ranking()
        entry = next((e for e in ranking.ranked if e.trial == built), None)
        if entry is None or not (entry is ranking.best or ranking.tied_with_best(entry)):
            built = None
    return job_verdict("running", None, study, built)


def _best(session: Session, listing: StudyListing) -> float | None:
    """The winner's median as the study's linked page shows it: a job's study links its newest
    job, whose winner is `job_verdict`'s (`api.trials.winner`: its recorded winner, else the live
    ranking). Read from that job's row, it was null while the newest job had measured nothing
    yet: one queued behind another driver of the study (`Worker.hold_back`), cancelled, or
    started, though the study and the job's own page named a winner."""
    if listing.source == JOB:
        job = session.get(Job, listing.job_ids[0])
        verdict = winner(session, job)[0] if job is not None else None
    else:
        study = read_study(session, listing.name)
        verdict = study_verdict(session, study) if study is not None else None
    return verdict.best.tokens_per_s if verdict and verdict.best else None


@router.get("", response_model=StudyPage)
def read_studies(session: SessionDep, _: ReadAuth):
    """Every study, most recently changed first; a REST job's names its jobs (`job_ids`)."""
    return StudyPage(items=[StudyPublic.from_listing(s, _best(session, s)) for s in list_studies(session)])


@router.get(
    "/{study_name}/build",
    response_class=FileResponse,
    responses={
        200: {"content": {"application/gzip": {}}, "description": "The build tarball."},
        404: {"description": "No study has this name, or no build was made of it."},
        409: {"description": "The build's file no longer matches its checksum."},
    },
)
def read_study_build(study_name: StudyName, session: SessionDep, _: ReadAuth):
    """Download the study's newest build (`tuner build`, or its job's); `X-Checksum-Sha256`."""
    get_study(session, study_name)
    build = latest_build(session, study_name)
    missing = f"study {study_name!r} has no build; make one with `tuner build RECIPE`"
    if build is None:
        raise ApiError(404, missing, [("study_name", "no build")])
    return build_response(build, ("study_name", "no build"), missing)
