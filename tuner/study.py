"""The Optuna study: an ask/tell loop that keeps an executor's free slots busy, prunes what needs
no device time, survives a killed driver, and re-measures the top configs before naming a winner.

The driver is the only writer to the storage; trial processes only write their result files.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.baseline import baseline_config
from tuner.config import Config
from tuner.devices import describe, resolve_family
from tuner.executors.base import Executor
from tuner.fingerprint import fingerprint, fingerprint_hash
from tuner.prune import calibration_factor, verdict
from tuner.recipe import Recipe
from tuner.result import RESULT_KEYS, TrialResult, TrialSpec
from tuner.resume import HEARTBEAT_KEY, OWNER_KEY, new_owner, recover_dead_trials, warm_start_configs
from tuner.settings import absolute_path, runs_dir
from tuner.space import SearchSpace, config_from_params, load_space, trial_params
from tuner.storage import default_storage_url, get_storage
from tuner.summary import REMEASURED_PREFIX, StudySummary, build_summary

HEARTBEAT_INTERVAL_S = 5.0  # also how long one executor.wait blocks

# Every trial of a study uses the same model init and data, so losses compare across configs.
TRIAL_SEED = 0

# Evidence kept with each trial besides the public result keys.
_EVIDENCE_KEYS = (
    "error_kind",
    "losses",
    "step_times",
    "wall_s",
    "measured_s",
    "breakdown",
    "log_path",
    "log_tail",
    "node",
)

Progress = Callable[[dict[str, Any]], None]


def study_name(recipe: Recipe, fp: dict[str, Any]) -> str:
    """`<recipe name>-<recipe hash>-<fingerprint hash>`; a Pareto study gets `-pareto` too,
    since it has two objectives and cannot share trials with a throughput-only study.

    The recipe's name is free text; in the study name it is reduced to letters, digits, '.', '_'
    and '-' (at most 100), since a study name also names its build directory."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", recipe.name).strip("-.")[:100].rstrip("-.") or "recipe"
    name = f"{slug}-{recipe.hash()}-{fingerprint_hash(fp)}"
    return name + "-pareto" if recipe.search.objective == "throughput_memory" else name


def make_sampler(name: str, seed: int, multi_objective: bool) -> optuna.samplers.BaseSampler:
    """A seeded sampler. `grid` is random sampling underneath; the driver enqueues the grid."""
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
                seed=seed,
                multivariate=True,
                group=True,
                constant_liar=True,
                n_startup_trials=5,
            )
        if name == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=5, warn_independent_sampling=False)
        if name == "cmaes":
            # CMA-ES handles numeric knobs only; the categorical ones are sampled at random.
            return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
        if name in ("random", "grid"):
            return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"--sampler: unknown sampler {name!r}; use tpe, gp, cmaes, random or grid")


@dataclass
class _Pending:
    trial: optuna.trial.Trial
    config: Config
    spec: TrialSpec


class _Driver:
    def __init__(self, recipe: Recipe, storage_url: str, executor: Executor, opts: dict[str, Any]):
        self.recipe = recipe
        self.url = storage_url
        self.executor = executor
        self.o = opts
        self.family = resolve_family(recipe.hardware.device)
        self.device = describe(self.family)
        self.fp = fingerprint(self.family)
        self.name = opts["study_name"] or study_name(recipe, self.fp)
        self.space: SearchSpace = load_space(recipe.search.space or self.family).narrow(
            recipe.search.overrides
        )
        self.storage = get_storage(storage_url)
        self.multi = recipe.search.objective == "throughput_memory"
        self.owner = new_owner()
        self.pending: dict[str, _Pending] = {}
        self.calibration = 1.0  # measured/estimated peak memory so far (see _refresh)
        self.workdir = (absolute_path(opts["workdir"]) if opts["workdir"] else runs_dir()) / self.name
        self.progress: Progress = opts["progress"] or (lambda _event: None)
        self.should_stop = opts["should_stop"] or (lambda: False)
        self._grid: list[Config] | None = None

    # ---- opening and resuming -------------------------------------------------------------

    def open(self) -> None:
        directions = ["maximize", "minimize"] if self.multi else ["maximize"]
        probe = optuna.create_study(
            study_name=self.name, storage=self.storage, directions=directions, load_if_exists=True
        )
        n_before = len(probe.get_trials(deepcopy=False))
        # Offset the seed by the history so a resumed random/grid search does not replay itself.
        sampler = make_sampler(self.o["sampler"], self.o["seed"] + n_before, self.multi)
        self.study = optuna.load_study(study_name=self.name, storage=self.storage, sampler=sampler)
        if "recipe" not in self.study.user_attrs:
            self._first_open()
        for config in self.o["enqueue"]:
            self._enqueue(config, "enqueued")
        recover_dead_trials(self.study, self.study.get_trials(deepcopy=False), self.owner)

    def _first_open(self) -> None:
        for key, value in {
            "recipe": self.recipe.to_dict(),
            "recipe_hash": self.recipe.hash(),
            "fingerprint": self.fp,
            "fingerprint_hash": fingerprint_hash(self.fp),
            "space": self.space.name,
            "objective": self.recipe.search.objective,
        }.items():
            self.study.set_user_attr(key, value)
        base = baseline_config(self.recipe, self.device, self.space)
        self._enqueue(base, "baseline")
        if base.amp != "O0" and "O0" in (self.space.domains["amp"] or ()):
            # The fp32 run every low-precision config's losses are checked against.
            self._enqueue(Config(**{**base.to_dict(), "amp": "O0"}), "fp32_reference")
        fp_hash = fingerprint_hash(self.fp)
        for config in warm_start_configs(self.storage, self.url, self.recipe, fp_hash, exclude=self.name):
            self._enqueue(config, "warm_start")

    def _enqueue(self, config: Config, role: str) -> bool:
        if not self.space.contains(config, self.recipe.hardware.devices):
            return False
        if verdict(config, self.recipe, self.device).reason is not None:
            return False
        self.study.enqueue_trial(trial_params(config), user_attrs={"role": role}, skip_if_exists=True)
        return True

    # ---- the loop ---------------------------------------------------------------------------

    def _refresh(self) -> list[FrozenTrial]:
        """One read of the study per loop turn: budget count, measured configs, best so far."""
        trials = self.study.get_trials(deepcopy=False)
        # A trial a dead or cancelled driver left does not count: its config runs again.
        self.finished = [
            t
            for t in trials
            if t.state.is_finished()
            and not (t.user_attrs.get("driver_died") or t.user_attrs.get("cancelled"))
        ]
        self.done = len(self.finished)
        self.measured = {
            t.user_attrs["config_key"]: t.number
            for t in self.finished
            if t.state in (TrialState.COMPLETE, TrialState.FAIL) and "status" in t.user_attrs
        }
        ok = [t.user_attrs.get("tokens_per_s") for t in self.finished if t.state == TrialState.COMPLETE]
        self.calibration = calibration_factor(
            [
                (t.user_attrs.get("peak_mem_allocated_bytes"), t.user_attrs.get("estimated_peak_mem_bytes"))
                for t in self.finished
                if t.state == TrialState.COMPLETE
            ]
        )
        self.best = max((v for v in ok if v is not None), default=None)
        return trials

    def _stagnant(self) -> bool:
        patience = self.o["patience"]
        if not patience:
            return False
        best, since = -math.inf, 0
        for t in sorted(self.finished, key=lambda t: t.number):
            tps = t.user_attrs.get("tokens_per_s") if t.state == TrialState.COMPLETE else None
            if tps is not None and tps > best:
                best, since = tps, 0
            else:
                since += 1
        return since >= patience

    def _next_grid_config(self, trials: list[FrozenTrial]) -> bool:
        """Grid search: queue the next untried config of the (seeded, shuffled) enumeration."""
        if self._grid is None:
            self._grid = list(self.space.configs(self.recipe, self.device))
            random.Random(self.o["seed"]).shuffle(self._grid)
        if any(t.state == TrialState.WAITING for t in trials):
            return True
        tried = {t.user_attrs.get("config_key") for t in trials}
        while self._grid:
            config = self._grid.pop()
            if config.key() not in tried and self._enqueue(config, "grid"):
                return True
        return False

    def loop(self) -> str:
        """Run trials until a budget runs out; returns why it stopped."""
        deadline = time.monotonic() + self.o["timeout_s"] if self.o["timeout_s"] else math.inf
        probe = self._spec(Config(dp=self.recipe.hardware.devices), "probe")
        reason = "budget"
        while True:
            trials = self._refresh()
            can_ask = True
            if self.should_stop():
                self._cancel_pending()
                return "cancelled"
            if self.done + len(self.pending) >= self.o["trials"]:
                can_ask, reason = False, "trials"
            elif time.monotonic() > deadline:
                can_ask, reason = False, "timeout"
            elif self._stagnant():
                can_ask, reason = False, "patience"
            elif self.o["sampler"] == "grid" and not self._next_grid_config(trials):
                can_ask, reason = False, "grid exhausted"
            if can_ask:
                recover_dead_trials(self.study, trials, self.owner)
                if self.executor.free_slots(probe) > 0:
                    self._start_one()
                    continue
            if not self.pending:
                if can_ask:  # free_slots said 0 with nothing of ours running: someone else's
                    time.sleep(HEARTBEAT_INTERVAL_S)
                    continue
                return reason
            for result in self.executor.wait(timeout=HEARTBEAT_INTERVAL_S):
                self._finish(result)
            self._beat()

    def _spec(self, config: Config, tag: str, est: int | None = None, budget: int | None = None) -> TrialSpec:
        return TrialSpec(
            recipe=self.recipe.to_dict(),
            config=config.to_dict(),
            family=self.family,
            # The run id keeps a rerun from finding an earlier run's files in the same folder.
            workdir=str((self.workdir / f"trial-{tag}-{self.owner['id'][:8]}").resolve()),
            timeout_s=self.recipe.measure.timeout_s,
            estimated_peak_mem_bytes=est,
            memory_budget_bytes=budget,
            seed=TRIAL_SEED,
            tag=tag,
        )

    def _beat(self) -> None:
        now = time.time()
        for p in self.pending.values():
            # A trial another driver already failed (it judged us dead) is finished: skip it.
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                self.storage.set_trial_system_attr(p.trial._trial_id, HEARTBEAT_KEY, now)

    def _event(self, event: str, **fields: Any) -> None:
        self.progress({"event": event, "done": self.done, "total": self.o["trials"], **fields})

    def _start_one(self) -> None:
        trial = self.study.ask()
        self.storage.set_trial_system_attr(trial._trial_id, OWNER_KEY, self.owner)
        self.storage.set_trial_system_attr(trial._trial_id, HEARTBEAT_KEY, time.time())
        role = trial.user_attrs.get("role")
        try:
            config = self.space.suggest(trial, self.recipe, self.device)
        except ValueError as err:  # an enqueued config that the (narrowed) space no longer has
            trial.set_user_attr("error", f"config outside the search space: {err}")
            self.study.tell(trial, state=TrialState.FAIL)
            return
        key = config.key()
        trial.set_user_attr("config_key", key)
        self._event("trial_started", trial=trial.number, config=config.active_params(), role=role)
        v = verdict(config, self.recipe, self.device, self.calibration)
        trial.set_user_attr("estimator_calibration", round(self.calibration, 4))
        duplicate = self._measured_twin(key)
        if v.reason is not None:
            self._prune(trial, config, v.reason)
        elif duplicate is not None:
            trial.set_user_attr("duplicate_of", duplicate)
            self._prune(trial, config, f"duplicate of trial {duplicate}; its result is reused, no device run")
        else:
            if v.estimated_peak_mem_bytes is not None:
                trial.set_user_attr("estimated_peak_mem_bytes", v.estimated_peak_mem_bytes)
            spec = self._spec(config, str(trial.number), v.estimated_peak_mem_bytes, v.memory_budget_bytes)
            try:
                self.executor.submit(spec)
            except RuntimeError as err:
                # A shared cluster can take the slot `free_slots` offered before we submit. The
                # trial never ran: release it like a cancelled one and ask for its config again.
                trial.set_user_attr("cancelled", f"not started: {err}")
                self.study.tell(trial, state=TrialState.FAIL)
                self.study.enqueue_trial(trial.params, user_attrs={"role": role or "retry"})
                time.sleep(HEARTBEAT_INTERVAL_S / 5)
                return
            self.pending[spec.tag] = _Pending(trial, config, spec)

    def _measured_twin(self, key: str) -> int | None:
        """The trial that already measured (or is measuring) this config, if any."""
        for p in self.pending.values():
            if p.config.key() == key:
                return p.trial.number
        return self.measured.get(key)

    def _prune(self, trial: optuna.trial.Trial, config: Config, reason: str) -> None:
        trial.set_user_attr("status", "pruned")
        trial.set_user_attr("pruned_reason", reason)
        self.study.tell(trial, state=TrialState.PRUNED)
        self.done += 1
        self._event(
            "trial_finished",
            trial=trial.number,
            config=config.active_params(),
            result={"status": "pruned", "error": reason},
            best_tokens_per_s=self.best,
        )

    def _finish(self, result: TrialResult) -> None:
        p = self.pending.pop(result.tag, None)
        if p is None:
            return
        trial, before = p.trial, self.best
        record = {k: getattr(result, k) for k in (*RESULT_KEYS, *_EVIDENCE_KEYS)}
        record["device_seconds"] = (result.wall_s or 0.0) * p.config.world_size
        try:
            for key, value in record.items():
                if value is not None:
                    trial.set_user_attr(key, value)
            ok = result.status == "ok" and result.tokens_per_s and math.isfinite(result.tokens_per_s)
            if ok:
                peak = result.peak_mem_reserved_bytes or result.peak_mem_allocated_bytes
                budget = p.spec.memory_budget_bytes
                if peak is not None and budget:
                    # Feasible when <= 0: a config over the memory budget can never be the best.
                    trial.set_constraint("memory", (peak - budget) / budget)
                values = [result.tokens_per_s, float(peak or 0)] if self.multi else result.tokens_per_s
                self.study.tell(trial, values)
            else:
                self.study.tell(trial, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # another driver judged us dead and failed this trial; it is being retried
        self.done += 1
        self.measured[p.config.key()] = trial.number
        if ok and (before is None or result.tokens_per_s > before):
            self.best = result.tokens_per_s
        if result.status == "oom":
            self._smaller_baseline(trial.user_attrs.get("role"), p.config)
        fields = {"trial": trial.number, "config": p.config.active_params(), "result": result.public()}
        self._event("trial_finished", **fields, best_tokens_per_s=self.best)
        if self.best != before:
            self._event("new_best", **fields, best_tokens_per_s=self.best)

    def _smaller_baseline(self, role: str | None, config: Config) -> None:
        """The baseline is the largest micro-batch that FITS: when the estimator's pick ran out of
        memory, try the next smaller one, as a careful user would (likewise its fp32 reference)."""
        if role not in ("baseline", "fp32_reference"):
            return
        smaller = [m for m in self.space.domains["micro_batch_size"] or () if m < config.micro_batch_size]
        if smaller:
            self._enqueue(Config(**{**config.to_dict(), "micro_batch_size": max(smaller)}), role)

    def _cancel_pending(self) -> None:
        """Stop running trials; their configs go back in the queue for the next run.

        Every RUNNING trial this driver owns is released, including one asked for but not yet
        submitted when Ctrl-C arrived, so a rerun in this same process finds none left behind.
        """
        self.executor.cancel()
        self.pending.clear()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if (t.system_attrs.get(OWNER_KEY) or {}).get("id") != self.owner["id"]:
                continue
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                self.storage.set_trial_user_attr(t._trial_id, "cancelled", True)
                self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                self.study.enqueue_trial(t.params, user_attrs={"role": t.user_attrs.get("role") or "retry"})

    # ---- before naming a winner -------------------------------------------------------------

    def remeasure(self, top: int) -> None:
        """Measure the top configs again; a winner should not be one lucky run.

        The ranking uses medians, so a re-measurement can move a config out of the top and
        another one in: repeat until the trustworthy top `top` all have a second run (at most
        2 * top runs, so a noisy machine cannot keep it going).
        """
        runs_left = 2 * top
        while runs_left > 0 and not self.should_stop():
            done = self.study.user_attrs
            ranked = build_summary(self.study, self.url, top_k=top).top_k
            todo = [e["trial"] for e in ranked if f"{REMEASURED_PREFIX}{e['trial']}" not in done][:runs_left]
            if not todo:
                return
            runs_left -= len(todo)
            self._remeasure_trials(todo)

    def _remeasure_trials(self, numbers: list[int]) -> None:
        trials = {t.number: t for t in self.study.get_trials(deepcopy=False)}
        todo, waiting = list(numbers), {}
        while (todo or waiting) and not self.should_stop():
            while todo:
                config = config_from_params(trials[todo[0]].params)
                v = verdict(config, self.recipe, self.device)
                tag = f"remeasure-{todo[0]}"
                spec = self._spec(config, tag, v.estimated_peak_mem_bytes, v.memory_budget_bytes)
                if self.executor.free_slots(spec) <= 0:
                    break
                self.executor.submit(spec)
                waiting[spec.tag] = todo.pop(0)
            for result in self.executor.wait(timeout=HEARTBEAT_INTERVAL_S):
                number = waiting.pop(result.tag, None)
                if number is None:
                    continue
                cost = (result.wall_s or 0.0) * self.recipe.hardware.devices
                spent = self.study.user_attrs.get("remeasure_device_seconds", 0.0)
                self.study.set_user_attr("remeasure_device_seconds", spent + cost)
                # Finished trials are read-only in Optuna, so re-measurements live on the study,
                # keyed by the original trial's number (see tuner.summary).
                value = [result.tokens_per_s] if result.status == "ok" and result.tokens_per_s else []
                self.study.set_user_attr(f"{REMEASURED_PREFIX}{number}", value)
        if waiting:
            self.executor.cancel()


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

    Budgets count the whole study, so re-running after an interruption continues where it
    stopped: `trials` is the study's total (pruned trials count), `timeout_s` bounds this run.
    `study_name` overrides the default name (e.g. the nightly's own study per night).
    """
    s = recipe.search
    url = storage_url or default_storage_url()
    opts = {
        "trials": trials if trials is not None else s.trials,
        "timeout_s": timeout_s if timeout_s is not None else s.timeout_min * 60,
        "patience": patience if patience is not None else s.patience,
        "sampler": sampler or s.sampler,
        "seed": seed if seed is not None else s.seed,
        "enqueue": list(enqueue),
        "progress": progress,
        "should_stop": should_stop,
        "workdir": workdir,
        "study_name": study_name,
    }
    owned = executor is None
    if executor is None:
        from tuner.executors import make_executor

        executor = make_executor("local")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    driver = _Driver(recipe, url, executor, opts)
    try:
        driver.open()
        driver._refresh()
        why = driver.loop()
        if why != "cancelled":
            driver.remeasure(remeasure_top)
    except BaseException:
        # Ctrl-C or a crash: running trials are stopped and their configs re-queued for a rerun.
        if hasattr(driver, "study"):
            driver._cancel_pending()
        raise
    finally:
        if owned:
            executor.close()
    summary = build_summary(driver.study, url)
    driver._event("done", reason=why, summary=summary.to_dict(), best_tokens_per_s=driver.best)
    return summary
