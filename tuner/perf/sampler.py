"""`ModelSampler`: an Optuna sampler that measures next the untried feasible config with the best
expected improvement in predicted tokens/s (times the chance it fits in memory, squared), refits
the performance model after every finished trial, and hands the choice to TPE while the model's
recent predictions miss by more than `MISS_LIMIT`. Each trial records who chose it and what the
model predicted for it, so a study stays a plain Optuna study (readable by optuna-dashboard)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from tuner.config import Config, ConfigError, infeasible_reasons, run_key, stored_run_key
from tuner.devices import DeviceInfo
from tuner.perf.candidates import candidates
from tuner.perf.model import Features
from tuner.perf.observations import Observation, study_observations
from tuner.perf.predictor import Predictor
from tuner.perf.priors import DevicePriors
from tuner.prune import oom_floor, study_calibration, verdict
from tuner.recipe import Recipe
from tuner.record import keys
from tuner.record.status import OOM
from tuner.space import SearchSpace, config_from_params, trial_params

MISS_LIMIT = 0.35  # median |measured/predicted - 1| of the last RECENT predicted trials
RECENT = 3
# Predictions made from fewer measured trials than this are not judged: until then the priors
# rule, and expected improvement's uncertainty term does the exploring.
JUDGED_AFTER = 5
# A device run is worth it only when the config is at least this likely to fit in memory: one that
# runs out costs about as much device time as one that measures. On the committed table (30 seeds,
# BENCHMARKS.md section 11) 0.5 spent 16% of the device time on failures, 0.8 under 5%.
MIN_P_FIT = 0.8
# While the model misses, TPE chooses; but its picks are held to the same memory gate. A run that
# runs out of memory costs as much as one that measures, and the throughput model missing says
# nothing about the memory model, a separate fit. On the committed table, judged on a host where
# the model missed its first pipeline configs, TPE's free picks in those fallbacks were most of
# the failed device time (BENCHMARKS.md section 11). TPE proposes up to this many configs per trial.
TPE_DRAWS = 16


@dataclass(frozen=True)
class SamplerContext:
    """What a sampler that ranks configs needs to know about the study."""

    recipe: Recipe
    space: SearchSpace
    device: DeviceInfo
    # Measured trials of earlier studies of this model on this machine's fingerprint
    # (`observations.fingerprint_observations`): more of its trials, fitted with the study's own.
    history: tuple[Observation, ...] = ()
    # The performance model's priors, where not this host's (`Executor.device_priors`).
    priors: DevicePriors | None = None


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    # erfc keeps its digits in the far left tail, where 1 + erf(x) cancels to 0 below z = -8.
    return 0.5 * np.vectorize(math.erfc)(-np.asarray(z, dtype=float) / math.sqrt(2.0))


def expected_improvement(mean: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """EI of a normal N(mean, sd) over `best` (log tokens/s)."""
    sd = np.maximum(sd, 1e-6)
    z = (mean - best) / sd
    pdf = np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    return sd * (z * _normal_cdf(z) + pdf)


# Below this z, z * cdf(z) + pdf(z) is computed from its asymptotic series pdf(z) / z^2 x (1 - 3/z^2
# + 15/z^4) (from Mills' ratio): directly, pdf(z) underflows near z = -38.
_LOG_EI_ASYMPTOTE_Z = -30.0


def log_expected_improvement(mean: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """log(EI), finite however far below `best` a config is predicted: configs that all have
    EI 0 in floating point still rank by how far behind they are (a plain EI would hand the pick to
    whichever came first)."""
    sd = np.maximum(sd, 1e-6)
    z = (mean - best) / sd
    far = z < _LOG_EI_ASYMPTOTE_Z
    near = np.where(far, 0.0, z)
    direct = near * _normal_cdf(near) + np.exp(-0.5 * near**2) / math.sqrt(2 * math.pi)
    log_pdf = -0.5 * z**2 - 0.5 * math.log(2 * math.pi)
    z2 = np.where(far, z, 1.0) ** 2
    tail = log_pdf - np.log(z2) + np.log1p(-3 / z2 + 15 / z2**2)
    with np.errstate(divide="ignore"):
        return np.log(sd) + np.where(far, tail, np.log(direct))


class _TpeDraw:
    """A stand-in for a trial that `SearchSpace.suggest` fills with TPE's proposals, without
    recording anything in the study: one call, one proposed config."""

    def __init__(self, tpe: optuna.samplers.TPESampler, study: optuna.Study, trial: FrozenTrial):
        self._tpe, self._study, self._trial = tpe, study, trial
        self._fixed_params: dict[str, Any] = {}  # knobs that follow from the split (`space._record`)

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        if name in self._fixed_params:
            return self._fixed_params.pop(name)
        return self._tpe.sample_independent(self._study, self._trial, name, CategoricalDistribution(choices))


def _config_of(params: dict[str, Any]) -> Config | None:
    try:
        return config_from_params(params)
    except (ConfigError, ValueError, TypeError):
        return None


class ModelSampler(optuna.samplers.BaseSampler):
    def __init__(self, context: SamplerContext, seed: int = 0):
        self.context = context
        self.seed = seed
        self.predictor = Predictor(context.device, context.priors)
        self._tpe = optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
        self._choice: dict[int, Config] = {}
        self._fitted_on: int | None = None
        self._pool: list[Config] | None = None  # candidates, when the space is small enough to keep
        self._features: dict[str, tuple] = {}
        # Set when every config of the (whole, ranked) space is tried or would be pruned.
        self.exhausted = False

    # ---- the BaseSampler contract: every knob is chosen at once, in before_trial ----------------

    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study, trial, search_space) -> dict[str, Any]:
        return {}

    def sample_independent(self, study, trial, param_name: str, param_distribution: BaseDistribution) -> Any:
        config = self._choice.get(trial.number)
        if config is not None and isinstance(param_distribution, CategoricalDistribution):
            value = trial_params(config).get(param_name)
            if value in param_distribution.choices:
                return value
        return self._tpe.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._tpe.before_trial(study, trial)
        trials = study.get_trials(deepcopy=False)
        self._refit(trials, study)
        fixed = trial.system_attrs.get(keys.FIXED_PARAMS)
        if fixed:
            config = _config_of(fixed)
            if config is not None and config.world_size == self.context.recipe.hardware.devices:
                self._record(study, trial, keys.CHOSEN_BY_QUEUE, config)
            return
        if self._missing(trials):
            config = self._tpe_choice(study, trial, trials)
            if config is not None:
                self._choice[trial.number] = config
                self._record(study, trial, keys.CHOSEN_BY_TPE, config)
                return
        config = self._choose(trials)
        if config is None:
            self._record(study, trial, keys.CHOSEN_BY_TPE, None)
            return
        self._choice[trial.number] = config
        self._record(study, trial, keys.CHOSEN_BY_MODEL, config)

    def after_trial(self, study, trial, state, values) -> None:
        # TPE's picks get the model's prediction too (fitted before this trial's result), so the
        # misfit test can tell when the model is good again.
        if trial.user_attrs.get(keys.CHOSEN_BY) == keys.CHOSEN_BY_TPE and state == TrialState.COMPLETE:
            config = _config_of(trial.params)
            if config is not None and config.world_size == self.context.recipe.hardware.devices:
                self._record(study, trial, keys.CHOSEN_BY_TPE, config)
        self._choice.pop(trial.number, None)
        self._tpe.after_trial(study, trial, state, values)

    # ---- the model ---------------------------------------------------------------------------

    def _refit(self, trials: list[FrozenTrial], study: optuna.Study) -> None:
        finished = sum(t.state.is_finished() for t in trials)
        if finished != self._fitted_on:
            # A resumed study's re-measurements (from its earlier runs) count as the ranking counts them.
            remeasured = keys.per_trial(study.user_attrs, keys.REMEASURED_PREFIX)
            own = study_observations(self.context.recipe, trials, remeasured)
            self.predictor.fit([*self.context.history, *own])
            self._fitted_on = finished

    def _missing(self, trials: list[FrozenTrial]) -> bool:
        """Whether the predictions for the last measured trials missed by more than MISS_LIMIT."""
        complete = sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.number)
        misses = [
            abs(t.user_attrs[keys.TOKENS_PER_S] / t.user_attrs[keys.PREDICTED_TOKENS_PER_S] - 1)
            for t in complete[JUDGED_AFTER:]
            if t.user_attrs.get(keys.PREDICTED_TOKENS_PER_S) and t.user_attrs.get(keys.TOKENS_PER_S)
        ][-RECENT:]
        return len(misses) == RECENT and float(np.median(misses)) > MISS_LIMIT

    def _cached(self, configs: list[Config]) -> list[tuple]:
        """(StepWork, Features row) per config, computed once per config of the study."""
        missing = [c for c in configs if c.key() not in self._features]
        if missing:
            works, f = self.predictor.features(self.context.recipe, missing)
            for i, c in enumerate(missing):
                self._features[c.key()] = (works[i], f.take([i]))
        return [self._features[c.key()] for c in configs]

    def _predict(self, configs: list[Config]):
        rows = self._cached(configs)
        f = Features.concat([r[1] for r in rows])
        return self.predictor.predict(self.context.recipe, configs, ([r[0] for r in rows], f))

    def _pool_for(self, measured: list[tuple[float, Config]]) -> list[Config]:
        ctx = self.context
        if self._pool is not None:
            return self._pool
        top = [c for _, c in sorted(measured, key=lambda p: -p[0])[:3]]
        pool, whole = candidates(
            ctx.space, ctx.recipe, ctx.device, seed=self.seed + len(measured), around=top
        )
        if whole:
            self._pool = pool  # the whole space: the same list every time (and it may run out)
        return pool

    def _runnable(self, trials: list[FrozenTrial]) -> Callable[[list[Config]], list[Config]]:
        """A filter keeping those configs this study has not tried and the driver would not prune
        (the study's tried set, calibration and OOM floor are read once, for many calls)."""
        ctx = self.context
        tried = set()
        for t in trials:
            config = _config_of(t.params) if t.params else None
            given = t.system_attrs.get(keys.FIXED_PARAMS)
            fixed = _config_of(given) if given else None  # {} would read as the plain config
            tried.update(run_key(c, ctx.recipe) for c in (config, fixed) if c is not None)
            if t.user_attrs.get(keys.CONFIG_KEY):
                tried.add(stored_run_key(t.user_attrs[keys.CONFIG_KEY], ctx.recipe))
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        calibration = study_calibration((t.user_attrs for t in complete), ctx.device)
        floor = oom_floor(
            (c, t.user_attrs.get(keys.ESTIMATED_PEAK_MEM_BYTES), t.number)
            for t in trials
            if t.user_attrs.get(keys.STATUS) == OOM and (c := _config_of(t.params)) is not None
        )

        def keep(configs: list[Config]) -> list[Config]:
            untried = [c for c in configs if run_key(c, ctx.recipe) not in tried]
            return [
                c
                for c, (work, _) in zip(untried, self._cached(untried), strict=True)
                if verdict(c, ctx.recipe, ctx.device, calibration, floor, est=work.estimate).reason is None
            ]

        return keep

    def _tpe_choice(
        self, study: optuna.Study, trial: FrozenTrial, trials: list[FrozenTrial]
    ) -> Config | None:
        """TPE's pick while the model misses, held to the model's memory gate: the first of
        `TPE_DRAWS` proposals that is untried, unpruned and at least `MIN_P_FIT` likely to fit.
        None when none is (the model's own pick, which passes the gate, runs instead)."""
        draw = _TpeDraw(self._tpe, study, trial)
        runnable = self._runnable(trials)
        for _ in range(TPE_DRAWS):
            try:
                config = self.context.space.suggest(draw, self.context.recipe, self.context.device)
            except (ConfigError, ValueError, TypeError):
                continue
            if infeasible_reasons(config, self.context.recipe, self.context.device):
                continue
            if runnable([config]) and self._predict([config]).p_fit[0] >= MIN_P_FIT:
                return config
        return None

    def _choose(self, trials: list[FrozenTrial]) -> Config | None:
        """The untried config with the best EI x P(fit)^2 that the driver would not prune."""
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        measured = [
            (t.values[0], c) for t in complete if t.values and (c := _config_of(t.params)) is not None
        ]
        pool = self._runnable(trials)(self._pool_for(measured))
        if not pool:
            # Every config of a space small enough to rank whole is tried or would be pruned: the
            # driver stops ("space exhausted") rather than spend trials on TPE's repeats.
            self.exhausted = self._pool is not None
            return None
        p = self._predict(pool)
        best = max((math.log(v) for v, _ in measured if v and v > 0), default=None)
        mean = np.log(p.tokens_per_s)
        with np.errstate(divide="ignore"):  # P(fit) 0: log -inf, never picked while another can fit
            if best is None:
                score = np.log(np.maximum(mean + p.log_sd_coef, 1e-300)) + 2 * np.log(p.p_fit)
            else:  # log(EI x P(fit)^2): the same order as EI x P(fit)^2, without its underflow
                score = log_expected_improvement(mean, p.log_sd_coef, best) + 2 * np.log(p.p_fit)
        gated = np.where(p.p_fit >= MIN_P_FIT, score, -np.inf)
        if np.isfinite(gated).any():
            return pool[int(np.argmax(gated))]
        # Nothing is likely enough to fit: the config likeliest to, among those the driver would run
        # (TPE's unchecked pick would be likelier to run out of memory); either way its outcome
        # teaches the memory model.
        return pool[int(np.argmax(p.p_fit))]

    def _record(self, study: optuna.Study, trial: FrozenTrial, chosen_by: str, config: Config | None) -> None:
        storage, tid = study._storage, trial._trial_id
        storage.set_trial_user_attr(tid, keys.CHOSEN_BY, chosen_by)
        if config is None:
            return
        p = self._predict([config])
        storage.set_trial_user_attr(tid, keys.PREDICTED_TOKENS_PER_S, round(float(p.tokens_per_s[0]), 2))
        interval = [round(float(p.tokens_low[0]), 2), round(float(p.tokens_high[0]), 2)]
        storage.set_trial_user_attr(tid, keys.PREDICTED_INTERVAL, interval)
        storage.set_trial_user_attr(tid, keys.PREDICTED_P_FIT, round(float(p.p_fit[0]), 3))
