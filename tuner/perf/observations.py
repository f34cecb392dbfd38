"""Measured trials as the performance model's data: one `Observation` per trial that ran (ok or
out of memory), read from a study or from every study of the same model on the same fingerprint,
each weighed by how tightly its step time was measured."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tuner.config import Config, ConfigError, shape_reasons
from tuner.recipe import Recipe, RecipeError, recipe_from_dict
from tuner.record import keys
from tuner.record.ranking import config_throughput
from tuner.record.status import OK, OOM
from tuner.result import budget_peak
from tuner.space import config_from_params

_SPREAD_TO_SD = 0.25  # max-min over a handful of steps spans about four sd of the median
_Z95 = 1.959964  # `step_time_ci` is the relative half-width of the median's 95% interval


@dataclass(frozen=True)
class Observation:
    recipe: Recipe
    config: Config
    status: str  # ok or oom
    tokens_per_s: float | None
    rel_sd: float  # relative sd of the measured step time
    peak_mem_bytes: float | None  # the budget's peak (`tuner.result.budget_peak`)
    estimated_peak_mem_bytes: float | None
    trial: int | None = None  # its trial number in its study, where it came from one

    @property
    def step_time_s(self) -> float:
        """Global tokens per step over tokens/s: the step the throughput was measured from."""
        return self.recipe.tokens_per_step / float(self.tokens_per_s or math.nan)


def relative_sd(attrs: dict[str, Any]) -> float:
    """The measurement's relative sd: from the 95% interval of the median step time when the
    trial has one (adaptive measurement), else from the spread of its measured steps."""
    ci = attrs.get(keys.STEP_TIME_CI)
    if _usable(ci):
        return float(ci) / _Z95
    spread = attrs.get(keys.STEP_TIME_SPREAD)
    return _SPREAD_TO_SD * float(spread) if _usable(spread) else 0.05


def _usable(value: Any) -> bool:
    """A stored interval or spread the fit can weigh by (not a bool, NaN, infinite or negative)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def observation(
    recipe: Recipe,
    params: dict[str, Any],
    attrs: dict[str, Any],
    again: Sequence[float] = (),
    trial: int | None = None,
) -> Observation | None:
    """The trial's observation, or None when it holds nothing to learn from (never ran,
    duplicate, cancelled, unreadable). `again`: the study's re-measurements of the trial
    (tokens/s); the throughput is then the ranking's median over all its runs, as the study
    reports it. The measurement sd stays the first run's (a conservative weight)."""
    status = attrs.get(keys.STATUS)
    if status not in (OK, OOM) or attrs.get(keys.DUPLICATE_OF) is not None:
        return None
    try:
        config = config_from_params(params)
    except (ConfigError, ValueError, TypeError):
        return None
    per_step = config.micro_batch_size * config.dp
    if recipe.train.global_batch_size % per_step or shape_reasons(config, recipe):
        return None  # not a config of this recipe: the model's formulas cannot describe its step
    tps = attrs.get(keys.TOKENS_PER_S)
    if status == OK and not (isinstance(tps, (int, float)) and tps > 0 and math.isfinite(tps)):
        return None
    peak = budget_peak(attrs)
    return Observation(
        recipe=recipe,
        config=config,
        status=status,
        tokens_per_s=config_throughput(float(tps), again) if status == OK else None,
        rel_sd=relative_sd(attrs),
        peak_mem_bytes=float(peak) if peak else None,
        estimated_peak_mem_bytes=attrs.get(keys.ESTIMATED_PEAK_MEM_BYTES),
        trial=trial,
    )


def study_observations(
    recipe: Recipe, trials: list[Any], remeasured: Mapping[int, Sequence[float]] | None = None
) -> list[Observation]:
    """Observations of Optuna FrozenTrials of one study of `recipe`; `remeasured`: the study's
    re-measurements by trial number (`keys.REMEASURED_PREFIX`)."""
    again = remeasured or {}
    out = []
    for t in trials:
        if not t.state.is_finished():
            continue
        obs = observation(recipe, t.params, t.user_attrs, again.get(t.number, ()), t.number)
        if obs is not None:
            out.append(obs)
    return out


def one_model(a: Recipe, b: Recipe) -> bool:
    """Whether two recipes train the same model with the same training setup, on any devices and
    search: then one step-time model describes the trials of both."""
    return a.model == b.model and a.train == b.train


def same_model(observations: Sequence[Observation], recipe: Recipe) -> list[Observation]:
    """The observations of `recipe`'s model (`one_model`). Another model's trials are left out.
    Fitted on their own and used as the prior means (the first design), they made every
    prediction worse once the device priors were near the machine: on the re-measured tables, 5
    trials of llama-tiny missed by 14.1% with the gpt-tiny table as that history against 10.8%
    without, gpt-tiny by 20.4% against 18.5% (BENCHMARKS section 11). Another model's fitted
    coefficients trade compute against memory and links in its own way: no prior for this one."""
    return [o for o in observations if one_model(o.recipe, recipe)]


def fingerprint_observations(
    url: str, fingerprint_hash: str, recipe: Recipe, exclude: str | None = None
) -> list[Observation]:
    """Every measured trial of `recipe`'s model (`same_model`) in every study on this fingerprint
    but the study named `exclude`. Studies of other models are not read."""
    import optuna

    from tuner.db import session_scope
    from tuner.record.reader import study_attrs_of_all
    from tuner.storage import get_storage, missing_database

    if missing_database(url):  # nothing measured yet; reading does not create the file
        return []
    storage = get_storage(url)  # creates Optuna's tables in a new database: then no studies
    with session_scope(url) as session:
        studies = study_attrs_of_all(session, (keys.RECIPE, keys.FINGERPRINT_HASH))
    out: list[Observation] = []
    for name, attrs in sorted(studies.items()):
        if attrs.get(keys.FINGERPRINT_HASH) != fingerprint_hash or name == exclude:
            continue
        try:
            theirs = recipe_from_dict(attrs.get(keys.RECIPE) or {})
        except (RecipeError, ValueError, TypeError):
            continue  # a study written by another version
        if not one_model(theirs, recipe):
            continue
        study = optuna.load_study(study_name=name, storage=storage)
        remeasured = keys.per_trial(study.user_attrs, keys.REMEASURED_PREFIX)
        out.extend(study_observations(theirs, study.get_trials(deepcopy=False), remeasured))
    return out
