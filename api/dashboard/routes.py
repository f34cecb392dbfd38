"""Dashboard routes: the HTML pages and their scripts under /ui (no data in them, so no token),
and the aggregate endpoints the pages read under /ui/api (a read token, like /v1)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, RedirectResponse

from api.dashboard import nightly, table, views
from api.deps import ReadAuth, SessionDep
from api.errors import ApiError
from api.responses import FiniteJSONResponse
from api.routes.studies import StudyName, get_study
from api.schemas import JobId
from api.trials import STATUS_FILTERS
from tuner.db import Job
from tuner.recipe import printable_line
from tuner.record.reader import StudyRecord, read_study, with_all_attrs

HERE = Path(__file__).parent
STATIC = HERE / "static"
TEMPLATES = HERE / "templates"
# npm's plotly.js-basic-dist-min 4.1.1 (the same plotly.js as the `plotly` package ships), pinned
# by its sha256 in tests/test_dashboard.py; its MIT licence beside it.
PLOTLY = STATIC / "vendor" / "plotly-basic-4.1.1.min.js"
PLOTLY_LICENSE = STATIC / "vendor" / "plotly-basic-4.1.1.LICENSE"
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


@pages.get("/studies/{study_name}")
def read_study_page(study_name: StudyName):
    return _page("job.html")


@pages.get("/compare")
def read_compare_page():
    return _page("compare.html")


@pages.get("/recipes/{recipe_name:path}")
def read_recipe_page(recipe_name: str):
    return _page("recipe.html")


@pages.get("/static/plotly.min.js")
def read_plotly():
    # Plotly's partial bundle with only the trace types the dashboard draws (scatter, bar),
    # vendored: the dashboard works with no internet, and a first visit runs 1.2 MB, not 4.8 MB.
    return FileResponse(PLOTLY, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})


@pages.get("/static/plotly.LICENSE")
def read_plotly_licence():
    return FileResponse(PLOTLY_LICENSE, media_type="text/plain", headers={"Cache-Control": "max-age=86400"})


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


def _table_query(
    page: Annotated[int, Query(ge=1, le=1_000_000)] = 1,
    size: Annotated[int, Query(ge=1, le=table.MAX_PAGE_SIZE)] = 50,
    sort: Annotated[
        str, Query(max_length=100, description="A column or knob; '-' prefix: descending")
    ] = "number",
    status: Annotated[list[str], Query(description="ok, oom, error, timeout, pruned, running, ...")] = (),
    knob: Annotated[list[str], Query(description="name:value, e.g. recompute:full")] = (),
) -> dict:
    unknown = [s for s in status if s not in STATUS_FILTERS]
    if unknown:  # as /v1's trials: a filter that matches nothing by its spelling is an error
        raise ApiError(
            422,
            f"status={unknown[0]!r} is no status word",
            [("status", f"one of {', '.join(STATUS_FILTERS)}")],
        )
    return {"page": page, "size": size, "sort": sort, "statuses": list(status), "knob": list(knob)}


TableQuery = Annotated[dict, Depends(_table_query)]


@data.get("/jobs/{job_id}/overview")
def read_overview(job_id: JobId, session: SessionDep, _: ReadAuth):
    """The job, its best trial with speedup and step-time breakdown, the build, recent failures."""
    return views.overview(session, _job(session, job_id), None)


@data.get("/jobs/{job_id}/trials")
def read_trials_table(job_id: JobId, session: SessionDep, _: ReadAuth, query: TableQuery):
    """One page of the trials table, sorted and filtered on the server."""
    return views.trials_page(_study(session, _job(session, job_id)), **query)


@data.get("/jobs/{job_id}/plots")
def read_plots(job_id: JobId, session: SessionDep, _: ReadAuth):
    """Plot series from at most 500 trials (best-so-far steps and failures always kept)."""
    return views.plot_data(_study(session, _job(session, job_id)))


@data.get("/jobs/{job_id}/plan")
def read_plan(job_id: JobId, session: SessionDep, _: ReadAuth):
    """The plan's top configs, fitted to this job's own trials (no device run), each with what
    the study measured for it; the page asks for it after its first draw."""
    job = _job(session, job_id)
    return views.plan(_study(session, job), job)


@data.get(
    "/jobs/{job_id}/trials/{number}",
    responses={404: {"description": "No job has this id, or its study has no such trial."}},
)
def read_trial(job_id: JobId, number: TrialNumber, session: SessionDep, _: ReadAuth):
    job = _job(session, job_id)
    study = _study(session, job)
    if study is None:
        raise ApiError(404, f"job {job_id} has no trials yet ({job.state})", [("number", "no trials")])
    return FiniteJSONResponse(
        {"job_id": job.id, "recipe_name": job.recipe_name, "trial": views.trial(session, study, number)}
    )


# ---- a study with no job (a `tuner tune` run, a nightly): the same page, read by study name ----
_NO_STUDY = {404: {"description": "No study has this name."}}


@data.get("/studies/{study_name}/overview", responses=_NO_STUDY)
def read_study_overview(study_name: StudyName, session: SessionDep, _: ReadAuth):
    return views.overview(session, None, get_study(session, study_name))


@data.get("/studies/{study_name}/trials", responses=_NO_STUDY)
def read_study_trials(study_name: StudyName, session: SessionDep, _: ReadAuth, query: TableQuery):
    return views.trials_page(get_study(session, study_name), **query)


@data.get("/studies/{study_name}/plots", responses=_NO_STUDY)
def read_study_plots(study_name: StudyName, session: SessionDep, _: ReadAuth):
    return views.plot_data(get_study(session, study_name))


@data.get("/studies/{study_name}/plan", responses=_NO_STUDY)
def read_study_plan(study_name: StudyName, session: SessionDep, _: ReadAuth):
    return views.plan(get_study(session, study_name))


@data.get("/studies/{study_name}/trials/{number}", responses=_NO_STUDY)
def read_study_trial(study_name: StudyName, number: TrialNumber, session: SessionDep, _: ReadAuth):
    study = get_study(session, study_name)
    return FiniteJSONResponse(
        {
            "study_name": study_name,
            "recipe_name": study.recipe.get("name"),
            "trial": views.trial(session, study, number),
        }
    )


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


@data.get("/recipes/{recipe_name:path}/history")
def read_recipe_history(recipe_name: str, session: SessionDep, _: ReadAuth):
    """Best tokens/s per nightly run, with regressions and the fingerprint changes next to them."""
    if not printable_line(recipe_name):  # no recipe is named so (`Recipe.name`)
        raise ApiError(
            422, "no recipe name holds control characters", [("recipe_name", "printable text only")]
        )
    return nightly.recipe_history(session, recipe_name)


router = APIRouter()
router.include_router(pages)
router.include_router(data)
