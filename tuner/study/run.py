"""`run_study`: tune a recipe end to end, from opening (or resuming) its study to its summary."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path

import optuna

from tuner.config import Config
from tuner.executors.base import Executor
from tuner.recipe import Recipe
from tuner.resume import release_study
from tuner.storage import default_storage_url
from tuner.study.budget import Budget, Hooks, Progress
from tuner.study.driver import Driver
from tuner.study.remeasure import remeasure
from tuner.summary import StudySummary, summarize
from tuner.tracking import tracked_hooks


def run_study(
    recipe: Recipe,
    *,
    storage_url: str | None = None,
    executor: Executor | None = None,
    trials: int | None = None,
    timeout_s: float | None = None,
    patience: int | None = None,
    sampler: str | None = None,
    seed: int | None = None,
    enqueue: Iterable[Config] = (),
    progress: Progress | None = None,
    should_stop: Callable[[], bool] | None = None,
    remeasure_top: int = 3,
    workdir: str | Path | None = None,
    study_name: str | None = None,
) -> StudySummary:
    """Tune `recipe`: create or resume its study, run trials, re-measure the top, summarise.

    Budgets default to the recipe's search section and count the whole study (`Budget`), so
    re-running after an interruption continues where it stopped. `study_name` overrides the
    default name (e.g. the nightly's own study per night).
    """
    url = storage_url or default_storage_url()
    budget = Budget.for_recipe(
        recipe, trials=trials, timeout_s=timeout_s, patience=patience, sampler=sampler, seed=seed,
        remeasure_top=remeasure_top,
    )  # fmt: skip
    hooks = Hooks(**{k: v for k, v in {"progress": progress, "should_stop": should_stop}.items() if v})
    owned = executor is None
    if executor is None:
        from tuner.executors import make_executor

        executor = make_executor("local")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    driver = Driver(recipe, url, executor, budget, hooks, name=study_name, workdir=workdir)
    driver.hooks = tracked_hooks(driver.hooks, driver.name, recipe.name)  # MLflow, when configured
    try:
        driver.open(list(enqueue))
        driver.refresh()
        why = driver.loop()
        if why != "cancelled":
            remeasure(driver, budget.remeasure_top)
    except BaseException:
        # Ctrl-C or a crash: running trials are stopped and their configs re-queued for a rerun.
        if driver.study is not None:
            driver.cancel_pending()
        raise
    finally:
        if driver.study is not None:
            # Best effort: a release the database refused frees the study when its heartbeat goes
            # stale (60 s), and must not hide the error that brought us here.
            with contextlib.suppress(Exception):
                release_study(driver.study, driver.owner)
        if owned:
            executor.close()
    summary = summarize(driver.name, url)
    best = summary.best.tokens_per_s if summary.best else None
    driver.event("done", reason=why, summary=summary.to_dict(), best_tokens_per_s=best)
    return summary
