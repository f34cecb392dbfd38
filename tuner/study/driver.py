"""The study driver: an ask/tell loop that keeps an executor's free slots busy, prunes what needs no
device time, survives a killed driver, and records every trial. The driver is the only writer to
the storage; trial processes only write their result files."""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner import resume
from tuner.baseline import baseline_config, fp32_reference
from tuner.config import Config, run_key, stored_run_key
from tuner.estimate import reserved_ratio_prior
from tuner.executors.base import Executor
from tuner.fingerprint import fingerprint_hash
from tuner.perf.observations import fingerprint_observations
from tuner.perf.sampler import ModelSampler
from tuner.prune import OomFloor, oom_floor, study_calibration, verdict
from tuner.recipe import Recipe
from tuner.record import keys
from tuner.record.ranking import behind_line, contention_line, rank_trials, run_noise_ci
from tuner.record.status import OOM, PRUNED
from tuner.record.trial import from_frozen
from tuner.result import TrialResult, TrialSpec
from tuner.resume import new_owner, queued_params, recover_dead_trials, similar_study_configs
from tuner.settings import absolute_path, runs_dir
from tuner.space import SearchSpace, config_from_params, load_space, trial_params
from tuner.storage import get_storage
from tuner.study.budget import Budget, Hooks
from tuner.study.naming import study_name
from tuner.study.samplers import SamplerContext, make_sampler

HEARTBEAT_INTERVAL_S = 5.0  # also how long one executor.wait blocks

# Every trial of a study uses the same model init and data, so losses compare across configs.
TRIAL_SEED = 0
# A new trial surely outside a tie with the study's best so far (its whole 95% step interval below
# `ranking.contention_line`, 86% of the best on a CPU) cannot win: its measured steps stop then,
# before the interval reaches measure.target_ci. One clearly behind the best (`ranking.behind_line`,
# 90% of it on a CPU) is measured to the run-to-run noise's interval (`ranking.run_noise_ci`), not
# to measure.target_ci. Configs close to the best are measured to the target, re-measurements to
# the run-to-run noise.


@dataclass
class Pending:
    """A trial handed to the executor and not back yet."""

    trial: optuna.trial.Trial
    config: Config
    spec: TrialSpec


class Driver:
    """One run of a study: `open` it (creating or resuming), `loop` until a budget runs out."""

    def __init__(
        self,
        recipe: Recipe,
        storage_url: str,
        executor: Executor,
        budget: Budget,
        hooks: Hooks,
        *,
        name: str | None = None,
        workdir: str | Path | None = None,
    ):
        self.recipe = recipe
        self.url = storage_url
        self.executor = executor
        self.budget = budget
        self.hooks = hooks
        # Where the trials run, as the executor sees it (a Ray cluster's nodes describe themselves).
        described = executor.describe(recipe.hardware.device)
        self.family, self.device, self.fp = described.family, described.device, described.fingerprint
        self.name = name or study_name(recipe, self.fp)
        self.space: SearchSpace = load_space(recipe.search.space or self.family).narrow(
            recipe.search.overrides
        )
        self.storage = get_storage(storage_url)
        self.multi = recipe.search.objective == "throughput_memory"
        self.owner = new_owner()
        self.workdir = (absolute_path(workdir) if workdir else runs_dir()) / self.name
        self.study: optuna.Study | None = None  # set by `open`
        self.deadline = math.inf  # when the time budget ends (monotonic clock; set by `loop`)
        self.asking_since: float | None = None  # while `study.ask` runs (unix time): its trial is ours
        self.pending: dict[str, Pending] = {}
        # What one read of the study says (`refresh`): finished trials that count, measured configs
        # by key, the estimator's calibration, and the best throughput so far (the ranking's).
        self.finished: list[FrozenTrial] = []
        self.done = 0
        self.measured: dict[str, int] = {}
        self.calibration = reserved_ratio_prior(self.device.family)
        self.priors = None  # the performance model's, once `open` knows them
        self.floor = OomFloor()  # what ran out of memory bounds the configs estimated larger
        self.best: float | None = None
        self.best_number: int | None = None  # the ranking's best trial, with self.best
        self.run_noise: float | None = None  # the ranking's run-to-run noise, with self.best
        self._ranked_at: tuple[int, int] | None = None  # (finished trials, study attrs) last ranked
        self._grid: list[Config] | None = None
        self._study_beat_at = -math.inf  # when `beat` last wrote the study's driver heartbeat

    # ---- opening and resuming -------------------------------------------------------------

    def open(self, enqueue: list[Config]) -> None:
        directions = ["maximize", "minimize"] if self.multi else ["maximize"]
        probe = optuna.create_study(
            study_name=self.name, storage=self.storage, directions=directions, load_if_exists=True
        )
        n_before = len(probe.get_trials(deepcopy=False))
        # The model sampler also fits what earlier studies of this model measured on this machine.
        history = ()
        if self.budget.sampler == "model":
            fp = fingerprint_hash(self.fp)
            history = tuple(fingerprint_observations(self.url, fp, self.recipe, exclude=self.name))
        priors = self.executor.device_priors(self.device)
        context = SamplerContext(self.recipe, self.space, self.device, history, priors)
        # Offset the seed by the trials so far so a resumed random/grid search does not replay itself.
        sampler = make_sampler(self.budget.sampler, self.budget.seed + n_before, self.multi, context)
        # Recorded with the study: the executor's, or what the model sampler started from here.
        self.priors = priors or (sampler.predictor.priors if isinstance(sampler, ModelSampler) else None)
        self.study = optuna.load_study(study_name=self.name, storage=self.storage, sampler=sampler)
        resume.claim_study(self.study, self.owner)  # one driver per study, whatever started it
        self._study_beat_at = time.monotonic()
        if keys.RECIPE not in self.study.user_attrs:
            self._first_open()
        for config in enqueue:
            self.enqueue(config, keys.ENQUEUED)
        recover_dead_trials(self.study, self.study.get_trials(deepcopy=False), self.owner)

    def _first_open(self) -> None:
        """The study's record and its first queue: the baseline, the fp32 reference and the warm
        start. `keys.RECIPE` is written last: it marks this done, so a run interrupted before then
        does it again on resume (`enqueue` skips what is queued already)."""
        for key, value in {
            keys.RECIPE_HASH: self.recipe.hash(),
            keys.FINGERPRINT: self.fp,
            keys.FINGERPRINT_HASH: fingerprint_hash(self.fp),
            keys.SPACE: self.space.name,
            keys.OBJECTIVE: self.recipe.search.objective,
            **({keys.DEVICE_PRIORS: self.priors.to_dict()} if self.priors is not None else {}),
        }.items():
            self.study.set_user_attr(key, value)
        base = baseline_config(self.recipe, self.device, self.space)
        self.enqueue(base, keys.BASELINE, own=True)  # own trial: a nightly's previous best may be it
        reference = fp32_reference(base, self.recipe, self.device, self.space)
        if reference is not None:
            self.enqueue(reference, keys.FP32_REFERENCE)
        fp_hash = fingerprint_hash(self.fp)
        for config in similar_study_configs(self.url, self.recipe, fp_hash, exclude=self.name):
            self.enqueue(config, keys.WARM_START)
        self.study.set_user_attr(keys.RECIPE, self.recipe.to_dict())

    def enqueue(self, config: Config, role: str, own: bool = False) -> bool:
        """Queue `config` unless a trial of it exists; with `own`, unless one under `role` does."""
        if not self.space.contains(config, self.recipe.hardware.devices):
            return False
        if verdict(config, self.recipe, self.device).reason is not None:
            return False
        params, mine = trial_params(config), {keys.ROLE: role}
        if not (own and resume.queued_as(self.study, role, params)):
            self.study.enqueue_trial(params, user_attrs=mine, skip_if_exists=not own)
        return True

    # ---- the loop ---------------------------------------------------------------------------

    def refresh(self) -> list[FrozenTrial]:
        """One read of the study per loop turn: budget count, measured configs, best so far."""
        trials = self.study.get_trials(deepcopy=False)
        # A trial a dead or cancelled driver left does not count: its config runs again.
        self.finished = [
            t
            for t in trials
            if t.state.is_finished()
            and not (t.user_attrs.get(keys.DRIVER_DIED) or t.user_attrs.get(keys.CANCELLED))
        ]
        self.done = len(self.finished)
        self.measured = {  # by run key: configs that run the same program share one measurement
            stored_run_key(t.user_attrs[keys.CONFIG_KEY], self.recipe): t.number
            for t in self.finished
            if t.state in (TrialState.COMPLETE, TrialState.FAIL) and keys.STATUS in t.user_attrs
        }
        complete = [t for t in self.finished if t.state == TrialState.COMPLETE]
        self.calibration = study_calibration((t.user_attrs for t in complete), self.device)
        self.floor = oom_floor(
            (config_from_params(t.params), t.user_attrs.get(keys.ESTIMATED_PEAK_MEM_BYTES), t.number)
            for t in self.finished
            if t.user_attrs.get(keys.STATUS) == OOM
        )
        self._rank(trials)
        return trials

    def _rank(self, trials: list[FrozenTrial]) -> None:
        """The best so far by the one ranking (median over re-measurements, loss drift, memory),
        re-ranked only when a trial finished or a re-measurement arrived."""
        attrs = self.study.user_attrs
        mark = (self.done, len(attrs))
        if mark == self._ranked_at:
            return
        self._ranked_at = mark
        again = keys.per_trial(attrs, keys.REMEASURED_PREFIX)
        ranking = rank_trials([from_frozen(t) for t in trials if t.state.is_finished()], again, self.family)
        self.best = ranking.best.tokens_per_s if ranking.best else None
        self.best_number = ranking.best.trial if ranking.best else None
        self.run_noise = ranking.run_noise

    def _stagnant(self) -> bool:
        """Whether `patience` trials finished since the best (the ranking's: a faster trial whose
        loss drifted or whose memory is over the budget is not one) appeared."""
        if not self.budget.patience:
            return False
        since = sum(1 for t in self.finished if self.best_number is None or t.number > self.best_number)
        return since >= self.budget.patience

    def _next_grid_config(self, trials: list[FrozenTrial]) -> bool:
        """Grid search: queue the next untried config of the (seeded, shuffled) enumeration."""
        if self._grid is None:
            self._grid = list(self.space.configs(self.recipe, self.device))
            random.Random(self.budget.seed).shuffle(self._grid)
        tried = {stored_run_key(k, self.recipe) for t in trials if (k := t.user_attrs.get(keys.CONFIG_KEY))}
        while self._grid:
            config = self._grid.pop()
            if run_key(config, self.recipe) not in tried and self.enqueue(config, keys.GRID):
                return True
        return False

    def _stop_reason(self, trials: list[FrozenTrial], deadline: float) -> str | None:
        """Why no new trial may start now (None: one may)."""
        if self.done + len(self.pending) >= self.budget.trials:
            return "trials"
        if time.monotonic() > deadline:
            return "timeout"
        if self._stagnant():
            return "patience"
        waiting = any(t.state == TrialState.WAITING for t in trials)  # a retry, a smaller baseline
        if self.budget.sampler == "grid" and not (waiting or self._next_grid_config(trials)):
            return "grid exhausted"
        if getattr(self.study.sampler, "exhausted", False) and not waiting:
            return "space exhausted"  # the model sampler ranked the whole space; nothing queued
        return None

    def loop(self) -> str:
        """Run trials until a budget runs out; returns why it stopped."""
        deadline = time.monotonic() + self.budget.timeout_s if self.budget.timeout_s else math.inf
        self.deadline = deadline  # re-measurement starts no run after it either
        probe = self.spec(Config(dp=self.recipe.hardware.devices), "probe")
        while True:
            self.beat()
            trials = self.refresh()
            if self.hooks.should_stop():
                self.cancel_pending()
                return "cancelled"
            reason = self._stop_reason(trials, deadline)
            if reason is None:
                recover_dead_trials(self.study, trials, self.owner)
                if self.executor.free_slots(probe) > 0:
                    self._start_one()
                    continue
            if not self.pending:
                if reason is None:  # free_slots said 0 with nothing of ours running: someone else's
                    time.sleep(HEARTBEAT_INTERVAL_S)
                    continue
                return reason
            for result in self.executor.wait(timeout=HEARTBEAT_INTERVAL_S):
                self._finish(result)
            self._beat()

    def spec(self, config: Config, tag: str, est: int | None = None, budget: int | None = None) -> TrialSpec:
        return TrialSpec(
            recipe=self.recipe.to_dict(),
            config=config.to_dict(),
            family=self.family,
            # The run id keeps a rerun from finding an earlier run's files in the same folder.
            workdir=str(self.workdir / f"trial-{tag}-{self.owner['id'][:8]}"),
            timeout_s=self.recipe.measure.timeout_s,
            estimated_peak_mem_bytes=est,
            memory_budget_bytes=budget,
            seed=TRIAL_SEED,
            tag=tag,
        )

    def beat(self) -> None:
        """The study's driver heartbeat (`tuner.resume.claim_study`), at most once an interval."""
        if time.monotonic() - self._study_beat_at >= HEARTBEAT_INTERVAL_S:
            resume.beat_study(self.study, self.owner)
            self._study_beat_at = time.monotonic()

    def _beat(self) -> None:
        now = time.time()
        for p in self.pending.values():
            # A trial another driver already failed (it judged us dead) is finished: skip it.
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                self.storage.set_trial_system_attr(p.trial._trial_id, keys.HEARTBEAT, now)

    def event(self, event: str, **fields: Any) -> None:
        self.hooks.progress({"event": event, "done": self.done, "total": self.budget.trials, **fields})

    def _start_one(self) -> None:
        # A second's slack: Optuna stores the start as a naive local datetime, read back here.
        self.asking_since = time.time() - 1.0
        trial = self.study.ask()
        self.storage.set_trial_system_attr(trial._trial_id, keys.OWNER, self.owner)
        self.asking_since = None
        self.storage.set_trial_system_attr(trial._trial_id, keys.HEARTBEAT, time.time())
        role = trial.user_attrs.get(keys.ROLE)
        try:
            config = self.space.suggest(trial, self.recipe, self.device)
        except ValueError as err:  # an enqueued config that the (narrowed) space no longer has
            trial.set_user_attr(keys.ERROR, f"config outside the search space: {err}")
            self.study.tell(trial, state=TrialState.FAIL)
            return
        key = config.key()
        trial.set_user_attr(keys.CONFIG_KEY, key)
        self.event("trial_started", trial=trial.number, config=config.active_params(), role=role)
        v = verdict(config, self.recipe, self.device, self.calibration, self.floor)
        trial.set_user_attr(keys.ESTIMATOR_CALIBRATION, round(self.calibration, 4))
        duplicate = self._measured_twin(run_key(config, self.recipe))
        if v.reason is not None:
            self._prune(trial, config, v.reason)
            if v.estimated_peak_mem_bytes is not None:  # a memory prune: the baseline must still run
                self._smaller_baseline(role, config)
        elif duplicate is not None:
            trial.set_user_attr(keys.DUPLICATE_OF, duplicate)
            why = f"duplicate of trial {duplicate} (the same run for this model); its result is reused, no device run"
            self._prune(trial, config, why)
        else:
            if v.estimated_peak_mem_bytes is not None:
                trial.set_user_attr(keys.ESTIMATED_PEAK_MEM_BYTES, v.estimated_peak_mem_bytes)
            spec = self.spec(config, str(trial.number), v.estimated_peak_mem_bytes, v.memory_budget_bytes)
            if self.best and self.run_noise is not None:
                spec.slower_than_tokens_per_s = contention_line(self.best, self.run_noise)
                target = self.recipe.measure.target_ci
                if target is not None:
                    spec.behind_tokens_per_s = behind_line(self.best, self.run_noise)
                    spec.behind_ci = run_noise_ci(target, self.run_noise)
            self._submit(trial, config, spec, role)

    def _submit(self, trial: optuna.trial.Trial, config: Config, spec: TrialSpec, role: str | None) -> None:
        try:
            self.executor.submit(spec)
        except RuntimeError as err:
            # A shared cluster can take the slot `free_slots` offered before we submit. The
            # trial never ran: release it like a cancelled one and ask for its config again.
            trial.set_user_attr(keys.CANCELLED, f"not started: {err}")
            self.study.tell(trial, state=TrialState.FAIL)
            self.study.enqueue_trial(trial.params, user_attrs={keys.ROLE: role or keys.RETRY})
            time.sleep(HEARTBEAT_INTERVAL_S / 5)
            return
        self.pending[spec.tag] = Pending(trial, config, spec)

    def _measured_twin(self, key: str) -> int | None:
        """The trial that already measured (or is measuring) this config, if any."""
        for p in self.pending.values():
            if run_key(p.config, self.recipe) == key:
                return p.trial.number
        return self.measured.get(key)

    def _prune(self, trial: optuna.trial.Trial, config: Config, reason: str) -> None:
        trial.set_user_attr(keys.STATUS, PRUNED)
        trial.set_user_attr(keys.PRUNED_REASON, reason)
        self.study.tell(trial, state=TrialState.PRUNED)
        self.done += 1
        result = {keys.STATUS: PRUNED, keys.ERROR: reason}
        self.event(
            "trial_finished",
            trial=trial.number,
            config=config.active_params(),
            result=result,
            best_tokens_per_s=self.best,
        )

    def _finish(self, result: TrialResult) -> None:
        p = self.pending.pop(result.tag, None)
        if p is None:
            return
        try:
            ok = self._record(p, result)
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # another driver judged us dead and failed this trial; it is being retried
        self.done += 1
        self.measured[run_key(p.config, self.recipe)] = p.trial.number
        before = self.best
        if ok:
            self._rank(self.study.get_trials(deepcopy=False))  # a new trial may be the best
        if result.status == OOM:
            self._smaller_baseline(p.trial.user_attrs.get(keys.ROLE), p.config)
        fields = {"trial": p.trial.number, "config": p.config.active_params(), "result": result.public()}
        self.event("trial_finished", **fields, best_tokens_per_s=self.best)
        if self.best != before:
            self.event("new_best", **fields, best_tokens_per_s=self.best)

    def _record(self, p: Pending, result: TrialResult) -> bool:
        """Store the result with the trial and tell Optuna; True when it is a measured throughput."""
        trial = p.trial
        record = {k: getattr(result, k) for k in (*keys.RESULT_KEYS, *keys.EVIDENCE_KEYS)}
        record[keys.DEVICE_SECONDS] = (result.wall_s or 0.0) * p.config.world_size
        record[keys.MEASURE_STOP] = result.extra.get("stop_reason")
        for key, value in record.items():
            if value is not None:
                trial.set_user_attr(key, value)
        if not result.measured_ok:
            self.study.tell(trial, state=TrialState.FAIL)
            return False
        peak = result.budget_peak
        budget = p.spec.memory_budget_bytes
        if peak is not None and budget:
            # Feasible when <= 0: a config over the memory budget can never be the best.
            trial.set_constraint(keys.MEMORY_CONSTRAINT, (peak - budget) / budget)
        self.study.tell(trial, [result.tokens_per_s, float(peak or 0)] if self.multi else result.tokens_per_s)
        return True

    def _smaller_baseline(self, role: str | None, config: Config) -> None:
        """The baseline is the largest micro-batch that FITS: when the estimator's pick ran out of
        memory, try the next smaller one, as a careful user would (likewise its fp32 reference)."""
        if role not in (keys.BASELINE, keys.FP32_REFERENCE):
            return
        smaller = [m for m in self.space.domains["micro_batch_size"] or () if m < config.micro_batch_size]
        if smaller:
            self.enqueue(Config(**{**config.to_dict(), "micro_batch_size": max(smaller)}), role, own=True)

    def cancel_pending(self) -> None:
        """Stop running trials; their configs go back in the queue for the next run.

        Every RUNNING trial this driver owns is released, including one asked for but not yet
        submitted when Ctrl-C arrived, so a rerun in this same process finds none left behind.
        """
        self.executor.cancel()
        self.pending.clear()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            owner = t.system_attrs.get(keys.OWNER)
            # Ours, or the one our `study.ask` started when Ctrl-C came before we could sign it.
            asked = owner is None and self.asking_since is not None and t.datetime_start is not None
            if not asked and (owner or {}).get("id") != self.owner["id"]:
                continue
            if asked and t.datetime_start.timestamp() < self.asking_since:
                continue
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                self.storage.set_trial_user_attr(t._trial_id, keys.CANCELLED, True)
                self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                role = t.user_attrs.get(keys.ROLE) or keys.RETRY
                self.study.enqueue_trial(queued_params(t), user_attrs={keys.ROLE: role})
