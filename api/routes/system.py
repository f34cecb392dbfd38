"""Service endpoints: liveness, readiness (database and executor reachable), Prometheus metrics,
and the search spaces a recipe can name."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse
from sqlalchemy import func, select, text

from api.deps import ReadAuth, SessionDep, SettingsDep
from api.routes import v1_router
from api.schemas import Readiness, SearchSpacePublic
from api.settings import Settings
from tuner.db import JOB_STATES, Job
from tuner.executors.ray_address import check_cluster
from tuner.record.studies import trial_counts_and_durations

router = APIRouter(tags=["service"])  # unversioned: probes and scrapers
_v1 = v1_router(tags=["service"])

# Trial duration buckets (seconds): a tiny CPU trial takes seconds, a large GPU one minutes.
_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


@router.get("/healthz")
def read_health():
    """The process is up (no dependencies checked)."""
    return {"status": "ok"}


def _executor_reachable(settings: Settings) -> tuple[bool, str]:
    if settings.executor == "local":
        return True, "local executor"
    if not settings.ray_address or settings.ray_address == "auto":
        return True, "local Ray (started by the worker)"
    # The check the workers' executor makes: Ray's GCS (port 6379 when none is given) answering
    # there, not merely something accepting connections; a Ray Client address (ray://) is refused.
    try:
        check_cluster(settings.ray_address, "RAY_ADDRESS", timeout_s=1.0)
    except ConnectionError as err:
        return False, str(err)
    return True, f"Ray at {settings.ray_address}"


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready; `checks` says why."}},
)
def read_ready(session: SessionDep, settings: SettingsDep):
    """Ready to serve: the database answers with the current schema, and the executor is reachable."""
    from tuner.migrations import head_revision

    checks: dict[str, dict[str, object]] = {}
    try:
        session.execute(text("SELECT 1"))
        from tuner.migrations import VERSION_TABLE

        rev = session.scalar(text(f"SELECT version_num FROM {VERSION_TABLE}"))
        ok = rev == head_revision()
        checks["database"] = {
            "ok": ok,
            "detail": "schema current" if ok else f"schema at {rev}; run `tuner db upgrade`",
        }
    except Exception as err:  # noqa: BLE001 - any failure means "not ready", reported as data
        session.rollback()
        checks["database"] = {"ok": False, "detail": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    ok, detail = _executor_reachable(settings)
    checks["executor"] = {"ok": ok, "detail": detail}
    ready = all(c["ok"] for c in checks.values())
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "checks": checks}, 200 if ready else 503
    )


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={503: {"description": "The database is unavailable."}},  # it has no token to check
)
def read_metrics(session: SessionDep):
    """Prometheus text format: jobs by state, trials by status, trial durations. Open, with no
    token, on purpose: a Prometheus scrape job sends none by default, and these are counts only
    (no recipe, study name or config). To keep even those private, expose this port only to the
    scraper's network."""
    by_state = dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())
    lines = ["# HELP tuner_jobs Jobs by state.", "# TYPE tuner_jobs gauge"]
    lines += [f'tuner_jobs{{state="{s}"}} {by_state.get(s, 0)}' for s in JOB_STATES]
    counts, durations = trial_counts_and_durations(session)  # none before the first study
    lines += ["# HELP tuner_trials Trials by measured status (or Optuna state).", "# TYPE tuner_trials gauge"]
    lines += [f'tuner_trials{{status="{k}"}} {n}' for k, n in sorted(counts.items())]
    lines += [
        "# HELP tuner_trial_duration_seconds Wall time of finished trials.",
        "# TYPE tuner_trial_duration_seconds histogram",
    ]
    for b in _BUCKETS:
        lines.append(f'tuner_trial_duration_seconds_bucket{{le="{b}"}} {sum(1 for d in durations if d <= b)}')
    lines.append(f'tuner_trial_duration_seconds_bucket{{le="+Inf"}} {len(durations)}')
    lines.append(f"tuner_trial_duration_seconds_sum {sum(durations):.6f}")
    lines.append(f"tuner_trial_duration_seconds_count {len(durations)}")
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


@_v1.get("/search-spaces", response_model=list[SearchSpacePublic])
def read_search_spaces(_: ReadAuth):
    """The search spaces a recipe can name in `search.space`, with each knob's domain."""
    from tuner.space import SpaceError, available_spaces, load_space

    out = []
    for name in available_spaces():
        try:
            space = load_space(name)
        except SpaceError:
            continue  # a broken file is the operator's to fix; the others stay usable
        knobs = {k: ("divisors" if v is None else list(v)) for k, v in space.domains.items()}
        out.append(SearchSpacePublic(name=name, family=space.family, knobs=knobs))
    return out


router.include_router(_v1)  # after its routes are declared
