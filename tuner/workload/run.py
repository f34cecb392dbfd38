"""One rank of a trial: build the training, warm up, time the measured steps, and report
(rank 0 writes `result.json`; a failing rank writes `rank{RANK}.error.json` and exits 1).

Test hooks, environment variables honoured by the step loop (tests and the nightly check use
them to make a trial slow or fail on purpose):
- `TUNER_TEST_STEP_DELAY_S=<seconds>`: sleep that long inside every step.
- `TUNER_TEST_FAULT=raise|hang|segfault|alloc:<MiB>`: in the first step, raise a RuntimeError,
  sleep forever, die of SIGSEGV, or allocate and hold that many MiB (trips the memory budget).
- `TUNER_TEST_FAULT_RANK=<rank>`: the rank the fault hits (default 0).

Build hook (a build's launch.sh sets it, next to TORCHINDUCTOR_CACHE_DIR):
- `TUNER_COMPILE_CACHE=<file>`: load this portable compile cache (a build's compile-cache.bin, from
  `torch.compiler.save_cache_artifacts`) once, before the model is compiled.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tuner.devices import (
    alloc_env,
    describe,
    is_oom,
    memory_peak,
    peak_memory,
    peak_tflops,
    reset_peak_memory,
    synchronize,
)
from tuner.record.status import ERROR, OK, OOM
from tuner.result import TrialResult, TrialSpec
from tuner.workload.flops import flops_per_step
from tuner.workload.parallel import RankEnv, set_rank_threads
from tuner.workload.precision import matmul_dtype_name
from tuner.workload.profile import profile_steps, write_breakdown
from tuner.workload.train import Training

PROFILE_STEPS = 3


class BudgetExceeded(RuntimeError):
    """Peak memory went over the trial's memory budget: reported as an oom."""


class Fault:
    """The TUNER_TEST_FAULT hook for this rank (see the module docstring)."""

    def __init__(self, rank: int, device: torch.device):
        self.device = device
        self.kind = os.environ.get("TUNER_TEST_FAULT", "")
        self.delay_s = float(os.environ.get("TUNER_TEST_STEP_DELAY_S", "0") or 0)
        target = int(os.environ.get("TUNER_TEST_FAULT_RANK", "0") or 0)
        if rank != target:
            self.kind = ""
        self.held: torch.Tensor | None = None

    def in_step(self, step: int) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if step != 0 or not self.kind:
            return
        if self.kind == "raise":
            raise RuntimeError("TUNER_TEST_FAULT=raise: injected failure")
        if self.kind == "hang":
            print("TUNER_TEST_FAULT=hang: sleeping forever", flush=True)
            while True:
                time.sleep(3600)
        if self.kind == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.kind.startswith("alloc:"):
            mib = int(self.kind.split(":", 1)[1])
            # On the training device, so the device's own peak-memory reading sees it; ones
            # (not empty) so every host page is really touched.
            self.held = torch.ones(mib * 2**20, dtype=torch.uint8, device=self.device)
            return
        raise ValueError(f"TUNER_TEST_FAULT={self.kind!r}: use raise, hang, segfault or alloc:<MiB>")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _check_budget(spec: TrialSpec, baseline: int) -> None:
    if spec.memory_budget_bytes is None:
        return
    _, reserved = peak_memory(spec.family, baseline)
    if reserved > spec.memory_budget_bytes:
        raise BudgetExceeded(
            f"peak memory {_mib(reserved)} exceeded the memory budget {_mib(spec.memory_budget_bytes)} "
            "(hardware.memory_budget_gb); lower micro_batch_size or enable recompute"
        )


def _max_over_ranks(values: list[int], world: int, device: torch.device) -> list[int]:
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def measure(train: Training, spec: TrialSpec, baseline: int) -> tuple[list[float], list[float]]:
    """Warm-up then measured steps; (step times, global losses) of the measured steps."""
    m = train.recipe.measure
    fault = Fault(train.env.rank, train.device)
    times: list[float] = []
    local_losses: list[torch.Tensor] = []
    for i in range(m.warmup_steps + m.steps):
        synchronize(spec.family)
        t0 = time.perf_counter()
        loss = train.step()
        fault.in_step(i)
        synchronize(spec.family)
        dt = time.perf_counter() - t0
        _check_budget(spec, baseline)
        if i >= m.warmup_steps:
            times.append(dt)
            local_losses.append(loss)
    losses = train.global_losses(local_losses)
    for k, value in enumerate(losses):
        if not torch.isfinite(torch.tensor(value)):
            raise FloatingPointError(f"loss is {value} at measured step {k}; try amp_dtype=bf16 or amp=O0")
    return times, losses


def run_rank(spec: TrialSpec, env: RankEnv, baseline: int) -> TrialResult | None:
    """Run this rank's part of the trial; rank 0 returns the result, the others None."""
    config = spec.config
    set_rank_threads(env, config.get("cpu_affinity", "none"))
    cache = os.environ.get("TUNER_COMPILE_CACHE")
    if cache:
        torch.compiler.load_cache_artifacts(Path(cache).read_bytes())
    train = Training.from_spec(spec, env)
    if env.rank == 0:
        print(f"trial {spec.tag or '-'}: {env.world_size} ranks, {torch.get_num_threads()} threads/rank, "
              f"{train.n_microbatches} microbatches/step, {train.local_params():,} params on rank 0", flush=True)  # fmt: skip
    times, losses = measure(train, spec, baseline)
    mem = memory_peak(spec.family, baseline)
    # The worst rank's peak; -1 stands for "not reported" (CPU has no allocator view).
    alloc, reserved, active, frag = _max_over_ranks(
        [
            mem.allocated,
            mem.reserved,
            -1 if mem.active is None else mem.active,
            -1 if mem.fragmentation is None else mem.fragmentation,
        ],
        env.world_size,
        train.device,
    )
    memory = {"allocated": alloc, "reserved": reserved, "active": active, "fragmentation": frag}
    report = None
    if spec.profile:
        out = Path(spec.workdir) / "profile"
        report = profile_steps(
            train, min(PROFILE_STEPS, train.recipe.measure.steps), out, env.rank, spec.family
        )
    ranks = [train.rank_report()]
    if env.world_size > 1:
        gathered: list[Any] = [None] * env.world_size if env.rank == 0 else None
        dist.gather_object(ranks[0], gathered, dst=0)
        ranks = gathered
    if env.rank != 0:
        return None
    if report is not None:
        write_breakdown(report, Path(spec.workdir) / "profile")
    return _result(train, spec, times, losses, memory, report, ranks)


def _result(train: Training, spec: TrialSpec, times, losses, memory, report, ranks) -> TrialResult:
    """Rank 0's TrialResult; `memory` is run_rank's worst-rank reading ({} when not measured)."""
    recipe, world = train.recipe, train.env.world_size
    median = statistics.median(times)
    dtype = matmul_dtype_name(train.config)
    peak = peak_tflops(describe(spec.family), dtype, torch.get_num_threads())
    tflops = flops_per_step(recipe) / median / world / 1e12
    gbs = recipe.train.global_batch_size
    return TrialResult(
        status=OK,
        step_time_s=median,
        step_time_spread=(max(times) - min(times)) / median,
        tokens_per_s=gbs * recipe.model.seq_len / median,
        samples_per_s=gbs / median,
        tflops=tflops,
        mfu=tflops / peak if peak else None,
        peak_mem_allocated_bytes=memory.get("allocated"),
        peak_mem_reserved_bytes=memory.get("reserved"),
        # -1 stands for "not reported" (see run_rank)
        peak_mem_active_bytes=None if memory.get("active", -1) < 0 else memory["active"],
        mem_fragmentation_bytes=None if memory.get("fragmentation", -1) < 0 else memory["fragmentation"],
        estimated_peak_mem_bytes=spec.estimated_peak_mem_bytes,
        loss=losses[-1],
        losses=losses,
        step_times=times,
        measured_s=sum(times),
        breakdown=report["seconds_per_step"] if report else None,
        tag=spec.tag,
        extra={"world_size": world, "matmul_dtype": dtype, "peak_tflops": peak, "ranks": ranks},
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def error_record(exc: BaseException) -> dict[str, Any]:
    """What a failing rank reports: oom (device or budget) or error, with the exception's kind."""
    budget = isinstance(exc, BudgetExceeded)
    message = " ".join(str(exc).split()) or type(exc).__name__
    return {
        "status": OOM if budget or is_oom(exc) else ERROR,
        "error_kind": "budget" if budget else type(exc).__name__,
        "error": message[:2000],
        "traceback": "".join(traceback.format_exception(exc)),
    }


def main(spec: TrialSpec) -> int:
    """Run one rank of `spec`; the return value is the rank's exit code."""
    # Before the device's allocator starts (the first CUDA/NPU call reads its settings).
    os.environ.update(alloc_env(spec.family, spec.config.get("alloc_conf", "default")))
    # Before the model exists: CPU peak memory is growth of the resident set over this point.
    baseline = reset_peak_memory(spec.family)
    workdir = Path(spec.workdir)
    try:
        env = RankEnv.from_environ()
        result = run_rank(spec, env, baseline)
        if result is not None:
            _write_json(workdir / "result.json", result.to_dict())
            print(f"ok: step {result.step_time_s:.4f}s (spread {result.step_time_spread:.1%}), "
                  f"{result.tokens_per_s:,.0f} tokens/s, mfu {result.mfu or 0:.1%}, loss {result.loss:.4f}")  # fmt: skip
        if dist.is_initialized():
            # Pipeline sends may still be in flight on some rank; finish them all before teardown.
            dist.barrier()
            dist.destroy_process_group()
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure becomes a record, never a hang
        record = error_record(exc)
        rank = os.environ.get("RANK", "0")
        _write_json(workdir / f"rank{rank}.error.json", record)
        print(f"rank {rank} failed ({record['status']}, {record['error_kind']}): {record['error']}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1
