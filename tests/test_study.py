"""The study loop's logic, with an in-test executor whose "measurement" is a formula of the config.

These are unit tests of the logic around the executor (ordering, pruning, duplicates, resume,
winner selection); tests/test_study_real.py runs real studies with the real LocalExecutor.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import optuna
import pytest
from budgets import budget_between
from optuna.trial import TrialState

from tuner.config import Config, infeasible_reasons
from tuner.devices import describe
from tuner.estimate import estimate, reserved_ratio_prior
from tuner.executors.base import Executor
from tuner.prune import OOM_MARGIN, verdict
from tuner.recipe import recipe_from_dict
from tuner.record.keys import HEARTBEAT as HEARTBEAT_KEY
from tuner.record.keys import OWNER as OWNER_KEY
from tuner.result import TrialResult, TrialSpec
from tuner.space import config_from_params, load_space, trial_params
from tuner.study import run_study
from tuner.summary import summarize

CPU = describe("cpu")


def make_recipe(name: str, overrides: dict | None = None, **sections) -> object:
    doc = {
        "name": name,
        "model": {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 2048},
        "train": {"global_batch_size": 16},
        "hardware": {"device": "cpu", "devices": 2},
        "search": {"space": "cpu", "overrides": overrides or {}, **sections.pop("search", {})},
        **sections,
    }
    return recipe_from_dict(doc)


# Every knob pinned to one value but dp=2; a test widens the knobs it is about.
NARROW = {
    "micro_batch_size": [4], "dp": [2], "tp": [1], "pp": [1], "dp_shard": ["ddp"], "bucket_mb": [25],
    "grad_compression": ["none"], "recompute": ["none"], "attention": ["flash"], "amp": ["O1"],
    "compile": ["none"], "optimizer_impl": ["foreach"], "loader_workers": [0], "cpu_affinity": ["none"],
}  # fmt: skip


def fake_tokens(c: Config) -> float:
    """A made-up but deterministic throughput: bigger batches, AMP and compile help."""
    tps = 1000.0 * c.micro_batch_size**0.5
    tps *= {"O0": 1.0, "O1": 1.3, "O2": 1.5}[c.amp]
    tps *= 1.2 if c.compile == "default" else 1.0
    tps *= 0.8 if c.recompute == "full" else 1.0
    return tps


class FakeExecutor(Executor):
    """Finishes each trial at the next `wait`; `slots` trials may run at once."""

    name = "fake"

    def __init__(self, slots: int = 1, drift: dict[str, float] | None = None, fail_on=None, again=None):
        self.slots = slots
        self.again = again or {}  # micro_batch_size -> speed factor when measured a second time
        self.drift = drift or {}  # amp level -> relative loss offset (a numerics bug)
        self.fail_on = fail_on or (lambda c: None)
        self.submitted: list[TrialSpec] = []
        self.max_in_flight = 0
        self._running: dict[str, TrialSpec] = {}

    def free_slots(self, spec: TrialSpec) -> int:
        return self.slots - len(self._running)

    def submit(self, spec: TrialSpec) -> None:
        assert self.free_slots(spec) > 0, "submitted without a free slot"
        self.submitted.append(spec)
        self._running[spec.tag] = spec
        self.max_in_flight = max(self.max_in_flight, len(self._running))

    def wait(self, timeout: float | None = None) -> list[TrialResult]:
        out = []
        for tag, spec in list(self._running.items()):
            del self._running[tag]
            c = Config(**spec.config)
            status = self.fail_on(c)
            if status:
                out.append(TrialResult(status=status, error="boom", wall_s=1.0, tag=tag))
                continue
            tps = fake_tokens(c) * (self.again.get(c.micro_batch_size, 1.0) if tag.startswith("re") else 1.0)
            off = 1 + self.drift.get(c.amp, 0.0)
            out.append(
                TrialResult(
                    status="ok",
                    tokens_per_s=tps,
                    step_time_s=1.0 / tps,
                    step_time_spread=0.01,
                    step_time_ci=0.02,
                    peak_mem_reserved_bytes=1000 * c.micro_batch_size,
                    losses=[7.6 * off, 7.5 * off, 7.4 * off],
                    wall_s=2.0,
                    measured_s=0.5,
                    tag=tag,
                )
            )
        return out

    def running(self) -> list[str]:
        return list(self._running)

    def cancel(self) -> None:
        self._running.clear()


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path}/study.db"


@pytest.fixture
def tune(url, tmp_path):
    """run_study with this test's database and folder; random sampling and no re-measure unless asked."""

    def _tune(recipe, executor=None, **kw):
        kw = {"sampler": "random", "remeasure_top": 0, **kw}
        return run_study(recipe, storage_url=url, executor=executor or FakeExecutor(), workdir=tmp_path, **kw)

    return _tune


def trials_of(summary, url):
    return optuna.load_study(study_name=summary.study_name, storage=url).get_trials(deepcopy=False)


@pytest.mark.parametrize("fast_bf16", [True, False], ids=["cpu-with-fast-bf16", "cpu-without"])
def test_baseline_then_reference_run_first_and_nothing_infeasible_reaches_the_executor(tune, url, fast_bf16):
    """The baseline is what a careful user picks on this device: bf16 autocast where bf16 is fast
    (then an fp32 copy of it is the loss reference), fp32 where it is not (its own reference)."""
    import dataclasses

    from tuner.fingerprint import Described, fingerprint

    device = dataclasses.replace(CPU, fast_dtypes=("bf16",) if fast_bf16 else ())
    recipe = make_recipe(f"order-{fast_bf16}")
    ex = FakeExecutor()
    # Its trials run on this CPU with or without fast bf16, as the executor describes it.
    ex.describe = lambda requested: Described("cpu", device, fingerprint("cpu", device))
    summary = tune(recipe, ex, trials=16)  # enough that the sampler meets infeasible configs
    trials = trials_of(summary, url)
    assert trials[0].user_attrs["role"] == "baseline"
    base = config_from_params(trials[0].params)
    # Largest micro-batch that divides the global batch over dp=2, flash, no recompute.
    got = (base.micro_batch_size, base.dp, base.amp, base.attention, base.recompute)
    assert got == (8, 2, "O1" if fast_bf16 else "O0", "flash", "none")
    if fast_bf16:
        assert trials[1].user_attrs["role"] == "fp32_reference"
        assert config_from_params(trials[1].params).amp == "O0"
    else:
        assert "fp32_reference" not in {t.user_attrs.get("role") for t in trials}
    for spec in ex.submitted:
        assert not infeasible_reasons(Config(**spec.config), recipe, CPU)
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    assert pruned and all(t.user_attrs["pruned_reason"] for t in pruned)
    measured = [Config(**s.config).key() for s in ex.submitted]
    assert len(measured) == len(set(measured)), "a config reached the device twice"
    assert summary.n_trials == 16 and sum(summary.counts.values()) == 16
    assert summary.best.tokens_per_s == max(e.tokens_per_s for e in summary.top_k)
    assert summary.baseline.trial == 0 and summary.speedup >= 1.0


def test_conditional_knobs_are_absent_from_params_when_they_do_not_apply(tune, url):
    summary = tune(make_recipe("cond"), trials=8)
    for t in trials_of(summary, url):
        p = t.params
        assert ("pp_schedule" in p) == (p["pp"] > 1)
        assert ("dp_shard" in p) == (p["dp"] > 1)
        assert ("bucket_mb" in p) == ("grad_compression" in p) == (p["dp"] > 1 and p.get("dp_shard") == "ddp")
        assert ("amp_dtype" in p) == (p["amp"] != "O0")


def test_predicted_oom_configs_are_pruned_before_the_executor(tune, url):
    recipe = make_recipe("oom", overrides={**NARROW, "micro_batch_size": [4, 8]})
    small, big = (Config(micro_batch_size=m, dp=2, amp="O1", attention="flash") for m in (4, 8))
    hardware = {
        "device": "cpu",
        "devices": 2,
        "memory_budget_gb": budget_between(recipe, small, big, fits_under=(1 + OOM_MARGIN) * 0.97),
    }
    recipe = recipe.model_copy(update={"hardware": recipe.hardware.model_copy(update=hardware)})
    ex = FakeExecutor()
    summary = tune(recipe, ex, trials=6)
    assert ex.submitted and all(verdict(Config(**s.config), recipe, CPU).reason is None for s in ex.submitted)
    assert all(Config(**s.config).micro_batch_size == 4 for s in ex.submitted)
    reasons = [t.user_attrs.get("pruned_reason", "") for t in trials_of(summary, url)]
    assert any(r.startswith("predicted out of memory") for r in reasons)


def test_loss_drift_beyond_the_amp_tolerance_cannot_win(tune):
    # O2 is the fastest in the fake, but its losses are 5% off the fp32 reference.
    recipe = make_recipe("drift", overrides={**NARROW, "amp": ["O0", "O1", "O2"]})
    summary = tune(recipe, FakeExecutor(drift={"O2": 0.05}), trials=6)
    assert [e.config["amp"] for e in summary.flagged] == ["O2"]
    assert "loss drifts 5.0% from the fp32 reference" in summary.flagged[0].flag
    assert summary.best.config["amp"] == "O1"


def test_remeasured_top_configs_keep_one_complete_trial_each(tune, url):
    ex = FakeExecutor()
    recipe = make_recipe("again", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]})
    summary = tune(recipe, ex, trials=6, remeasure_top=2)
    again = [Config(**s.config).micro_batch_size for s in ex.submitted if s.tag.startswith("remeasure")]
    # Each of the top 2 once; the best (8) is at least 41% faster than the runner-up, far outside
    # their intervals, so no second round is spent on them.
    assert len(again) == 2 and again[0] == 8 != again[1]
    assert len(summary.best.remeasured_tokens_per_s) == 1 and not summary.tie
    complete = [t for t in trials_of(summary, url) if t.state == TrialState.COMPLETE]
    assert len({t.user_attrs["config_key"] for t in complete}) == len(complete)
    # Rerunning with the budget spent measures nothing new.
    ex2 = FakeExecutor()
    tune(recipe, ex2, trials=6, remeasure_top=2)
    assert ex2.submitted == []


def test_a_remeasurement_that_reports_no_finite_throughput_adds_no_value(tune, url):
    """A re-measurement reporting NaN tokens/s was kept as a run (the trial loop refused the same
    result): the winner's median came out NaN."""
    recipe = make_recipe("nan-again", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]})
    summary = tune(recipe, FakeExecutor(again={8: float("nan")}), trials=6, remeasure_top=2)
    assert summary.best.config["micro_batch_size"] == 8 and summary.best.remeasured_tokens_per_s == []
    assert summary.best.tokens_per_s == fake_tokens(Config(micro_batch_size=8, dp=2, amp="O1"))


def test_a_remeasurement_whose_slot_was_taken_waits_for_the_next_one(tune):
    """A shared cluster can take the slot `free_slots` offered before the submit: the trial loop
    asks again, and so must re-measurement (it failed the whole study after its search)."""

    class Racing(FakeExecutor):
        refused = 0

        def submit(self, spec):
            if spec.tag.startswith("remeasure") and not self.refused:
                self.refused = 1
                raise RuntimeError(f"no free CPU slot for trial {spec.tag!r}; ask free_slots() first")
            super().submit(spec)

    ex = Racing()
    recipe = make_recipe("race", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]})
    summary = tune(recipe, ex, trials=6, remeasure_top=2)
    assert ex.refused and len(summary.best.remeasured_tokens_per_s) == 1


def test_no_remeasurement_starts_after_the_time_budget(tune):
    """`search.timeout_min` (and a service's cap on it) bounds the whole study: a study that ends by
    timeout starts no re-measurement after it (each may take up to `measure.timeout_s`)."""

    class Slow(FakeExecutor):
        def wait(self, timeout=None):
            if self._running:
                time.sleep(0.5)
            return super().wait(timeout)

    ex = Slow()
    recipe = make_recipe("late", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]})
    events = []
    tune(recipe, ex, trials=100, timeout_s=1.0, remeasure_top=3, progress=events.append)
    assert events[-1]["reason"] == "timeout"
    assert not [s for s in ex.submitted if s.tag.startswith("remeasure")]


def test_each_new_trial_is_told_the_studys_contention_line_and_a_remeasurement_none(tune, url):
    ex = FakeExecutor()
    recipe = make_recipe("contention", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]})
    summary = tune(recipe, ex, trials=5, remeasure_top=2)
    firsts = [s for s in ex.submitted if not s.tag.startswith("remeasure")]
    assert firsts[0].slower_than_tokens_per_s is None  # nothing is measured yet
    assert firsts[0].behind_tokens_per_s is None and firsts[0].behind_ci is None
    best = 0.0
    for spec in firsts:
        if best:
            # Out of contention: further below the best than the tie rule's interval for two
            # single runs on a CPU (run-to-run noise 5%: sqrt(2) x 1.96 x 5% = 13.9%).
            assert spec.slower_than_tokens_per_s == pytest.approx(best * (1 - 2**0.5 * 1.96 * 0.05), rel=1e-3)
            # Clearly behind: more than the CPU's run-to-run noise (5%, 95%: 9.8%) below the best;
            # there a 5% step interval is enough.
            assert spec.behind_tokens_per_s == pytest.approx(best * (1 - 1.96 * 0.05), rel=1e-3)
            assert spec.behind_ci == pytest.approx(0.05)
        best = max(best, fake_tokens(Config(**spec.config)))
    again = [s for s in ex.submitted if s.tag.startswith("remeasure")]
    # Measured in full, to the run-to-run noise's interval.
    assert again and all(s.slower_than_tokens_per_s is None and s.behind_tokens_per_s is None for s in again)
    assert summary.best is not None


def test_a_winner_that_was_lucky_loses_its_place_and_the_next_one_is_remeasured(tune):
    # micro_batch_size 8 measures fast once, then at a fifth of that: the median drops below 4's.
    ex = FakeExecutor(again={8: 0.2})
    recipe = make_recipe("lucky", overrides={**NARROW, "micro_batch_size": [2, 4, 8]})
    summary = tune(recipe, ex, trials=3, sampler="grid", remeasure_top=1)
    again = [Config(**s.config).micro_batch_size for s in ex.submitted if s.tag.startswith("remeasure")]
    # 8 once (it drops below 4), then the new best 4 once; the two are still within each other's
    # intervals, so both are measured a second time, in turns.
    assert again == [8, 4, 4, 8]
    assert summary.best.config["micro_batch_size"] == 4
    assert len(summary.best.remeasured_tokens_per_s) == 2


def test_a_second_round_re_measures_only_the_configs_tied_with_the_best(tune):
    from tuner.record.ranking import RUN_NOISE_PRIOR

    # Two equally fast configs (loader_workers does not change the fake's speed) and slower ones.
    ex = FakeExecutor()
    recipe = make_recipe("rounds", overrides={**NARROW, "micro_batch_size": [1, 8], "loader_workers": [0, 1]})
    summary = tune(recipe, ex, trials=4, sampler="grid", remeasure_top=3)
    again = [s for s in ex.submitted if s.tag.startswith("remeasure")]
    configs = [(Config(**s.config).micro_batch_size, Config(**s.config).loader_workers) for s in again]
    assert len(configs) == 5 and configs[:2] == configs[3:] and {c[0] for c in configs[:2]} == {8}
    assert configs[2][0] == 1  # the third of the top, 2.8x slower: once, in the first round only
    assert summary.tie and len(summary.best.remeasured_tokens_per_s) == 2
    # Re-measurements are measured to the run-to-run noise (the CPU prior before any came back),
    # not to the recipe's 3%; first measurements keep the recipe's target.
    assert again[0].target_ci == pytest.approx(RUN_NOISE_PRIOR["cpu"])
    assert all(s.target_ci is None for s in ex.submitted if not s.tag.startswith("remeasure"))


def test_equal_configs_are_reported_as_a_tie(tune):
    # loader_workers does not change the fake's speed: the two configs are equally fast.
    recipe = make_recipe("tie", overrides={**NARROW, "loader_workers": [0, 1]})
    summary = tune(recipe, trials=10, sampler="grid")
    assert summary.tie and summary.runner_up is not None
    assert summary.best.tokens_per_s == summary.runner_up.tokens_per_s


def test_grid_sampler_measures_each_config_of_a_narrow_space_once(tune):
    recipe = make_recipe("grid", overrides={**NARROW, "micro_batch_size": [2, 4], "amp": ["O0", "O1"]})
    ex = FakeExecutor()
    summary = tune(recipe, ex, trials=50, sampler="grid")
    assert summary.counts == {"ok": 4}
    assert len(ex.submitted) == 4


def test_recompute_shares_that_recompute_the_same_blocks_are_measured_once(tune, url):
    # 4 layers at pp=2: two blocks a stage, so 0.25 and 0.5 recompute one block, 0.75 and 1.0 two.
    split = {"dp": [1], "pp": [2], "pp_schedule": ["1f1b"], "recompute": ["full"],
             "recompute_layers": [0.25, 0.5, 0.75, 1.0]}  # fmt: skip
    recipe = make_recipe("runkey", overrides={**NARROW, **split})
    ex = FakeExecutor()
    summary = tune(recipe, ex, trials=50, sampler="grid")
    assert summary.counts == {"ok": 2}  # the grid does not even ask for the other two
    assert sorted(Config(**s.config).recompute_layers for s in ex.submitted) in ([0.25, 0.75], [0.25, 1.0],
                                                                                [0.5, 0.75], [0.5, 1.0])  # fmt: skip
    # A sampler that proposes one anyway gets the measured twin's result, not a device run.
    ex = FakeExecutor()
    summary = tune(make_recipe("runkey-random", overrides={**NARROW, **split}), ex, trials=8, seed=1)
    assert len(ex.submitted) == 2 and summary.counts["ok"] == 2 and summary.counts["duplicate"] == 6
    dups = [t for t in trials_of(summary, url) if "duplicate_of" in t.user_attrs]
    assert all("the same run for this model" in t.user_attrs["pruned_reason"] for t in dups)


def test_concurrent_executor_slots_are_all_used(tune):
    ex = FakeExecutor(slots=3)
    tune(make_recipe("slots", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]}), ex, trials=6)
    assert ex.max_in_flight == 3


def test_patience_and_should_stop_end_the_study_early(tune):
    recipe = make_recipe("patience", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]})
    assert tune(recipe, trials=100, patience=3).n_trials < 10
    events = []
    summary = tune(
        make_recipe("stop"),
        trials=100,
        progress=events.append,
        should_stop=lambda: sum(e["event"] == "trial_finished" for e in events) >= 3,
    )
    assert 3 <= summary.n_trials < 6
    assert {"trial_started", "trial_finished", "new_best", "done"} <= {e["event"] for e in events}
    assert all(e["total"] == 100 for e in events)


def test_patience_counts_from_the_rankings_best_not_a_faster_trial_it_refuses():
    """A fast config whose loss drifted 50% (it can never win) was taken as the best, so three
    trials that each beat the real best still stopped the study for want of progress."""
    from types import SimpleNamespace

    from optuna.distributions import CategoricalDistribution
    from optuna.trial import create_trial

    from tuner.study.driver import Driver

    def trial(number: int, amp: str, tps: float, loss: float):
        t = create_trial(
            state=TrialState.COMPLETE, value=tps, params={"amp": amp},
            distributions={"amp": CategoricalDistribution(["O0", "O1"])},
            user_attrs={"status": "ok", "tokens_per_s": tps, "losses": [loss, loss]},
        )  # fmt: skip
        t.number = number
        return t

    trials = [trial(0, "O0", 100.0, 1.0), trial(1, "O1", 300.0, 1.5)]
    trials += [trial(n, "O0", tps, 1.0) for n, tps in ((2, 150.0), (3, 160.0), (4, 170.0))]
    driver = SimpleNamespace(
        budget=SimpleNamespace(patience=3), finished=trials, done=len(trials), _ranked_at=None,
        study=SimpleNamespace(user_attrs={}), family="cpu",
    )  # fmt: skip
    Driver._rank(driver, trials)
    assert (driver.best_number, driver.best) == (4, 170.0)
    assert not Driver._stagnant(driver)
    driver.finished = trials + [trial(n, "O0", 120.0, 1.0) for n in (5, 6, 7)]
    assert Driver._stagnant(driver)


def test_failed_trials_keep_their_error_and_the_loop_goes_on(tune):
    ex = FakeExecutor(fail_on=lambda c: "oom" if c.micro_batch_size >= 4 else None)
    summary = tune(make_recipe("fail", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]}), ex, trials=6)
    assert summary.counts.get("oom", 0) >= 1 and summary.counts.get("ok", 0) >= 1
    assert summary.best.config["micro_batch_size"] < 4
    assert (
        summary.device_seconds["oom"] > 0 and summary.device_seconds["total"] >= summary.device_seconds["oom"]
    )


def test_multi_objective_gives_a_pareto_front(tune):
    recipe = make_recipe(
        "pareto",
        search={"objective": "throughput_memory"},
        overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]},
    )
    summary = tune(recipe, trials=6, sampler="tpe")
    assert summary.study_name.endswith("-pareto")
    assert summary.pareto and summary.best.trial in {e.trial for e in summary.pareto}


def test_warm_start_enqueues_the_best_configs_of_the_most_similar_study(tune, url):
    first = tune(
        make_recipe("warm-a", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8], "amp": ["O0", "O1"]}),
        trials=6,
    )
    bigger = make_recipe(
        "warm-b", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8], "amp": ["O0", "O1"]}
    )
    bigger = bigger.model_copy(update={"model": bigger.model.model_copy(update={"layers": 8})})
    second = tune(bigger, trials=4)
    warm = [t for t in trials_of(second, url) if t.user_attrs.get("role") == "warm_start"]
    # The earlier best is the new study's baseline already; the runners-up come next.
    assert warm and config_from_params(warm[0].params).active_params() in [e.config for e in first.top_k]


def test_running_trial_of_a_dead_driver_is_failed_and_its_config_retried(tune, url):
    recipe = make_recipe("resume", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]})
    first = tune(recipe, trials=3)
    # A driver that asked for a trial and died (its pid no longer exists) before telling it.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    study = optuna.load_study(study_name=first.study_name, storage=url)
    lost = Config(micro_batch_size=1, dp=2, amp="O1", attention="flash")
    study.enqueue_trial(trial_params(lost))
    orphan = study.ask()
    load_space("cpu").narrow(recipe.search.overrides).suggest(orphan, recipe, CPU)
    owner = {"host": socket.gethostname(), "pid": dead.pid, "id": "gone"}
    study._storage.set_trial_system_attr(orphan._trial_id, OWNER_KEY, owner)
    study._storage.set_trial_system_attr(orphan._trial_id, HEARTBEAT_KEY, time.time())

    summary = tune(recipe, trials=4)
    trials = trials_of(summary, url)
    assert trials[orphan.number].state == TrialState.FAIL and trials[orphan.number].user_attrs["driver_died"]
    retried = [t for t in trials if t.user_attrs.get("retry_of") == orphan.number]
    assert len(retried) == 1 and retried[0].state == TrialState.COMPLETE
    assert config_from_params(retried[0].params).key() == lost.key()
    # The dead driver's trial does not count against the budget of 4.
    assert len([t for t in trials if t.state != TrialState.FAIL]) == 4
    assert summarize(summary.study_name, url).counts["failed"] == 1


def test_ctrl_c_mid_study_then_rerun_finishes_the_budget_without_repeats(tune, url):
    recipe = make_recipe("ctrl-c", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]})

    def interrupt(event):
        if event["event"] == "trial_started" and event["trial"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune(recipe, trials=5, progress=interrupt)
    study = optuna.load_study(study_name=study_name_of(recipe), storage=url)
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    summary = tune(recipe, trials=5)
    trials = trials_of(summary, url)
    cancelled = [t for t in trials if t.user_attrs.get("cancelled")]
    assert [t.number for t in cancelled] == [2]
    counted = [t for t in trials if t.state != TrialState.FAIL]
    assert len(counted) == 5
    complete = [t for t in counted if t.state == TrialState.COMPLETE]
    assert len({t.user_attrs["config_key"] for t in complete}) == len(complete)
    # The interrupted config ran on the rerun.
    assert any(config_from_params(t.params) == config_from_params(cancelled[0].params) for t in complete)


@pytest.mark.parametrize("how", ["ctrl-c", "kill -9"])
def test_a_queued_baseline_interrupted_inside_ask_runs_its_own_config_on_the_rerun(
    tune, url, monkeypatch, how
):
    """`study.ask` starts the queued baseline before the sampler runs (a model sampler refits
    first, a second or more) and before the driver signs it: interrupted there, the baseline must
    still run as itself on the rerun, not as whatever the sampler picks under its label."""
    from tuner.baseline import baseline_config
    from tuner.study import budget, driver

    recipe = make_recipe(
        f"ask-{how}", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8], "amp": ["O0", "O2"]}
    )
    base = baseline_config(recipe, CPU, load_space("cpu").narrow(recipe.search.overrides))
    before_trial = optuna.samplers.RandomSampler.before_trial

    def stop_in_ask(self, study, trial):
        before_trial(self, study, trial)
        raise KeyboardInterrupt

    monkeypatch.setattr(optuna.samplers.RandomSampler, "before_trial", stop_in_ask)
    if how == "ctrl-c":
        with pytest.raises(KeyboardInterrupt):
            tune(recipe, trials=4)
    else:  # the driver dies with the trial started and unsigned: its heartbeat is never written
        d = driver.Driver(recipe, url, FakeExecutor(), budget.Budget.for_recipe(recipe, sampler="random"),
                          budget.Hooks(), workdir=None)  # fmt: skip
        d.open([])
        with pytest.raises(KeyboardInterrupt):
            d.study.ask()
        monkeypatch.setattr("tuner.resume.owner_alive", lambda *a: False)
    monkeypatch.setattr(optuna.samplers.RandomSampler, "before_trial", before_trial)
    summary = tune(recipe, trials=4)
    assert summary.baseline is not None and summary.baseline.config == base.active_params()
    labelled = [t for t in trials_of(summary, url) if t.user_attrs.get("role") == "baseline" and t.params]
    assert {config_from_params(t.params).key() for t in labelled} == {base.key()}


def test_a_study_interrupted_while_it_is_first_set_up_queues_its_baseline_on_the_rerun(tune, monkeypatch):
    from tuner.study.driver import Driver

    recipe = make_recipe("first-open", overrides={**NARROW, "micro_batch_size": [2, 4, 8]})
    enqueue = Driver.enqueue

    def interrupted(self, config, role, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(Driver, "enqueue", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tune(recipe, trials=3)
    monkeypatch.setattr(Driver, "enqueue", enqueue)
    summary = tune(recipe, trials=3)
    assert summary.baseline is not None and summary.speedup is not None


def study_name_of(recipe) -> str:
    from tuner.fingerprint import fingerprint
    from tuner.study import study_name

    return study_name(recipe, fingerprint("cpu"))


class RacingExecutor(FakeExecutor):
    """Offers a slot, then refuses the first submit: another driver on the cluster took it."""

    def __init__(self):
        super().__init__()
        self.refused = 0

    def submit(self, spec: TrialSpec) -> None:
        if self.refused == 0:
            self.refused += 1
            raise RuntimeError("no free CPU slot")
        super().submit(spec)


def test_a_slot_taken_between_free_slots_and_submit_requeues_the_config(tune, url):
    ex = RacingExecutor()
    summary = tune(make_recipe("race"), ex, trials=4)
    trials = trials_of(summary, url)
    refused = [t for t in trials if str(t.user_attrs.get("cancelled", "")).startswith("not started")]
    assert len(refused) == 1 and ex.refused == 1
    # The refused config (the baseline, asked first) still runs, and the budget counts 4 real trials.
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert any(t.params == refused[0].params for t in complete)
    assert len([t for t in trials if t.state.is_finished() and not t.user_attrs.get("cancelled")]) == 4


class PeakyExecutor(FakeExecutor):
    """Measures peaks `ratio` times what the estimator predicted (the CPU estimator's usual gap)."""

    def __init__(self, ratio: float):
        super().__init__()
        self.ratio = ratio

    def wait(self, timeout: float | None = None) -> list[TrialResult]:
        specs = dict(self._running)
        out = super().wait(timeout)
        for r in out:
            peak = int(specs[r.tag].estimated_peak_mem_bytes * self.ratio)
            r.peak_mem_allocated_bytes = r.peak_mem_reserved_bytes = peak
        return out


def test_measured_peaks_calibrate_the_oom_check(tune, url):
    recipe = make_recipe(
        "calibrate", overrides={**NARROW, "micro_batch_size": [1, 2, 8], "attention": ["flash", "math"]}
    )
    big = Config(micro_batch_size=8, dp=2, amp="O1", attention="flash")
    # Micro-batch 8's estimate, scaled by the CPU's reserved/allocated prior as a study starts,
    # sits just inside the budget's margin: it would run.
    prior = reserved_ratio_prior(CPU.family)
    budget = estimate(recipe, big, CPU).peak_mem_bytes * prior / (1 + OOM_MARGIN) * 1.02
    hardware = {"device": "cpu", "devices": 2, "memory_budget_gb": budget / 2**30}
    recipe = recipe.model_copy(update={"hardware": recipe.hardware.model_copy(update=hardware)})
    assert verdict(big, recipe, CPU).reason is None
    # 1.4: the CPU estimate carries a fixed 74 MiB for what no formula sees (amp=O1), so the
    # micro-batches' estimates lie close together and a larger factor would push mbs 2 over too.
    ex = PeakyExecutor(ratio=1.4)
    summary = tune(recipe, ex, trials=10)
    trials = trials_of(summary, url)
    calibrated = [
        t for t in trials if "(estimate x1.40, the measured" in t.user_attrs.get("pruned_reason", "")
    ]
    assert calibrated, [t.user_attrs.get("pruned_reason") for t in trials]
    assert all(t.params["micro_batch_size"] == 8 for t in calibrated)
    assert max(t.user_attrs.get("estimator_calibration", 1) for t in trials) == pytest.approx(1.4, rel=0.01)
    # Micro-batch 8 ran, if at all, only before three measured trials set the ratio.
    assert 8 not in [Config(**s.config).micro_batch_size for s in ex.submitted][3:]


def test_calibration_factor_is_the_median_ratio_once_enough_trials_ran():
    from tuner.prune import calibration_factor

    assert calibration_factor([(120, 100), (130, 100)]) == 1.0  # too few to trust
    assert calibration_factor([(120, 100)], prior=1.25) == 1.25  # the device's prior until then
    assert calibration_factor([(120, 100), (130, 100), (200, 100)]) == pytest.approx(1.3)
    assert calibration_factor([(900, 100)] * 3) == 2.0  # bounded
    assert calibration_factor([(0, 100), (None, 100), (120, 0)] * 2) == 1.0  # nothing measured


def test_a_baseline_that_runs_out_of_memory_falls_back_to_the_next_smaller_micro_batch(tune, url):
    # The estimator's largest micro-batch (8) fits on paper but runs out of memory on the device.
    ex = FakeExecutor(fail_on=lambda c: "oom" if c.micro_batch_size >= 8 else None)
    recipe = make_recipe("fallback", overrides={**NARROW, "micro_batch_size": [2, 4, 8]})
    summary = tune(recipe, ex, trials=5)
    baselines = [t for t in trials_of(summary, url) if t.user_attrs.get("role") == "baseline"]
    assert [t.params["micro_batch_size"] for t in baselines][:2] == [8, 4]
    assert summary.baseline.config["micro_batch_size"] == 4
    assert summary.speedup is not None


def test_a_baseline_fallback_that_another_trial_measured_still_names_the_baseline(tune, url):
    """The baseline ran out of memory while a trial beside it (two slots) measured the next
    smaller micro-batch: the fallback baseline was not queued (Optuna saw that config queued
    already), and the study reported no baseline and no speedup for a config it had measured."""
    from tuner.baseline import baseline_config

    ex = FakeExecutor(slots=2, fail_on=lambda c: "oom" if c.micro_batch_size >= 8 else None)
    recipe = make_recipe("fallback-taken", overrides={**NARROW, "micro_batch_size": [2, 4, 8]})
    base = baseline_config(recipe, CPU, load_space("cpu").narrow(recipe.search.overrides))
    four = Config(**{**base.to_dict(), "micro_batch_size": 4})
    assert base.micro_batch_size == 8
    summary = tune(recipe, ex, trials=4, enqueue=[four])
    assert summary.baseline is not None and summary.baseline.config == four.active_params()
    assert summary.speedup == pytest.approx(summary.best.tokens_per_s / fake_tokens(four))
    # Measured once: the fallback baseline reuses the enqueued trial's run as its duplicate.
    assert [Config(**s.config).micro_batch_size for s in ex.submitted].count(4) == 1
    fallback = [t for t in trials_of(summary, url) if t.user_attrs.get("role") == "baseline"][1]
    assert fallback.user_attrs["duplicate_of"] == summary.baseline.trial


def test_a_baseline_config_queued_before_the_study_opened_is_still_its_baseline(tune, url):
    """The nightly queues last night's best before `run_study` opens the study. Where that was the
    baseline's config, the baseline was not queued (Optuna saw the config queued already): the
    study had no baseline and reported no speedup."""
    from tuner.baseline import baseline_config
    from tuner.nightly.tuners import _enqueue_first

    recipe = make_recipe("queued-first", overrides={**NARROW, "micro_batch_size": [2, 4, 8]})
    base = baseline_config(recipe, CPU, load_space("cpu").narrow(recipe.search.overrides))
    _enqueue_first(recipe, study_name_of(recipe), [base.active_params()], url)
    ex = FakeExecutor()
    summary = tune(recipe, ex, trials=3)
    assert summary.baseline is not None and summary.baseline.config == base.active_params()
    assert summary.speedup == pytest.approx(summary.best.tokens_per_s / fake_tokens(base))
    # Measured once, as last night's best: the baseline reuses that run as its duplicate.
    assert [Config(**s.config).key() for s in ex.submitted].count(base.key()) == 1


def test_a_study_tuned_further_after_its_build_names_its_new_best_in_every_view(tune, url):
    """`tuner build`, then more trials that find a faster config: the study's REST and dashboard
    views must name the new best as `tuner show` does, not the trial the old build was made of."""
    from api.routes.studies import study_verdict
    from tuner.build.base import BuildRecord
    from tuner.build.register import register
    from tuner.db import session_scope
    from tuner.record.reader import read_study

    recipe = make_recipe(
        "rebuilt", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8], "amp": ["O0", "O1", "O2"]}
    )
    first = tune(recipe, trials=2)
    register(url, BuildRecord(path="/x.tar.gz", sha256="0" * 64, size_bytes=1, study_name=first.study_name,
                              trial_number=first.best.trial, compiled_tokens_per_s=None, eager_tokens_per_s=None,
                              compile_cold_s=None, compile_warm_s=None))  # fmt: skip
    with session_scope(url) as s:
        assert study_verdict(s, read_study(s, first.study_name)).source == "build"
    faster = Config(micro_batch_size=8, dp=2, amp="O2", attention="flash")
    later = tune(recipe, trials=4, enqueue=[faster])
    assert later.best.trial != first.best.trial
    with session_scope(url) as s:
        view = study_verdict(s, read_study(s, later.study_name))
    assert (view.best.trial, view.source) == (later.best.trial, "ranking")
