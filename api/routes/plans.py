"""/v1/plans: rank every feasible config of a recipe by predicted throughput, with no device run
(the same recipe body and checks as POST /v1/jobs; the plan is `tuner.perf.plan.make_plan`)."""

from __future__ import annotations

import threading

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from api.deps import ReadAuth, SettingsDep
from api.errors import ApiError
from api.routes import v1_router
from api.routes.jobs import _RECIPE_BODY, RawBody, _check_recipe, _parse_body

router = v1_router("/plans", tags=["plans"])
# Plans made at once. A plan is CPU work of a second to minutes (thousands of devices, a space of
# millions); a reader sending many at once starved the service's own requests on a small host.
# One runs at a time; others are told to come back (429) rather than queued behind it.
_PLANNING = threading.BoundedSemaphore(1)


@router.post(
    "", openapi_extra=_RECIPE_BODY, responses={415: {"description": "The body is neither JSON nor YAML."}}
)
async def create_plan(
    request: Request,
    body: RawBody,
    settings: SettingsDep,
    _: ReadAuth,
    devices: int | None = None,
    top: int = 10,
    device: str | None = None,
):
    """Predicted tokens/s, step time, memory and a 90% interval for the best `top` configs of the
    recipe on `devices` (default: the recipe's), for the devices the service's newest job of the
    recipe's device family ran on (its workers' machines or Ray nodes; this server's own before
    any job ran), from the device priors and every trial measured there. `extrapolated` says
    when it goes beyond them. `device` (V100, A100, H100, H200, 910B): plan for that catalogued
    device instead, from its datasheet priors alone."""
    recipe = _parse_body(body, request.headers.get("content-type", ""))
    _check_recipe(recipe, settings, runs_here=False)
    from tuner.devices import UnavailableDevice
    from tuner.perf.plan import PlanError, make_plan
    from tuner.perf.study_plan import service_plan

    url = settings.database_url
    if not _PLANNING.acquire(blocking=False):
        raise ApiError(
            429, "another plan is being made; try again in a few seconds", headers={"Retry-After": "5"}
        )

    def planned():
        try:  # released by the thread itself: a client that left does not free the slot early
            if device is None:
                return service_plan(recipe, url, devices=devices, top=top)
            return make_plan(recipe, devices=devices, top=top, storage_url=url, catalogued=device)
        finally:
            _PLANNING.release()

    try:
        plan = await run_in_threadpool(planned)
    except PlanError as err:
        why = err.worded(lambda field, value: f"POST /v1/plans?{field}={value}")
        raise ApiError(422, "cannot plan this recipe", [(err.field, why)]) from None
    except UnavailableDevice as err:  # a device family no job of the service ran on
        why = err.explain("plan for a catalogued device, e.g. POST /v1/plans?device=H100")
        raise ApiError(422, "cannot plan this recipe", [("hardware.device", why)]) from None
    return plan.to_dict()
