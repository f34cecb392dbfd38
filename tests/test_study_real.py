"""Real studies: the real LocalExecutor runs a tiny GPT on 2 gloo ranks. One study goes to
PostgreSQL and another process reads it back; one `tuner tune` on SQLite is killed with SIGKILL
mid-study and resumes cleanly.

Each device run costs 10-40 s on 2 shared cores, so every test keeps to one or two of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import optuna
import pytest
import yaml
from budgets import budget_between
from optuna.trial import TrialState

from tuner.config import Config
from tuner.devices import describe
from tuner.executors.local import LocalExecutor
from tuner.prune import verdict
from tuner.recipe import recipe_from_dict
from tuner.record.keys import OWNER as OWNER_KEY
from tuner.study import run_study
from tuner.summary import summarize

pytestmark = pytest.mark.slow

PG_URL = os.environ.get("TUNER_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
CPU = describe("cpu")

# Everything pinned but the micro-batch, so the handful of trials is predictable.
NARROW = {
    "dp": [2], "tp": [1], "pp": [1], "dp_shard": ["ddp"], "bucket_mb": [25], "grad_compression": ["none"],
    "recompute": ["none"], "attention": ["flash"], "amp": ["O1"], "compile": ["none"],
    "optimizer_impl": ["foreach"], "loader_workers": [0], "cpu_affinity": ["none"],
}  # fmt: skip


def recipe_doc(name: str, micro_batch_sizes: list[int], budget_gb: float | None, seed: int) -> dict:
    return {
        "name": f"{name}-{uuid.uuid4().hex[:8]}",  # a study of its own in a shared database
        "model": {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 256, "vocab": 4096},
        "train": {"global_batch_size": 32},
        "hardware": {"device": "cpu", "devices": 2, "memory_budget_gb": budget_gb},
        "search": {
            "sampler": "random",
            "seed": seed,
            "overrides": {**NARROW, "micro_batch_size": micro_batch_sizes},
        },
        "measure": {"warmup_steps": 1, "steps": 2},
    }


class CountingExecutor(LocalExecutor):
    """The real LocalExecutor, remembering every spec that reached it."""

    def __init__(self):
        super().__init__()
        self.submitted = []

    def submit(self, spec):
        self.submitted.append(spec)
        super().submit(spec)


@pytest.mark.postgres
def test_real_study_on_postgres_prunes_predicted_oom_and_another_process_reads_it(tmp_path):
    url = PG_URL
    # A budget the estimator says micro_batch_size 8 stays under and 16 exceeds. Seed 0 samples
    # 16 (pruned) and 8 again (a duplicate), so one device run does it all.
    doc = recipe_doc("real", [8, 16], None, seed=0)
    small, big = (Config(micro_batch_size=m, dp=2, amp="O1", attention="flash") for m in (8, 16))
    doc["hardware"]["memory_budget_gb"] = budget_between(recipe_from_dict(doc), small, big, fits_under=0.8)
    recipe = recipe_from_dict(doc)
    ex = CountingExecutor()
    try:
        with ex:
            summary = run_study(
                recipe, storage_url=url, executor=ex, trials=3, remeasure_top=0, workdir=tmp_path
            )
        assert len(ex.submitted) == 1
        assert all(verdict(Config(**s.config), recipe, CPU).reason is None for s in ex.submitted)
        assert summary.counts == {"ok": 1, "pruned": 1, "duplicate": 1}
        best = summary.best
        assert best.config["micro_batch_size"] == 8 and best.tokens_per_s > 0
        assert best.metrics["status"] == "ok" and best.metrics["loss"] > 0
        assert summary.device_seconds["ok"] > 0

        code = (
            "import json, sys, optuna\n"
            "s = optuna.load_study(study_name=sys.argv[1], storage=sys.argv[2])\n"
            "print(json.dumps({'n': len(s.trials), 'best': s.best_params, "
            "'tps': s.best_trial.user_attrs['tokens_per_s'], "
            "'reasons': [t.user_attrs.get('pruned_reason') for t in s.trials]}))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, summary.study_name, url], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout)
        assert seen["n"] == 3 and seen["best"]["micro_batch_size"] == 8
        assert seen["tps"] == pytest.approx(best.tokens_per_s)
        assert any(r and r.startswith("predicted out of memory") for r in seen["reasons"])
        assert summarize(summary.study_name, url).best.trial == best.trial
    finally:
        with contextlib.suppress(KeyError):
            optuna.delete_study(study_name=recipe_study_name(recipe), storage=url)


def recipe_study_name(recipe) -> str:
    from tuner.fingerprint import fingerprint
    from tuner.study import study_name

    return study_name(recipe, fingerprint("cpu"))


def test_kill_9_mid_study_then_rerun_completes_without_lost_or_repeated_trials(tmp_path):
    # Seed 2 samples micro_batch_size 4 after the baseline (8): two device runs in all.
    doc = recipe_doc("killed", [4, 8], None, seed=2)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(doc))
    url = f"sqlite:///{tmp_path}/tuner.db"
    cmd = [sys.executable, "-m", "tuner.cli.main", "tune", "recipe.yaml", "--trials", "2", "--remeasure", "0",
           "--storage", url, "--json"]  # fmt: skip
    name = recipe_study_name(recipe_from_dict(doc))

    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while True:  # kill once one trial is complete and the next one is on the device
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the study never reached its second trial"
            try:
                trials = optuna.load_study(study_name=name, storage=url).trials
            except KeyError:
                trials = []
            states = [t.state for t in trials]
            if TrialState.COMPLETE in states and any(
                t.state == TrialState.RUNNING and OWNER_KEY in t.system_attrs for t in trials
            ):
                break
            time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    killed = next(t for t in trials if t.state == TrialState.RUNNING)

    rerun = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads(rerun.stdout)
    trials = optuna.load_study(study_name=name, storage=url).trials
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 2
    assert len({t.user_attrs["config_key"] for t in complete}) == 2, "a config was measured twice"
    assert trials[killed.number].state == TrialState.FAIL and trials[killed.number].user_attrs["driver_died"]
    assert [t.user_attrs.get("retry_of") for t in complete] == [None, killed.number]
    assert summary["counts"] == {"ok": 2, "failed": 1} and summary["best"] is not None


@pytest.mark.postgres
def test_a_second_tuner_tune_of_a_study_being_tuned_is_refused_and_adds_no_trial(tmp_path):
    doc = recipe_doc("busy", [4, 8], None, seed=2)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(doc))
    name = recipe_study_name(recipe_from_dict(doc))
    cmd = [sys.executable, "-m", "tuner.cli.main", "tune", "recipe.yaml", "--trials", "2", "--remeasure", "0",
           "--storage", PG_URL, "--json"]  # fmt: skip
    first = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while True:  # the first driver is on the device
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the first study never started a trial"
            with contextlib.suppress(KeyError):
                if any(
                    t.state == TrialState.RUNNING
                    for t in optuna.load_study(study_name=name, storage=PG_URL).trials
                ):
                    break
            time.sleep(0.5)
        second = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert second.returncode == 1, second.stderr[-2000:]
        assert f"is being tuned by another driver (pid {first.pid} on host" in second.stderr
        assert "Traceback" not in second.stderr
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err.decode()[-2000:]
        assert json.loads(out)["counts"] == {"ok": 2}, "the refused driver ran or failed a trial"
        again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]  # the finished driver freed the study
    finally:
        first.kill()
        first.wait()
        with contextlib.suppress(KeyError):
            optuna.delete_study(study_name=name, storage=PG_URL)
