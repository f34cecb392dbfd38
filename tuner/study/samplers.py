"""The Optuna samplers a study can use (`search.sampler`), seeded."""

from __future__ import annotations

import warnings

import optuna

from tuner.perf.sampler import ModelSampler, SamplerContext
from tuner.recipe import SAMPLERS


def make_sampler(
    name: str, seed: int, multi_objective: bool, context: SamplerContext | None = None
) -> optuna.samplers.BaseSampler:
    """A seeded sampler. `grid` is random sampling underneath; the driver enqueues the grid.

    `model` (tuner.perf.sampler.ModelSampler) ranks the configs of one recipe on one device, so
    it needs the study's `context`; without one (checking a name) a ValueError says so.
    """
    if name == "cmaes" and multi_objective:
        raise ValueError(
            "search.sampler: cmaes has one objective; use tpe, gp or random for throughput_memory"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            # group + multivariate model the conditional knobs jointly; constant_liar keeps
            # concurrent asks from all landing on the same config.
            return optuna.samplers.TPESampler(
                seed=seed, multivariate=True, group=True, constant_liar=True, n_startup_trials=5
            )
        if name == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=5, warn_independent_sampling=False)
        if name == "cmaes":
            # CMA-ES handles numeric knobs only; the categorical ones are sampled at random.
            return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
        if name in ("random", "grid"):
            return optuna.samplers.RandomSampler(seed=seed)
        if name == "model":
            if context is None:
                raise ValueError("search.sampler: model needs the study's recipe, space and device")
            return ModelSampler(context, seed=seed)
    raise ValueError(f"--sampler: unknown sampler {name!r}; use {', '.join(SAMPLERS[:-1])} or grid")
