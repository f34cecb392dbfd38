"""One rank of a trial: build the training, warm up, time the measured steps, and report
(rank 0 writes `result.json`; a failing rank writes `rank{RANK}.error.json` and exits 1).

Test hooks, environment variables honoured by the step loop (tests and the nightly check use
them to make a trial slow or fail on purpose):
- `TUNER_TEST_STEP_DELAY_S=<seconds>`: sleep that long inside every step.
- `TUNER_TEST_STEP_JITTER_S=<seconds>`: and a random extra sleep (exponential, that mean) in every
  step, so step times are noisy and the adaptive measurement needs more steps.
- `TUNER_TEST_MEASURE_MAX_S=<seconds>`: cap `measure.max_seconds` (the test suite sets it so that
  trials which never reach `measure.target_ci` on a loaded machine stay short).
- `TUNER_TEST_FAULT=raise|hang|segfault|alloc:<MiB>`: in the first step, raise a RuntimeError,
  sleep forever, die of SIGSEGV, or allocate and hold that many MiB (trips the memory budget).
- `TUNER_TEST_FAULT_RANK=<rank>`: the rank the fault hits (default 0).
- `TUNER_TEST_FAULT=loader-alloc:<MiB>`: every data-loader worker (`loader_workers` > 0) of every
  rank allocates and holds that many MiB when it starts (`tuner.workload.data`).

Measurement hook:
- `TUNER_HOST_MEMORY=exact`: on CPU, freed memory leaves the process at once for the whole trial,
  so even the timed steps' peak (resident-set growth) is what the rank holds rather than what
  glibc's heap kept; slower steps (`tuner.memory.exact_host_memory`). Without it a CPU rank
  reads that figure (its `allocated`) from one untimed step after the timed ones (`HeldMemory`).

Build hook (a build's launch.sh sets it, next to TORCHINDUCTOR_CACHE_DIR):
- `TUNER_COMPILE_CACHE=<file>`: load this portable compile cache (a build's compile-cache.bin, or a
  rank's own compile-cache-rank<R>.bin beside it, `tuner.compile_cache`; from
  `torch.compiler.save_cache_artifacts`) once, before the model is compiled.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tuner import compile_cache
from tuner.config import Config
from tuner.devices import alloc_env, describe, is_oom, peak_tflops, synchronize
from tuner.memory import (
    HeldMemory,
    exact_host_memory,
    held_memory,
    memory_peak,
    one_malloc_heap,
    peak_memory,
    reset_peak_memory,
)
from tuner.models import family_of
from tuner.recipe import MeasureSpec, recipe_from_dict
from tuner.record.status import ERROR, OK, OOM
from tuner.result import TrialResult, TrialSpec
from tuner.workload.adaptive import Measurement, Plan
from tuner.workload.apply import first_steady_step
from tuner.workload.flops import flops_per_step
from tuner.workload.parallel import RankEnv, set_rank_threads
from tuner.workload.precision import matmul_dtype_name
from tuner.workload.profile import profile_steps, write_breakdown
from tuner.workload.train import Training

PROFILE_STEPS = 3
# The training step (0-based) that reads a CPU rank's held memory (`HeldMemory`) when the warm-up
# ceiling reaches it: the second warm-up step. Memory is at its steady state once the first
# optimizer step made Adam's moments, and a warm-up step is timed by nobody, so the reading costs
# no step of its own; the trim it starts with is paid back inside that step, not in a measured
# one. Measured on gpt-tiny (2 ranks, this repository's 2-core machine), the extra step after
# the measured ones was 0.10-0.30 s, a quarter to a third of a warm trial's overhead.
HELD_STEP = 1


class BudgetExceeded(RuntimeError):
    """Peak memory went over the trial's memory budget: reported as an oom."""


class Fault:
    """The TUNER_TEST_FAULT hook for this rank (see the module docstring)."""

    def __init__(self, rank: int, device: torch.device):
        self.device = device
        self.kind = os.environ.get("TUNER_TEST_FAULT", "")
        self.delay_s = float(os.environ.get("TUNER_TEST_STEP_DELAY_S", "0") or 0)
        self.jitter_s = float(os.environ.get("TUNER_TEST_STEP_JITTER_S", "0") or 0)
        self._random = random.Random(rank)
        target = int(os.environ.get("TUNER_TEST_FAULT_RANK", "0") or 0)
        if rank != target:
            self.kind = ""
        self.held: torch.Tensor | None = None

    def in_step(self, step: int) -> None:
        jitter = self._random.expovariate(1 / self.jitter_s) if self.jitter_s else 0.0
        if self.delay_s or jitter:
            time.sleep(self.delay_s + jitter)
        if step != 0 or not self.kind or self.kind.startswith("loader-alloc:"):
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
        raise ValueError(
            f"TUNER_TEST_FAULT={self.kind!r}: use raise, hang, segfault, alloc:<MiB> or loader-alloc:<MiB>"
        )


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


class StepClock:
    """Times one step: the device's own events where it has them (CUDA/NPU), else a synchronised
    host clock; with several ranks, every rank gets the slowest rank's time (one tiny all-reduce
    outside the timed region), so all of them take the same stop decision."""

    def __init__(self, family: str, world: int, device: torch.device):
        self.family, self.world, self.device = family, world, device
        mod = getattr(torch, family, None) if family in ("cuda", "npu") else None
        self._events = mod.Event if mod is not None and hasattr(mod, "Event") else None

    def start(self) -> None:
        synchronize(self.family)
        if self._events is not None:
            self._begin, self._end = self._events(enable_timing=True), self._events(enable_timing=True)
            self._begin.record()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self._events is not None:
            self._end.record()
        synchronize(self.family)
        dt = time.perf_counter() - self._t0
        if self._events is not None:
            dt = self._begin.elapsed_time(self._end) / 1e3
        if self.world > 1:
            t = torch.tensor([dt], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dt = float(t.item())
        return dt


def plan_of(m: MeasureSpec, spec: TrialSpec | None = None, tokens_per_step: int = 0) -> Plan:
    """The recipe's measure section as a plan, with what the study told this trial (`spec`, whose
    throughput lines become step times of `tokens_per_step` tokens): its own target replaces the
    recipe's where both are set (a recipe without a target measures a fixed number of steps,
    re-measurements too). Warm-up holds the config's once-only steps (`first_steady_step`)."""
    cap = float(os.environ.get("TUNER_TEST_MEASURE_MAX_S") or "inf")
    spec = spec or TrialSpec(recipe={}, config={}, family="cpu", workdir="")

    def step_time(tokens_per_s: float | None) -> float | None:
        return tokens_per_step / tokens_per_s if tokens_per_s else None

    adaptive = m.target_ci is not None
    return Plan(
        m.warmup_steps,
        m.steps,
        target_ci=spec.target_ci if spec.target_ci is not None and adaptive else m.target_ci,
        max_seconds=min(float(m.max_seconds), cap),
        slower_than_s=step_time(spec.slower_than_tokens_per_s),
        behind_s=step_time(spec.behind_tokens_per_s),
        behind_ci=spec.behind_ci,
        min_warmup=first_steady_step(Config.from_params(spec.config)),
    )


def measure(train: Training, spec: TrialSpec, baseline: int) -> tuple[list[float], list[float]]:
    """The measured step times and losses (see `measure_adaptive`); what a build rank uses."""
    run, losses = measure_adaptive(train, spec, baseline)
    return run.times, losses


def measure_adaptive(
    train: Training, spec: TrialSpec, baseline: int, held: HeldMemory | None = None
) -> tuple[Measurement, list[float]]:
    """Warm-up until the step time settles, then measured steps until the median's interval is
    tight or the time cap passes; (the measurement, global losses of the compared steps).
    `held`, when given, reads the rank's held memory in warm-up step `HELD_STEP` if the warm-up
    ceiling reaches it (`held.taken` says whether it did).

    The losses are those of training steps warmup_steps .. warmup_steps + steps - 1 (as many of them
    as ran): the same training steps in every trial of a study, whatever each trial's warm-up
    took, so the loss-drift check compares like with like; and, as before adaptive warm-up, not
    the first steps (a pipeline's very first step can report a nan loss and recover)."""
    m = train.recipe.measure
    fault = Fault(train.env.rank, train.device)
    clock = StepClock(spec.family, train.env.world_size, train.device)
    run = Measurement(plan_of(m, spec, train.recipe.tokens_per_step))
    local_losses: list[torch.Tensor] = []
    # Every step's loss from the window's first on is checked, not only the window's: a config
    # that diverged after it (measurement runs on to its interval or time cap) was reported ok,
    # its throughput measured on NaN weights. A flag per step on the device, read once at the end.
    nonfinite: list[torch.Tensor] = []
    reading = held if held is not None and m.warmup_steps > HELD_STEP else None
    i = 0
    while not run.done():
        clock.start()
        with reading if reading is not None and i == HELD_STEP else contextlib.nullcontext():
            loss = train.step()
        fault.in_step(i)
        run.add(clock.stop())
        _check_budget(spec, baseline)
        if m.warmup_steps <= i < m.warmup_steps + m.steps:
            local_losses.append(loss)
        if i >= m.warmup_steps:
            nonfinite.append(~torch.isfinite(torch.as_tensor(loss).detach()).all())
        i += 1
    flags = torch.stack(nonfinite) if nonfinite else None
    if flags is not None and bool(flags.any()):
        step = m.warmup_steps + int(flags.nonzero()[0])
        raise FloatingPointError(
            f"loss is not finite at step {step}; try amp_dtype=bf16, amp=O0 or a lower lr"
        )
    # A warm-up that settled early and a measurement that stopped early may end before the
    # window: the last step's loss is the trial's loss then.
    losses = train.global_losses(local_losses or [loss])
    for k, value in enumerate(losses):
        if not torch.isfinite(torch.tensor(value)):
            step = m.warmup_steps + k
            raise FloatingPointError(f"loss is {value} at step {step}; try amp_dtype=bf16 or amp=O0")
    return run, losses


def run_rank(spec: TrialSpec, env: RankEnv, baseline: int) -> TrialResult | None:
    """Run this rank's part of the trial; rank 0 returns the result, the others None."""
    config = spec.config
    set_rank_threads(env, config.get("cpu_affinity", "none"))
    compile_cache.load_for_rank(env.rank)  # before Training compiles anything
    train = Training.from_spec(spec, env)
    if env.rank == 0:
        print(f"trial {spec.tag or '-'}: {env.world_size} ranks, {torch.get_num_threads()} threads/rank, "
              f"{train.n_microbatches} microbatches/step, {train.local_params():,} params on rank 0", flush=True)  # fmt: skip
    held = held_memory(spec.family, baseline)  # CPU: what the rank holds, apart from the heap's slack
    run, losses = measure_adaptive(train, spec, baseline, held)
    mem = memory_peak(spec.family, baseline)
    held_step = None
    if held is not None:
        held_step = HELD_STEP
        if not held.taken:  # a warm-up shorter than HELD_STEP + 1: one more step, after the timed ones
            held_step = len(run.warmup) + len(run.times)
            with held:
                train.step()
        mem = held.peak(mem)
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
    return _result(train, spec, run.times, losses, memory, report, ranks, run, held_step)


def _result(
    train: Training,
    spec: TrialSpec,
    times,
    losses,
    memory,
    report,
    ranks,
    run: Measurement | None = None,
    held_step: int | None = None,
) -> TrialResult:
    """Rank 0's TrialResult; `memory` is run_rank's worst-rank reading ({} when not measured);
    `run` the adaptive measurement the times came from (None: a plain list of step times);
    `held_step` the training step that read the held memory (CPU)."""
    recipe, world = train.recipe, train.env.world_size
    if run is None:
        run = Measurement.of(plan_of(recipe.measure), list(times))
    median = statistics.median(times)
    dtype = matmul_dtype_name(train.config)
    peak = peak_tflops(describe(spec.family), dtype, torch.get_num_threads())
    tflops = flops_per_step(recipe) / median / world / 1e12
    gbs = recipe.train.global_batch_size
    return TrialResult(
        status=OK,
        step_time_s=median,
        step_time_spread=(max(times) - min(times)) / median,
        step_time_ci=run.ci,
        tokens_per_s=recipe.tokens_per_step / median,
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
        measured_s=run.measured_s,
        breakdown=report["seconds_per_step"] if report else None,
        tag=spec.tag,
        extra={
            "world_size": world,
            "matmul_dtype": dtype,
            "peak_tflops": peak,
            "ranks": ranks,
            "warmup_steps": len(run.warmup),
            "warmup_s": sum(run.warmup),
            "measured_steps": len(times),
            "stop_reason": run.stop_reason,
            "held_memory_step": held_step,
        },
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
    exact_host_memory(spec.family)  # TUNER_HOST_MEMORY=exact: see the module docstring
    one_malloc_heap(spec.family)  # so the held-memory step can hand every freed byte back
    workdir = Path(spec.workdir)
    try:
        model = recipe_from_dict(spec.recipe, "spec.recipe").model
        family_of(model).preload(model)
        # Before the model exists, its code loaded: CPU peak memory is growth of the resident
        # set over this point.
        baseline = reset_peak_memory(spec.family)
        env = RankEnv.from_environ()
        result = run_rank(spec, env, baseline)
        if result is not None:
            _write_json(workdir / "result.json", result.to_dict())
            ci = f"±{result.step_time_ci:.1%}" if result.step_time_ci is not None else "no CI"
            print(f"ok: step {result.step_time_s:.4f}s ({ci} over {len(result.step_times)} steps), "
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
