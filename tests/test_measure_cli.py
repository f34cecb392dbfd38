"""`tuner measure` as a user runs it: a subprocess, its exit status, stdout and stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tuner.cli.measure import default_config
from tuner.config import ConfigError
from tuner.result import RESULT_KEYS

TINY = {
    "name": "cli-tiny",
    "model": {"family": "gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256},
    "train": {"global_batch_size": 8},
    "hardware": {"device": "cpu", "devices": 2},
    "measure": {"warmup_steps": 1, "steps": 3},
}


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def start(*args: str, cwd: Path) -> subprocess.Popen:
    """`tuner measure ARGS` started in `cwd`, its output captured."""
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "tuner.cli.main", "measure", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    """Wait for `proc` (killing it past `timeout`, as subprocess.run does)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def tuner(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return finish(start(*args, cwd=cwd), timeout)


# ---- bad input: exit 2, a message, no traceback --------------------------------------------------

BAD_RUNS = {
    "unknown knob": ["--set", "microbatch=4"],
    "infeasible": ["--set", "tp=3", "--set", "tf32=true"],
    "bad recipe": ["--set", "recompute=full"],  # run against a recipe with layers: 0
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The three bad invocations at once: each spends its time importing torch, not working."""
    tmp = tmp_path_factory.mktemp("bad")
    good, bad = tmp / "tiny.yaml", tmp / "bad.yaml"
    good.write_text(yaml.safe_dump(TINY))
    bad.write_text(yaml.safe_dump({**TINY, "model": {**TINY["model"], "layers": 0}}))
    procs = {
        name: start(str(bad if name == "bad recipe" else good), *args, cwd=tmp)
        for name, args in BAD_RUNS.items()
    }
    return {name: finish(p, timeout=120) for name, p in procs.items()}


@pytest.mark.slow
def test_unknown_knob_exits_2_and_lists_the_knobs(bad_runs):
    out = bad_runs["unknown knob"]
    assert out.returncode == 2
    assert "unknown knob 'microbatch'" in out.stderr
    assert "micro_batch_size" in out.stderr and "cpu_affinity" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


@pytest.mark.slow
def test_infeasible_config_exits_2_with_every_reason(bad_runs):
    out = bad_runs["infeasible"]
    assert out.returncode == 2
    for reason in ("dp*tp*pp = 1*3*1 = 3", "heads (4) not divisible by tp (3)", "tf32 is not supported"):
        assert reason in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_bad_recipe_exits_2_naming_the_field(bad_runs):
    out = bad_runs["bad recipe"]
    assert out.returncode == 2 and "model.layers" in out.stderr
    assert "Traceback" not in out.stderr


def test_unset_degrees_take_up_the_devices():
    assert (lambda c: (c.dp, c.tp, c.pp))(default_config(2, {"tp": "2"})) == (1, 2, 1)
    assert (lambda c: (c.dp, c.tp, c.pp))(default_config(8, {"pp": "2"})) == (4, 1, 2)
    assert (lambda c: (c.dp, c.tp, c.pp))(default_config(4, {"dp": "1"})) == (1, 4, 1)
    assert (lambda c: (c.dp, c.tp, c.pp))(default_config(4, {})) == (4, 1, 1)
    # Not divisible: left for the feasibility check to explain.
    assert default_config(4, {"tp": "3"}).world_size == 3
    with pytest.raises(ConfigError, match="valid values: none, selective, full"):
        default_config(2, {"recompute": "all"})


# ---- a real trial ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_json_profile_and_derived_split(recipe, tmp_path):
    prof = tmp_path / "prof"
    out = tuner(str(recipe), "--set", "tp=2", "--json", "--profile", str(prof), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert list(doc) == [*RESULT_KEYS, "extra"]
    assert doc["status"] == "ok", doc["error"]
    assert doc["step_time_s"] > 0 and doc["tokens_per_s"] > 0 and doc["estimated_peak_mem_bytes"] > 0
    assert doc["wall_s"] > doc["measured_s"] > 0
    assert doc["step_time_ci"] is None or doc["step_time_ci"] >= 0
    if doc["step_time_ci"] is not None:
        # Where a re-run lands: wider than the steps' interval by the CPU's run-to-run noise.
        from tuner.record.ranking import RUN_NOISE_PRIOR, Z95

        assert doc["extra"]["rerun_interval"] >= 2**0.5 * Z95 * RUN_NOISE_PRIOR["cpu"]
    assert (doc["extra"]["config"]["dp"], doc["extra"]["config"]["tp"]) == (1, 2)
    # Each rank really held half of every block's matmul weights.
    assert {r["coords"]["tp"] for r in doc["extra"]["ranks"]} == {0, 1}
    assert (prof / "trace-rank0.json").stat().st_size > 0 and (prof / "trace-rank1.json").exists()
    report = json.loads((prof / "breakdown.json").read_text())
    assert report["seconds_per_step"] and report["top_operators"]
    assert Path(doc["extra"]["log_path"]).exists()


@pytest.mark.slow
def test_a_failed_trial_exits_1_and_shows_its_status(recipe, tmp_path):
    # Exit 2 is bad input (nothing ran); 1 a trial that ran and did not end ok, so that a script
    # checking one config sees it failed without parsing the output.
    out = tuner(str(recipe), "--timeout-s", "1", "--workdir", str(tmp_path / "w"), cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "trial: timeout" in out.stdout
    assert "ran past its timeout of 1s" in out.stdout
    assert (tmp_path / "w" / "trial.log").exists()


@pytest.mark.slow
def test_measurements_started_together_each_report_their_own_config(recipe, tmp_path):
    """Two `tuner measure` runs started in the same second, from one directory, with the default
    work directory: each must report its own trial (they once shared a directory named by the
    second and both printed whichever result was written last)."""
    runs = {
        mbs: start(str(recipe), "--set", f"micro_batch_size={mbs}", "--json", cwd=tmp_path) for mbs in (1, 2)
    }
    docs = {}
    for mbs, proc in runs.items():
        out = finish(proc)
        assert out.returncode == 0, out.stderr
        docs[mbs] = json.loads(out.stdout)
    assert {mbs: d["extra"]["config"]["micro_batch_size"] for mbs, d in docs.items()} == {1: 1, 2: 2}
    assert docs[1]["extra"]["workdir"] != docs[2]["extra"]["workdir"]
    assert all(Path(d["extra"]["workdir"]).parent == tmp_path / "runs" / "measure" for d in docs.values())


def test_a_recipe_name_with_slashes_makes_one_directory_under_runs(tmp_path):
    """The default work directory was named by the raw recipe name: `team/gpt` was a
    FileNotFoundError traceback, and `../` would have left runs/."""
    path = tmp_path / "slashed.yaml"
    path.write_text(yaml.safe_dump({**TINY, "name": "team/../gpt"}))
    out = tuner(str(path), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (made,) = (tmp_path / "runs" / "measure").iterdir()
    assert made.name.startswith(
        "team-..-gpt-"
    )  # one directory: no "/" is left and (made / "trial.log").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "slashed.yaml"]
