"""The real entry point, `python -m tuner.workload SPEC.json`, as groups of gloo ranks: every
parallel split trains the same model as one process, each knob shows in what the ranks run, and
failures come back as error records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tuner.config import Config
from tuner.executors.nodes import free_port
from tuner.recipe import recipe_from_dict
from tuner.result import TrialSpec

pytestmark = pytest.mark.slow

TINY = {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256}
RANK_TIMEOUT_S = 240


@dataclass
class Run:
    workdir: Path
    exit_codes: list[int]
    log: str

    @property
    def result(self) -> dict[str, Any]:
        path = self.workdir / "result.json"
        assert path.exists(), f"no result.json; exit codes {self.exit_codes}\n{self.log[-3000:]}"
        return json.loads(path.read_text())

    def error(self, rank: int) -> dict[str, Any]:
        return json.loads((self.workdir / f"rank{rank}.error.json").read_text())

    def ranks(self) -> list[dict[str, Any]]:
        return self.result["extra"]["ranks"]


def launch_ranks(
    workdir: Path,
    world: int,
    knobs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    layers: int = 2,
    cache_dir: Path | None = None,
    model: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    **spec_fields: Any,
) -> Run:
    """Start `world` ranks the way an executor does (torchrun's variables), wait for them, and,
    like torchrun, end the others once one rank fails."""
    recipe = recipe_from_dict(
        {
            "name": "tiny",
            "model": model or TINY | {"layers": layers},
            "train": train or {"global_batch_size": 8},
            # Exactly 3 measured steps (no adaptive stop): the splits compare step for step.
            "measure": {"warmup_steps": 1, "steps": 3, "target_ci": None},
        }
    )
    workdir.mkdir(parents=True, exist_ok=True)
    spec = TrialSpec(
        recipe=recipe.to_dict(),
        config=Config.from_params(knobs or {}).to_dict(),
        family="cpu",
        workdir=str(workdir),
        timeout_s=RANK_TIMEOUT_S,
        **spec_fields,
    )
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec.to_dict()))
    port = str(free_port())
    cores = sorted(os.sched_getaffinity(0))
    procs = []
    for rank in range(world):
        rank_env = (
            os.environ
            | {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                # The measured CPU peak (for MFU) is cached here: once per test module, not per run.
                "TUNER_CACHE_DIR": str(cache_dir or workdir / "cache"),
            }
            | (env or {})
        )
        # Pin the group to `world` cores at most (one for a single rank): OpenMP threads that
        # compete for cores with other test processes make tiny steps very slow.
        pinned = set(cores[: max(1, min(world, len(cores)))])
        log = open(workdir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed when the rank ends
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tuner.workload", str(spec_path)],
                env=rank_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda p=pinned: os.sched_setaffinity(0, p),
            )
        )
    codes = _wait_all(procs)
    logs = "\n".join(f"--- rank {r}\n" + (workdir / f"rank{r}.log").read_text() for r in range(world))
    return Run(workdir, codes, logs)


def _wait_all(procs: list[subprocess.Popen]) -> list[int]:
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                # Peers blocked in a collective with the dead rank get a moment to fail on
                # their own (and write their record), then are ended.
                deadline = time.monotonic() + 3
                for p in procs:
                    try:
                        p.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        p.kill()
                break
            time.sleep(0.1)
        return [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tuner-cache")


@pytest.fixture
def launch(tmp_path, cache_dir):
    """launch(world, knobs=..., env=..., **TrialSpec fields) -> Run, in a fresh directory."""
    count = 0

    def run(world: int, knobs: dict[str, Any] | None = None, **kwargs: Any) -> Run:
        nonlocal count
        count += 1
        return launch_ranks(tmp_path / f"trial{count}", world, knobs, cache_dir=cache_dir, **kwargs)

    return run


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache_dir) -> dict[str, Any]:
    """The one-process run every split must reproduce (same seed, same global batches)."""
    run = launch_ranks(tmp_path_factory.mktemp("single"), 1, cache_dir=cache_dir)
    assert run.exit_codes == [0], run.log
    return run.result


def assert_same_training(result: dict[str, Any], single: dict[str, Any]) -> None:
    assert result["status"] == "ok"
    assert result["losses"] == pytest.approx(single["losses"], rel=1e-4)


def test_a_single_rank_reports_the_measured_numbers(single):
    r = single
    assert r["status"] == "ok" and len(r["step_times"]) == 3 and len(r["losses"]) == 3
    assert r["step_time_s"] == sorted(r["step_times"])[1]
    assert r["measured_s"] == pytest.approx(sum(r["step_times"]))
    assert r["tokens_per_s"] == pytest.approx(8 * 32 / r["step_time_s"])
    assert r["samples_per_s"] == pytest.approx(8 / r["step_time_s"])
    assert 0 < r["mfu"] < 1 and r["tflops"] > 0
    assert r["peak_mem_reserved_bytes"] > 1_000_000  # the model, its grads and Adam state at least
    assert r["loss"] == r["losses"][-1] and 4 < r["loss"] < 7  # about ln(256) for random tokens
    assert r["extra"]["matmul_dtype"] == "fp32"


def test_ddp_matches_one_process_with_its_bucket_and_cores(launch, single):
    run = launch(2, {"dp": 2, "bucket_mb": 1, "cpu_affinity": "per_rank"})
    assert_same_training(run.result, single)
    ranks = run.ranks()
    assert [r["bucket_cap_bytes"] for r in ranks] == [2**20, 2**20]
    assert [r["n_microbatches"] for r in ranks] == [4, 4]  # 8 samples / (1 per microbatch * dp 2)
    assert ranks[0]["cpus"] != ranks[1]["cpus"] and all(len(r["cpus"]) == 1 for r in ranks)


def test_powersgd_over_many_buckets_trains_on_gloo(launch):
    """PowerSGD with six gradient buckets (1.3M parameters, 1 MiB each): its chained all-reduces
    once reached gloo in a different order on each rank, which aborted the trial or hung it until
    its timeout, every time."""
    model = {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 2048}
    run = launch(2, {"dp": 2, "bucket_mb": 1, "grad_compression": "powersgd"}, model=model)
    assert run.exit_codes == [0, 0], run.log[-3000:]
    result = run.result
    assert result["status"] == "ok"
    assert "1,321,216 params on rank 0" in run.log  # 5.0 MiB of fp32 gradients: six buckets
    assert all(4 < loss < 9 for loss in result["losses"])  # about ln(2048) for random tokens
    # Its first compressed step (training step 2) allocates PowerSGD's matrices once: warm-up
    # holds it although the recipe allows one warm-up step.
    assert result["extra"]["warmup_steps"] == 3


def test_tp_halves_each_ranks_attention_and_mlp(launch, single):
    # With bf16 weights and fp32 master copies that are DTensors too.
    run = launch(2, {"tp": 2, "amp": "O2", "amp_dtype": "bf16"})
    assert run.result["losses"] == pytest.approx(single["losses"], rel=1e-3)
    assert {(r["param_dtype"], r["master_dtype"]) for r in run.ranks()} == {("bfloat16", "float32")}
    matmul_params = 2 * (4 * 64 * 64 + 2 * 64 * 256)  # qkv, out, up, down of 2 blocks
    vocab_params = 2 * 256 * 64  # token embedding and LM head, split over the vocabulary
    replicated = single["extra"]["ranks"][0]["params"] - matmul_params - vocab_params
    assert [r["params"] for r in run.ranks()] == [replicated + (matmul_params + vocab_params) // 2] * 2


def test_pp_puts_half_the_layers_on_each_rank(launch, single):
    run = launch(2, {"pp": 2, "pp_schedule": "1f1b"})
    assert_same_training(run.result, single)
    assert [r["layers"] for r in run.ranks()] == [[0], [1]]


def test_fsdp_shards_the_parameters(launch, single):
    run = launch(2, {"dp": 2, "dp_shard": "fsdp"})
    assert_same_training(run.result, single)
    total = single["extra"]["ranks"][0]["params"]
    assert all(r["fsdp"] and r["params"] == pytest.approx(total / 2, rel=0.02) for r in run.ranks())


def test_dp_times_tp_on_four_ranks(launch, single):
    run = launch(4, {"dp": 2, "tp": 2})
    assert_same_training(run.result, single)
    coords = [(r["coords"]["dp"], r["coords"]["tp"]) for r in run.ranks()]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({r["params"] for r in run.ranks()}) == 1


def test_dp_times_pp_with_gpipe_on_four_ranks(launch, single):
    run = launch(4, {"dp": 2, "pp": 2, "pp_schedule": "gpipe"})
    assert_same_training(run.result, single)
    assert [r["layers"] for r in run.ranks()] == [[0], [0], [1], [1]]
    assert all(r["bucket_cap_bytes"] == 25 * 2**20 for r in run.ranks())


def test_profile_shows_communication_and_writes_traces(launch):
    run = launch(2, {"dp": 2, "grad_compression": "fp16", "amp": "O2", "amp_dtype": "bf16"}, profile=True)
    result = run.result
    assert result["status"] == "ok"
    assert result["extra"]["matmul_dtype"] == "bf16"
    assert {r["param_dtype"] for r in run.ranks()} == {"bfloat16"}
    assert {r["master_dtype"] for r in run.ranks()} == {"float32"}
    assert result["breakdown"]["communication"] > 0
    assert result["breakdown"]["compute"] > 0 and result["breakdown"]["attention"] > 0
    profile = run.workdir / "profile"
    assert (profile / "trace-rank0.json").exists() and (profile / "trace-rank1.json").exists()
    assert json.loads((profile / "breakdown.json").read_text())["seconds_per_step"] == result["breakdown"]


def test_a_failing_rank_writes_its_error_record(launch):
    run = launch(2, {"dp": 2}, env={"TUNER_TEST_FAULT": "raise", "TUNER_TEST_FAULT_RANK": "1"})
    assert run.exit_codes[1] == 1
    err = run.error(1)
    assert err["status"] == "error" and err["error_kind"] == "RuntimeError"
    assert "TUNER_TEST_FAULT=raise" in err["error"] and "\n" not in err["error"]
    assert "Traceback" in err["traceback"]
    assert not (run.workdir / "result.json").exists()


def test_memory_over_the_budget_is_an_oom(launch):
    run = launch(1, env={"TUNER_TEST_FAULT": "alloc:256"}, memory_budget_bytes=128 * 2**20)
    assert run.exit_codes == [1]
    err = run.error(0)
    assert err["status"] == "oom" and err["error_kind"] == "budget"
    assert "exceeded the memory budget 128.0 MiB" in err["error"]


def test_degrees_that_do_not_fit_the_ranks_are_a_clear_error(launch):
    run = launch(1, {"tp": 2})
    err = run.error(0)
    assert err["error_kind"] == "ValueError"
    assert "dp*tp*pp = 1*2*1 = 2 but the trial has 1 ranks" in err["error"]


def test_an_unreadable_spec_is_a_usage_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tuner.workload", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "cannot read trial spec" in proc.stderr and "usage: python -m tuner.workload" in proc.stderr
