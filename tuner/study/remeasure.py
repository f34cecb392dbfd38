"""Before naming a winner: the top configs are measured again, so a winner is not one lucky run.
Re-measurements are stored on the study (`remeasured:<trial>`): Optuna refuses to update finished
trials. The ranking folds them into each trial's median.

The configs take turns (A B C A B C): a slow drift of the machine's load then falls on all of them
alike instead of on whichever config happened to run last."""

from __future__ import annotations

from tuner.prune import verdict
from tuner.record import keys
from tuner.record.status import OK
from tuner.space import config_from_params
from tuner.study.driver import HEARTBEAT_INTERVAL_S, Driver
from tuner.summary import summarize

# Re-measurements of each top config, taken in turns.
ROUNDS = 2


def remeasure(driver: Driver, top: int) -> None:
    """Measure the top `top` configs again, ROUNDS times each, in turns.

    The ranking uses medians, so a re-measurement can move a config out of the top and another
    one in: repeat until the trustworthy top `top` all have been re-measured (at most 2 * top
    configs, so a noisy machine cannot keep it going).
    """
    configs_left = 2 * top
    while configs_left > 0 and not driver.hooks.should_stop():
        done = driver.study.user_attrs
        ranked = summarize(driver.name, driver.url, top_k=top).top_k
        todo = [e.trial for e in ranked if keys.remeasured_key(e.trial) not in done][:configs_left]
        if not todo:
            return
        configs_left -= len(todo)
        _remeasure_trials(driver, todo * ROUNDS)


def _remeasure_trials(driver: Driver, numbers: list[int]) -> None:
    trials = {t.number: t for t in driver.study.get_trials(deepcopy=False)}
    todo, waiting, runs = list(numbers), {}, 0
    while (todo or waiting) and not driver.hooks.should_stop():
        while todo:
            config = config_from_params(trials[todo[0]].params)
            v = verdict(config, driver.recipe, driver.device)
            spec = driver.spec(
                config, f"remeasure-{todo[0]}-{runs}", v.estimated_peak_mem_bytes, v.memory_budget_bytes
            )
            if driver.executor.free_slots(spec) <= 0:
                break
            driver.executor.submit(spec)
            waiting[spec.tag] = todo.pop(0)
            runs += 1
        for result in driver.executor.wait(timeout=HEARTBEAT_INTERVAL_S):
            number = waiting.pop(result.tag, None)
            if number is None:
                continue
            cost = (result.wall_s or 0.0) * driver.recipe.hardware.devices
            spent = driver.study.user_attrs.get(keys.REMEASURE_DEVICE_SECONDS, 0.0)
            driver.study.set_user_attr(keys.REMEASURE_DEVICE_SECONDS, spent + cost)
            value = [result.tokens_per_s] if result.status == OK and result.tokens_per_s else []
            before = driver.study.user_attrs.get(keys.remeasured_key(number), [])
            driver.study.set_user_attr(keys.remeasured_key(number), [*before, *value])
    if waiting:
        driver.executor.cancel()
