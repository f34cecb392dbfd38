"""What one run of a study may spend (`Budget`) and who listens to it (`Hooks`): the study driver's
typed inputs, defaulting to the recipe's search section."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tuner.recipe import Recipe

Progress = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Budget:
    """Budgets count the whole study, so a re-run after an interruption continues where it stopped:
    `trials` is the study's total (pruned trials count), `timeout_s` bounds this run."""

    trials: int
    timeout_s: float | None  # None: no time limit for this run
    patience: int | None  # stop when the best has not improved for this many trials
    sampler: str
    seed: int
    remeasure_top: int = 3  # configs measured again before naming a winner (0: trust one run)

    @classmethod
    def for_recipe(cls, recipe: Recipe, **given: Any) -> Budget:
        """The recipe's search budget, with any of the fields given (not None) instead."""
        s = recipe.search
        values = {
            "trials": s.trials,
            "timeout_s": s.timeout_min * 60,
            "patience": s.patience,
            "sampler": s.sampler,
            "seed": s.seed,
        }
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)


def _never() -> bool:
    return False


def _ignore(_event: dict[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """`progress` gets each event (trial_started, trial_finished, new_best, done); `should_stop`
    is asked every loop turn (a cancelled job, a worker shutting down)."""

    progress: Progress = field(default=_ignore)
    should_stop: Callable[[], bool] = field(default=_never)
