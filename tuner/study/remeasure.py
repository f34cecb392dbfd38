"""Before naming a winner: the top configs are measured again, so a winner is not one lucky run.
Re-measurements are stored on the study (`remeasured:<trial>`, their step intervals under
`remeasured_ci:<trial>`): Optuna refuses to update finished trials. The ranking folds them into
each trial's median and interval.

Device time goes where it can change the answer. The first round re-measures every config of the
top once; later rounds only the best and the configs still tied with it (`Ranking.tied_with_best`).
Each re-measurement is measured to the run-to-run noise, not to the recipe's target
(`run_noise_ci`): one run's error is mostly that noise, so more, shorter runs buy more
precision per device-second than fewer tight ones.

The configs take turns (A B C A B C): a slow drift of the machine's load then falls on all of them
alike instead of on whichever config happened to run last. Like a trial, no re-measurement starts
after the study's time budget (`Driver.deadline`)."""

from __future__ import annotations

import time

from tuner.db import session_scope
from tuner.prune import verdict
from tuner.record import keys
from tuner.record.ranking import Ranking, run_noise_ci
from tuner.record.reader import read_study
from tuner.space import config_from_params
from tuner.study.driver import HEARTBEAT_INTERVAL_S, Driver

# The most re-measurements of one config: one for each of the top, more only for the contenders.
ROUNDS = 2


def remeasure(driver: Driver, top: int) -> None:
    """Measure the top `top` configs again once each, then, up to ROUNDS times in all, the best and
    the configs still tied with it, in turns.

    The ranking uses medians, so a re-measurement can move a config out of the top and another
    one in: the first round repeats until the trustworthy top `top` all have been re-measured (at
    most 2 * top configs, so a noisy machine cannot keep it going).
    """
    configs_left, runs = 2 * top, 0
    while configs_left > 0 and not driver.hooks.should_stop():
        ranking = _ranking(driver)
        done = driver.study.user_attrs
        todo = [e.trial for e in ranking.ranked[:top] if keys.remeasured_key(e.trial) not in done]
        todo = todo[:configs_left]
        if not todo:
            break
        configs_left -= len(todo)
        runs = _remeasure_trials(driver, todo, ranking, runs)
    for _ in range(ROUNDS - 1):
        if driver.hooks.should_stop():
            return
        ranking = _ranking(driver)
        open_ = [e for e in ranking.ranked[: 2 * top] if e is ranking.best or ranking.tied_with_best(e)]
        todo = [e.trial for e in open_ if len(e.remeasured_tokens_per_s) < ROUNDS]
        if len(open_) < 2 or not todo:
            return  # the best is clear of every other config, or every contender had its rounds
        runs = _remeasure_trials(driver, todo, ranking, runs)


def _ranking(driver: Driver) -> Ranking:
    with session_scope(driver.url) as session:
        record = read_study(session, driver.name)
    return record.ranking() if record is not None else Ranking()


def _remeasure_trials(driver: Driver, numbers: list[int], ranking: Ranking, runs: int) -> int:
    """Re-measure trials `numbers` in this order; `runs`: the re-measurements this driver started
    before (each run gets its own tag and folder). Returns the new count."""
    trials = {t.number: t for t in driver.study.get_trials(deepcopy=False)}
    measure = driver.recipe.measure
    target = run_noise_ci(measure.target_ci, ranking.run_noise or 0.0) if measure.target_ci else None
    todo, waiting = list(numbers), {}
    while (todo or waiting) and not driver.hooks.should_stop():
        while todo:
            config = config_from_params(trials[todo[0]].params)
            v = verdict(config, driver.recipe, driver.device)
            spec = driver.spec(
                config, f"remeasure-{todo[0]}-{runs}", v.estimated_peak_mem_bytes, v.memory_budget_bytes
            )
            spec.target_ci = target
            if time.monotonic() > driver.deadline:
                todo.clear()  # the study's time budget is spent: no run starts after it
                break
            if driver.executor.free_slots(spec) <= 0:
                break
            try:
                driver.executor.submit(spec)
            except RuntimeError:
                # A shared cluster took the slot `free_slots` offered: wait and offer it again.
                time.sleep(HEARTBEAT_INTERVAL_S / 5)
                break
            waiting[spec.tag] = todo.pop(0)
            runs += 1
        driver.beat()
        for result in driver.executor.wait(timeout=HEARTBEAT_INTERVAL_S):
            number = waiting.pop(result.tag, None)
            if number is None:
                continue
            cost = (result.wall_s or 0.0) * driver.recipe.hardware.devices
            spent = driver.study.user_attrs.get(keys.REMEASURE_DEVICE_SECONDS, 0.0)
            driver.study.set_user_attr(keys.REMEASURE_DEVICE_SECONDS, spent + cost)
            # A failed re-measurement adds no value, but its key marks the config as re-measured.
            ok = result.measured_ok
            _append(driver, keys.remeasured_key(number), [result.tokens_per_s] if ok else [])
            if ok:
                _append(driver, keys.remeasured_ci_key(number), [result.step_time_ci])
    if waiting:
        driver.executor.cancel()
    return runs


def _append(driver: Driver, key: str, values: list) -> None:
    driver.study.set_user_attr(key, [*driver.study.user_attrs.get(key, []), *values])
