"""`preflight`: what a recipe's study would otherwise find out mid-study, checked before any device
time is spent. `tuner tune`, the nightly's local run and the service's worker call it (the REST API
checks what it can on its own host, `api.routes.jobs._check_recipe`: its workers may be other
machines, so the devices are the worker's to check)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuner.recipe import Recipe

if TYPE_CHECKING:
    from tuner.executors.base import Executor
    from tuner.fingerprint import Described


class PreflightError(ValueError):
    """A recipe this machine cannot tune as asked; the message names the field and the fix."""


def preflight(recipe: Recipe, sampler: str, executor: Executor) -> Described:
    """Where the study's trials run, as `executor.describe` sees them (this machine, or a Ray
    cluster's nodes), once a study of `recipe` can start there with `sampler`; else
    `PreflightError`, the first problem found. Checked: the executor can run the recipe's nodes,
    the device is there, the search space and its overrides load, the sampler can be made, that
    machine (each node like it) holds the devices, some dp*tp*pp split fills them and the model's
    shapes admit one."""
    from tuner.config import device_count_reason
    from tuner.executors.local import multi_node_refusal
    from tuner.space import SpaceError, load_space
    from tuner.study.samplers import SamplerContext, make_sampler

    if executor.name == "local" and (refusal := multi_node_refusal(recipe.hardware.nodes)) is not None:
        raise PreflightError(refusal)
    try:
        described = executor.describe(recipe.hardware.device)
        device = described.device
        space = load_space(recipe.search.space or described.family).narrow(recipe.search.overrides)
        context = SamplerContext(recipe, space, device)
        make_sampler(sampler, 0, recipe.search.objective == "throughput_memory", context)
    except (SpaceError, ValueError) as err:
        raise PreflightError(str(err)) from None
    too_many = device_count_reason(recipe, device)
    if too_many is not None:
        more = (
            ""
            if recipe.hardware.nodes > 1
            else " (or spread them over machines: hardware.nodes, with the Ray executor)"
        )
        raise PreflightError(f"{too_many}; lower hardware.devices{more}")
    problem = space.shape_problem(recipe)  # no split of the devices, or none that fits
    if problem is not None:
        field, message = problem.pair()
        raise PreflightError(f"{field}: {message}")
    return described
