"""Knob importance for tokens/s over a study's completed trials (Optuna's PED-ANOVA evaluator: fast,
no model to fit), kept with the study's finished trials while the study barely grew."""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tuner.record.trial import TrialRecord

if TYPE_CHECKING:
    from tuner.record.reader import Finished

IMPORTANCE_LIMIT = 1000  # completed trials, evenly spaced, the importance evaluator sees
# Below this many completed trials the ranking of knobs is indicative: on 9 trials PED-ANOVA put
# `bucket_mb` first. It is shown with its spread over bootstrap resamples of the trials.
INDICATIVE_BELOW = 20
RESAMPLES = 16  # bootstrap resamples (about 50 ms each below 20 trials)


@dataclass(frozen=True)
class Uncertainty:
    """Each knob's importance range over bootstrap resamples of the completed trials (10th and
    90th percentile), for a study with fewer than `INDICATIVE_BELOW` of them."""

    completed: int
    low: dict[str, float] = field(default_factory=dict)
    high: dict[str, float] = field(default_factory=dict)

    @property
    def indicative(self) -> bool:
        return self.completed < INDICATIVE_BELOW


def uncertainty(rows: list[TrialRecord], distributions: dict[str, Any], seed: int = 0) -> Uncertainty:
    """The bootstrap spread of knob importance, computed only while it is indicative."""
    done = [r for r in rows if r.completed and r.tokens_per_s is not None]
    if len(done) >= INDICATIVE_BELOW or len(done) < 4:
        return Uncertainty(len(done))
    rng = random.Random(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(RESAMPLES):
        sample = sorted((rng.choice(done) for _ in done), key=lambda r: r.number)
        ranked = _ped_anova(sample, distributions)
        for name in distributions:
            draws.setdefault(name, []).append(ranked.get(name, 0.0))
    low, high = {}, {}
    for name, values in draws.items():
        values.sort()
        low[name] = values[int(0.1 * (len(values) - 1))]
        high[name] = values[int(round(0.9 * (len(values) - 1)))]
    return Uncertainty(len(done), low, high)


def importances(
    rows: list[TrialRecord], finished: Finished, distributions: dict[str, Any]
) -> dict[str, float]:
    """Knob importance for tokens/s, most important first. Reuses the importance in `finished`
    while the completed trials grew by at most 2% since (for a large study, one more trial does
    not move it), else computes and keeps it."""
    done = [r for r in rows if r.completed and r.tokens_per_s is not None]
    if finished.importance is not None and 0 <= len(done) - finished.importance[0] <= 0.02 * len(done):
        return finished.importance[1]
    ranked = _ped_anova(done, distributions)
    finished.importance = (len(done), ranked)
    return ranked


def _ped_anova(done: list[TrialRecord], distributions: dict[str, Any]) -> dict[str, float]:
    import optuna
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances
    from optuna.trial import TrialState, create_trial

    if len(done) < 4:
        return {}
    step = max(1.0, len(done) / IMPORTANCE_LIMIT)
    chosen = [done[int(i * step)] for i in range(min(len(done), IMPORTANCE_LIMIT))]
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    frozen = []
    for r in chosen:
        names = [k for k in r.params if k in distributions]
        try:
            frozen.append(
                create_trial(
                    state=TrialState.COMPLETE,
                    params={k: r.params[k] for k in names},
                    distributions={k: distributions[k] for k in names},
                    value=r.tokens_per_s,
                )
            )
        except ValueError:
            continue  # a param outside its recorded domain: leave the trial out
    present = {k for t in frozen for k in t.params}
    # Single-choice params (dp/tp/pp are recorded next to the split label) carry no information.
    params = [k for k, d in distributions.items() if k in present and not d.single()]
    if not params or len(frozen) < 4:
        return {}
    study = optuna.create_study(direction="maximize")
    study.add_trials(frozen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "less than 2 trials in a regime": said by `Uncertainty`
        ranked = get_param_importances(study, evaluator=PedAnovaImportanceEvaluator(), params=params)
    return {k: float(v) for k, v in ranked.items()}
