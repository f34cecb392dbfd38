"""/v1/plans: rank every feasible config of a recipe by predicted throughput, with no device run
(the same recipe body and checks as POST /v1/jobs; the plan is `tuner.perf.plan.make_plan`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from api.deps import ReadAuth, SettingsDep
from api.errors import ApiError
from api.routes.jobs import _RECIPE_BODY, RawBody, _check_recipe, _parse_body

router = APIRouter(prefix="/v1/plans", tags=["plans"])
QUERY = ("devices", "top", "device")  # create_plan's query parameters


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
    unknown = sorted(set(request.query_params) - set(QUERY))
    if unknown:  # a misspelt ?devcies=8 planned for the recipe's own device count
        raise ApiError(
            422,
            "unknown query parameter",
            [(f"query.{k}", f"unknown; this endpoint takes {', '.join(QUERY)}") for k in unknown],
        )
    recipe = _parse_body(body, request.headers.get("content-type", ""))
    _check_recipe(recipe, settings, runs_here=False)
    from tuner.devices import UnavailableDevice
    from tuner.perf.plan import PlanError, make_plan
    from tuner.perf.study_plan import service_plan

    url = settings.database_url
    try:
        if device is None:
            plan = await run_in_threadpool(service_plan, recipe, url, devices=devices, top=top)
        else:
            plan = await run_in_threadpool(
                make_plan, recipe, devices=devices, top=top, storage_url=url, catalogued=device
            )
    except PlanError as err:
        why = err.worded(lambda field, value: f"POST /v1/plans?{field}={value}")
        raise ApiError(422, "cannot plan this recipe", [(err.field, why)]) from None
    except UnavailableDevice as err:  # a device family no job of the service ran on
        why = err.explain("plan for a catalogued device, e.g. POST /v1/plans?device=H100")
        raise ApiError(422, "cannot plan this recipe", [("hardware.device", why)]) from None
    return plan.to_dict()
