"""The performance model as the search and the planner use it: fit to observations, then predict
tokens/s with a 90% interval, step time, peak memory and the chance to fit, for any configs of a
recipe (also on more devices than were measured)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tuner.config import Config
from tuner.devices import DeviceInfo
from tuner.estimate import budget_bytes, reserved_ratio_prior
from tuner.perf.fitting import Fit, fit
from tuner.perf.memory import MemoryModel
from tuner.perf.model import Features, features
from tuner.perf.observations import Observation
from tuner.perf.priors import DevicePriors, device_priors
from tuner.perf.workload import StepWork, step_work
from tuner.recipe import Recipe


@dataclass(frozen=True)
class Predicted:
    """Per config (same order as asked): what the model expects of it."""

    configs: list[Config]
    works: list[StepWork]
    tokens_per_s: np.ndarray
    tokens_low: np.ndarray  # 90% interval of a measurement's tokens/s
    tokens_high: np.ndarray
    step_time_s: np.ndarray
    log_sd_coef: np.ndarray  # what more measurements could still teach (log units)
    log_sd: np.ndarray  # coefficients and misfit
    estimated_peak_mem_bytes: np.ndarray
    p_fit: np.ndarray  # chance the measured peak stays within the memory budget


def prediction_error(predicted, measured):
    """|predicted / measured - 1| (floats or arrays): how far a tokens/s prediction missed, as the
    issue's targets, the benchmarks and the dashboard count it."""
    return np.abs(np.asarray(predicted, dtype=float) / np.asarray(measured, dtype=float) - 1)


def workload(recipe: Recipe, configs: Sequence[Config], device: DeviceInfo) -> list[StepWork]:
    return [step_work(recipe, c, device) for c in configs]


class Predictor:
    """A fitted step-time model and memory-ratio model for one device family on one machine."""

    def __init__(self, device: DeviceInfo, priors: DevicePriors | None = None):
        self.device = device
        self.priors = priors or device_priors(device)
        self.time_fit: Fit = fit(*self._data([]), self.priors)
        self.memory = MemoryModel(prior_ratio=reserved_ratio_prior(device.family), family=device.family)
        self.observations: list[Observation] = []

    def _data(self, obs: Sequence[Observation]) -> tuple[Features, np.ndarray, np.ndarray]:
        works = [step_work(o.recipe, o.config, self.device) for o in obs]
        f = features(works, [o.config for o in obs], self.priors)
        y = np.array([math.log(o.step_time_s) for o in obs])
        return f, y, np.array([o.rel_sd for o in obs])

    def fit(self, observations: Sequence[Observation]) -> Predictor:
        """Fit to `observations`, trials of one model (`observations.same_model`), starting from the
        device priors. The memory ratio is this model's own: it depends on the model's allocation
        pattern."""
        self.observations = list(observations)
        start = self.time_fit if self.time_fit.n else None
        data = self._data([o for o in observations if o.tokens_per_s])
        self.time_fit = fit(*data, self.priors, start)
        self.memory = MemoryModel(
            observations, reserved_ratio_prior(self.device.family), self.device.family, self.device
        )
        return self

    def features(self, recipe: Recipe, configs: Sequence[Config]) -> tuple[list[StepWork], Features]:
        works = workload(recipe, configs, self.device)
        return works, features(works, configs, self.priors)

    def predict(
        self, recipe: Recipe, configs: Sequence[Config], cached: tuple[list[StepWork], Features] | None = None
    ) -> Predicted:
        works, f = cached or self.features(recipe, configs)
        p = self.time_fit.predict(f)
        tokens = np.array([w.tokens for w in works], dtype=float)
        low_t, high_t = p.interval()
        est = np.array([w.peak_mem_bytes for w in works], dtype=float)
        budget = budget_bytes(recipe, self.device)
        return Predicted(
            configs=list(configs),
            works=works,
            tokens_per_s=tokens / p.step_time(),
            tokens_low=tokens / high_t,
            tokens_high=tokens / low_t,
            step_time_s=p.step_time(),
            log_sd_coef=p.sd_coef,
            log_sd=p.sd,
            estimated_peak_mem_bytes=est,
            p_fit=self.memory.p_fit(configs, est, budget) if len(configs) else np.zeros(0),
        )
