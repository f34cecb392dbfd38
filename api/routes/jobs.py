"""/v1/jobs: submit a recipe, list and read jobs, their trials, best config and build; cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request, Response
from fastapi.responses import FileResponse
from sqlalchemy import select, update

from api import trials as trial_store
from api.builds import build_response
from api.deps import ReadAuth, SessionDep, SettingsDep, WriteAuth
from api.errors import ApiError
from api.responses import FiniteJSONResponse
from api.routes import v1_router
from api.schemas import JOB_ID_MAX, BestPublic, JobId, JobLog, JobPage, JobPublic, JobState, TrialPage
from api.settings import Settings
from tuner.db import CANCELLED, FINAL_STATES, QUEUED, Build, Job, add_event, utcnow
from tuner.recipe import Recipe, RecipeError, load_document, load_json, parse_recipe, recipe_from_dict
from tuner.space import recipe_space_problems

# The errors that follow from what a route is (401, 404 under a job id, 422, ...) are declared
# by api/errors.py's `document_errors`; a route declares only its own (409, 415).
router = v1_router("/jobs", tags=["jobs"])

_YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
_RECIPE_BODY = {
    "requestBody": {
        "required": True,
        "description": "The recipe (DESIGN.md), as JSON or YAML. Unknown fields are refused.",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Recipe"}},
            "application/yaml": {"schema": {"$ref": "#/components/schemas/Recipe"}},
        },
    }
}


async def _raw_body(request: Request) -> bytes:
    # Read here so the handler can stay synchronous (database calls off the event loop).
    return await request.body()


RawBody = Annotated[bytes, Depends(_raw_body)]


def recipe_schemas(settings: Settings) -> dict[str, dict]:
    """The recipe's JSON Schema for the OpenAPI document, with this service's limits in it."""
    schema = Recipe.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    search = defs["SearchSpec"]["properties"]
    search["trials"]["maximum"] = settings.max_trials
    search["timeout_min"]["maximum"] = settings.max_timeout_min
    return {**defs, "Recipe": schema}


def _get_job(session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise ApiError(404, f"job {job_id} not found", [("id", "no such job; GET /v1/jobs lists jobs")])
    return job


def _parse_body(raw: bytes, content_type: str) -> Recipe:
    kind = content_type.split(";")[0].strip().lower()
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as a recipe file may have (the CLI reads it so)
    except UnicodeDecodeError:
        raise ApiError(422, "recipe is not UTF-8 text", [("body", "send UTF-8 JSON or YAML")]) from None
    try:
        if kind in _YAML_TYPES:
            return parse_recipe(text)
        if kind in ("application/json", ""):
            return recipe_from_dict(load_json(text))
    except RecipeError as err:
        problems = err.problems
        if kind != "application/json" or not _reads_as_yaml(text):
            raise ApiError(422, "invalid recipe", problems) from None
        hint = "; the body reads as YAML: send it with Content-Type: application/yaml"
        raise ApiError(
            422, "invalid recipe", [(f, m + hint if f == "body" else m) for f, m in problems]
        ) from None
    raise ApiError(
        415,
        f"unsupported Content-Type {kind!r}",
        [("Content-Type", "use application/json or application/yaml")],
    )


def _reads_as_yaml(text: str) -> bool:
    """Whether a body that is not JSON is a YAML mapping (a recipe sent with the wrong type)."""
    try:
        return isinstance(load_document(text), dict)
    except RecipeError:
        return False


def _check_recipe(recipe: Recipe, settings: Settings, *, runs_here: bool = True) -> None:
    """What this host can check before a worker takes the recipe (`runs_here`: a job this
    service's workers will run, not a plan, which may be for machines the service has not)."""
    problems = []
    if recipe.search.trials > settings.max_trials:
        problems.append(
            (
                "search.trials",
                f"at most {settings.max_trials} trials per job on this service (TUNER_MAX_TRIALS)",
            )
        )
    if recipe.search.timeout_min > settings.max_timeout_min:
        problems.append(
            (
                "search.timeout_min",
                f"at most {settings.max_timeout_min} minutes per job on this service (TUNER_MAX_TIMEOUT_MIN)",
            )
        )
    if runs_here and recipe.hardware.nodes > 1 and settings.executor == "local":
        problems.append(
            (
                "hardware.nodes",
                f"{recipe.hardware.nodes} machines per trial need a service whose workers run trials on a "
                "Ray cluster (TUNER_EXECUTOR=ray); this one runs them on its workers' own machines: set "
                "hardware.nodes to 1",
            )
        )
    problems += recipe_space_problems(
        recipe, client_hint="; GET /v1/search-spaces lists every space's values"
    )
    if problems:
        raise ApiError(422, "recipe exceeds this service's limits or names an unknown space", problems)


@router.post(
    "",
    status_code=202,
    response_model=JobPublic,
    openapi_extra=_RECIPE_BODY,
    responses={415: {"description": "The body is neither JSON nor YAML."}},
)
def create_job(
    request: Request,
    body: RawBody,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    _: WriteAuth,
):
    """Queue a tuning job for a recipe. Returns 202 with the job and links to follow it."""
    recipe = _parse_body(body, request.headers.get("content-type", ""))
    _check_recipe(recipe, settings)
    job = Job(
        recipe_name=recipe.name,
        recipe=recipe.to_dict(),
        recipe_hash=recipe.hash(),
        state=QUEUED,
        trials_total=recipe.search.trials,
    )
    session.add(job)
    session.flush()
    add_event(session, job.id, "queued", {"state": QUEUED})
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobPublic.from_row(job)


@router.get("", response_model=JobPage)
def read_jobs(
    session: SessionDep,
    _: ReadAuth,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[
        str | None, Query(pattern=r"^[0-9]{1,12}$", description="next_cursor of a page")
    ] = None,
):
    """Jobs, newest first, `limit` at a time: `next_cursor` (null on the last page) as ?cursor=
    gives the next page. A cursor is the last job id shown, so jobs submitted while a client
    pages do not shift its later pages."""
    query = select(Job).order_by(Job.id.desc()).limit(limit + 1)
    if state:
        query = query.where(Job.state == state)
    if cursor:
        query = query.where(Job.id <= min(int(cursor) - 1, JOB_ID_MAX))  # ids are 32-bit integers
    rows = list(session.scalars(query))
    more = len(rows) > limit
    rows = rows[:limit]
    return JobPage(
        items=[JobPublic.from_row(j) for j in rows], next_cursor=str(rows[-1].id) if more else None
    )


@router.get("/{job_id}", response_model=JobPublic)
def read_job(job_id: JobId, session: SessionDep, _: ReadAuth):
    return JobPublic.from_row(_get_job(session, job_id))


@router.post(
    "/{job_id}/cancel",
    status_code=202,
    response_model=JobPublic,
    responses={409: {"description": "The job already finished."}},
)
def cancel_job(job_id: JobId, session: SessionDep, _: WriteAuth):
    """Cancel a job: a queued job stops at once; a running one stops its trials within seconds."""
    job = _get_job(session, job_id)
    if job.state == QUEUED:
        # Compare-and-set, as a worker claims: one may take the job between the read above and
        # this write. Written over, the job read `cancelled` while its worker started its study
        # and wrote its trials' events after the job's `done`; claimed, it is cancelled as running.
        now = utcnow()
        values = {"state": CANCELLED, "cancel_requested": True, "finished_at": now, "updated_at": now}
        cas = update(Job).where(Job.id == job_id, Job.state == QUEUED).values(**values)
        hit = session.execute(cas, execution_options={"synchronize_session": False}).rowcount == 1
        session.refresh(job)
        if hit:
            add_event(session, job_id, "done", {"state": CANCELLED})
            return JobPublic.from_row(job)
    if job.state in FINAL_STATES:
        raise ApiError(
            409, f"job {job_id} already {job.state}; nothing to cancel", [("id", f"job is {job.state}")]
        )
    job.cancel_requested = True
    job.updated_at = utcnow()
    add_event(session, job.id, "cancel_requested", {})
    return JobPublic.from_row(job)


@router.get(
    "/{job_id}/log",
    response_model=JobLog,
    responses={404: {"description": "No job has this id, or it has no log (it did not fail)."}},
)
def read_job_log(job_id: JobId, session: SessionDep, _: ReadAuth):
    """The whole log behind a job's one-line error: the traceback or build output the worker saw."""
    job = _get_job(session, job_id)
    if not job.log:
        why = f"job {job_id} has no log: it is {job.state}" + ("" if job.error else " with no error")
        raise ApiError(404, why, [("id", "no log")])
    return JobLog(job_id=job.id, state=job.state, error=JobPublic.from_row(job).error, log=job.log)


@router.get("/{job_id}/trials", response_model=TrialPage)
def read_trials(
    job_id: JobId,
    session: SessionDep,
    _: ReadAuth,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[
        str | None, Query(max_length=40, description="next_cursor of a page of the same sort")
    ] = None,
    status: Annotated[
        str | None,
        Query(
            pattern=f"^({'|'.join(trial_store.STATUS_FILTERS)})$",
            description="A status word (ok, oom, error, timeout, pruned, duplicate, failed, running, "
            "waiting) or an Optuna state (complete, fail).",
        ),
    ] = None,
    sort: Annotated[str, Query(pattern=f"^({'|'.join(trial_store.SORTS)})$")] = "number",
):
    """A study's trials, paginated on the server. A cursor is a place in the sort's order, not an
    offset: trials added while a client pages do not shift its later pages."""
    try:
        start = trial_store.cursor_key(cursor, sort) if cursor else None
    except trial_store.CursorError as err:
        raise ApiError(422, "invalid cursor", [("cursor", str(err))]) from None
    job = _get_job(session, job_id)
    if not job.study_name:
        return TrialPage(items=[], total=0, next_cursor=None)
    items, total, next_cursor = trial_store.read_trials(
        session, job.study_name, limit=limit, start=start, status=status, sort=sort
    )
    # Items are TrialPublic's JSON already (cached per study version): sent as they are.
    return FiniteJSONResponse({"items": items, "total": total, "next_cursor": next_cursor})


@router.get(
    "/{job_id}/best",
    response_model=BestPublic,
    responses={404: {"description": "No job has this id, or it has no completed trial yet."}},
)
def read_best(job_id: JobId, session: SessionDep, _: ReadAuth):
    """The winner so far: the fastest completed config by its median over re-measurements, loss
    checked against fp32, within the memory budget (the same winner every view shows)."""
    job = _get_job(session, job_id)
    verdict, _study = trial_store.winner(session, job)
    best = verdict.best
    if best is None:
        raise ApiError(
            404, f"job {job_id} has no completed trial yet (state: {job.state})", [("id", "no best yet")]
        )
    from tuner.record.studies import study_fingerprint

    fp, fp_hash = study_fingerprint(session, job.study_name or "")
    return BestPublic(
        job_id=job.id,
        study_name=job.study_name,
        trial=best.trial,
        config=best.config,
        tokens_per_s=best.tokens_per_s,
        metrics=best.metrics,
        noise=best.noise,
        interval=best.ci,
        baseline_tokens_per_s=verdict.baseline_tokens_per_s,
        speedup=verdict.speedup,
        tie=verdict.tie,
        counts=verdict.counts,
        fingerprint=fp,
        fingerprint_hash=fp_hash,
    )


@router.get(
    "/{job_id}/build",
    response_class=FileResponse,
    responses={
        200: {"content": {"application/gzip": {}}, "description": "The build tarball."},
        404: {"description": "No job has this id, or it finished without a build."},
        409: {
            "description": "The job has not finished (it is built when it succeeds), or the build's file "
            "no longer matches its checksum."
        },
    },
)
def read_build(job_id: JobId, session: SessionDep, _: ReadAuth):
    """Download the build of the best config (tar.gz); `X-Checksum-Sha256` carries its sha256."""
    job = _get_job(session, job_id)
    build = session.scalar(select(Build).where(Build.job_id == job_id).order_by(Build.id.desc()).limit(1))
    if build is None:
        if job.state not in FINAL_STATES:
            raise ApiError(
                409,
                f"build not ready: job {job_id} is {job.state}; it is built when the job succeeds",
                [("id", job.state)],
            )
        reason = job.error or "no trial completed, or the build failed"
        raise ApiError(404, f"job {job_id} has no build ({job.state}: {reason})", [("id", "no build")])
    missing = f"build file of job {job_id} is missing from the artifact store"
    return build_response(build, ("id", "missing"), missing)
