"""Dashboard routes: the HTML pages and their scripts under /ui (no data in them, so no token),
and the aggregate endpoints the pages read under /ui/api (a read token, like /v1)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, RedirectResponse
from sqlalchemy import select

from api.dashboard import nightly, plots, table
from api.deps import ReadAuth, SessionDep
from api.errors import ApiError
from api.responses import FiniteJSONResponse
from api.schemas import JobId, JobPublic
from api.trials import winner
from tuner.db import Build, Job
from tuner.record.reader import StudyRecord, read_study, with_all_attrs

HERE = Path(__file__).parent
STATIC = HERE / "static"
TEMPLATES = HERE / "templates"
_ASSET = re.compile(r"^[a-z][a-z0-9_-]*\.(js|css)$")
_TRIAL_REF = re.compile(r"^([0-9]{1,9}):([0-9]{1,9})$")
TrialNumber = Annotated[
    int, PathParam(ge=0, le=2_147_483_647, description="The trial's number in its study.")
]

pages = APIRouter(prefix="/ui", include_in_schema=False)
# Its errors (401, 404 under a job id, 422, ...) are declared by api/errors.py's `document_errors`.
data = APIRouter(prefix="/ui/api", tags=["dashboard"])


def _page(name: str) -> FileResponse:
    return FileResponse(TEMPLATES / name, media_type="text/html", headers={"Cache-Control": "no-cache"})


@pages.get("")
def read_root():
    return RedirectResponse("/ui/jobs")


@pages.get("/jobs")
def read_jobs_page():
    return _page("jobs.html")


@pages.get("/jobs/{job_id}")
def read_job_page(job_id: JobId):
    return _page("job.html")


@pages.get("/compare")
def read_compare_page():
    return _page("compare.html")


@pages.get("/recipes/{recipe_name}")
def read_recipe_page(recipe_name: str):
    return _page("recipe.html")


@pages.get("/static/plotly.min.js")
def read_plotly():
    # Plotly's bundle ships inside the Python package: the dashboard works with no internet.
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return FileResponse(path, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})


@pages.get("/static/{name}")
def read_asset(name: str):
    path = STATIC / name
    if not _ASSET.match(name) or not path.is_file():
        raise ApiError(404, f"no dashboard asset {name!r}", [("name", "not found")])
    media = "text/javascript" if name.endswith(".js") else "text/css"
    return FileResponse(path, media_type=media, headers={"Cache-Control": "no-cache"})


def _job(session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise ApiError(404, f"job {job_id} not found", [("id", "no such job; the jobs page lists them")])
    return job


def _study(session, job: Job) -> StudyRecord | None:
    return read_study(session, job.study_name) if job.study_name else None


@data.get("/jobs/{job_id}/overview")
def read_overview(job_id: JobId, session: SessionDep, _: ReadAuth):
    """The job, its best trial with speedup and step-time breakdown, the build, recent failures."""
    job = _job(session, job_id)
    verdict, study = winner(session, job, with_study=True)
    build = session.scalar(select(Build).where(Build.job_id == job_id).order_by(Build.id.desc()).limit(1))
    best = study.find(verdict.best.trial) if study is not None and verdict.best is not None else None
    # The worker's figure when the winner's study holds no baseline trial (it recorded one).
    speedup = verdict.speedup if verdict.speedup is not None else job.speedup
    failed, latest = table.failures(study) if study else (0, [])
    # With their logs: the best card and the failure list show trials whole.
    whole = with_all_attrs(session, ([best] if best else []) + latest)
    if best:
        best, latest = whole[0], whole[1:]
    return FiniteJSONResponse(
        {
            "job": JobPublic.from_row(job).model_dump(mode="json"),
            "best": _best_card(best, verdict) if best else None,
            "speedup": speedup,
            "build": {
                "ready": build is not None and Path(build.path).is_file(),
                "sha256": build.sha256 if build else None,
                "size_bytes": build.size_bytes if build else None,
                "trial_number": build.trial_number if build else None,
            },
            "failures": {"total": failed, "items": [r.detail() for r in latest]},
        }
    )


def _best_card(best, verdict) -> dict:
    """The winner's trial whole, with the figure every view shows: its median tokens/s over every
    measurement (`tokens_per_s`), next to its first measurement and the noise."""
    card = best.detail()
    card.update(
        measured_tokens_per_s=card["tokens_per_s"],
        tokens_per_s=verdict.best.tokens_per_s,
        remeasured_tokens_per_s=verdict.best.remeasured_tokens_per_s,
        noise=verdict.best.noise,
        winner_source=verdict.source,
    )
    return card


@data.get("/jobs/{job_id}/trials")
def read_trials_table(
    job_id: JobId,
    session: SessionDep,
    _: ReadAuth,
    page: Annotated[int, Query(ge=1, le=1_000_000)] = 1,
    size: Annotated[int, Query(ge=1, le=table.MAX_PAGE_SIZE)] = 50,
    sort: Annotated[
        str, Query(max_length=100, description="A column or knob; '-' prefix: descending")
    ] = "number",
    status: Annotated[list[str], Query(description="ok, oom, error, timeout, pruned, running, ...")] = (),
    knob: Annotated[list[str], Query(description="name:value, e.g. recompute:full")] = (),
):
    """One page of the trials table, sorted and filtered on the server."""
    job = _job(session, job_id)
    # A queued job has no study yet: an empty one shows the same (empty) table.
    study = _study(session, job) or StudyRecord(study_name="", version=(), trials=[])
    filters = table.parse_knob_filters(list(knob), study)
    return FiniteJSONResponse(
        table.page(study, page=page, size=size, sort=sort, statuses=list(status), knobs=filters)
    )


@data.get("/jobs/{job_id}/plots")
def read_plots(job_id: JobId, session: SessionDep, _: ReadAuth):
    """Plot series from at most 500 trials (best-so-far steps and failures always kept)."""
    job = _job(session, job_id)
    study = _study(session, job)
    if study is None:
        return {"total": 0, "sampled": 0}
    return FiniteJSONResponse(plots.plot_data(study))


@data.get(
    "/jobs/{job_id}/trials/{number}",
    responses={404: {"description": "No job has this id, or its study has no such trial."}},
)
def read_trial(job_id: JobId, number: TrialNumber, session: SessionDep, _: ReadAuth):
    job = _job(session, job_id)
    study = _study(session, job)
    if study is None:
        raise ApiError(404, f"job {job_id} has no trials yet ({job.state})", [("number", "no trials")])
    (trial,) = with_all_attrs(session, [table.find(study, number)])
    return FiniteJSONResponse({"job_id": job.id, "recipe_name": job.recipe_name, "trial": trial.detail()})


def _ref(session, field: str, ref: str):
    m = _TRIAL_REF.match(ref)
    if not m:
        raise ApiError(
            422, f"{field}={ref!r} is not JOB:TRIAL", [(field, "use job id and trial number, e.g. 3:17")]
        )
    job = _job(session, int(m.group(1)))
    study = _study(session, job)
    if study is None:
        raise ApiError(404, f"job {job.id} has no trials yet", [(field, "no trials")])
    # What ran it: the study's fingerprint (device model, torch, driver), else the recipe's request.
    hardware = study.fingerprint or dict((job.recipe or {}).get("hardware", {}))
    (trial,) = with_all_attrs(session, [table.find(study, int(m.group(2)))])
    return job, trial, hardware


@data.get("/compare", responses={404: {"description": "A job named in `a` or `b` is missing, or its trial."}})
def read_comparison(
    session: SessionDep,
    _: ReadAuth,
    a: Annotated[str, Query(description="JOB:TRIAL, e.g. 3:17")],
    b: Annotated[str, Query(description="JOB:TRIAL, e.g. 5:2")],
):
    """Two trials side by side, also from different jobs (the same recipe on two device types)."""
    job_a, trial_a, hw_a = _ref(session, "a", a)
    job_b, trial_b, hw_b = _ref(session, "b", b)
    return {
        "a": {
            "job_id": job_a.id,
            "recipe_name": job_a.recipe_name,
            "hardware": hw_a,
            "trial": trial_a.detail(),
        },
        "b": {
            "job_id": job_b.id,
            "recipe_name": job_b.recipe_name,
            "hardware": hw_b,
            "trial": trial_b.detail(),
        },
        **table.compare(trial_a, trial_b),
    }


@data.get("/recipes/{recipe_name}/history")
def read_recipe_history(recipe_name: str, session: SessionDep, _: ReadAuth):
    """Best tokens/s per nightly run, with regressions and the fingerprint changes next to them."""
    return nightly.recipe_history(session, recipe_name)


router = APIRouter()
router.include_router(pages)
router.include_router(data)
