"""Where a step's time goes: a torch.profiler run over a few extra steps, a Chrome trace per rank
and a breakdown by category (compute, attention, communication, optimizer, idle)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile

from tuner.devices import synchronize
from tuner.result import BREAKDOWN_CATEGORIES

CATEGORIES = BREAKDOWN_CATEGORIES

# An attention kernel, or the attention op whose math backend runs as matmuls and a softmax.
_ATTENTION = (
    "scaled_dot_product",
    "flash_attention",
    "efficient_attention",
    "cudnn_attention",
    "npu_fusion_attention",
)
_COMMUNICATION = ("c10d", "gloo", "nccl", "hccl", "allreduce", "all_reduce", "all_gather", "allgather",
                  "reduce_scatter", "broadcast", "record_param_comms")  # fmt: skip


def _under(event: Any, match: Any) -> bool:
    """Whether `event` or an op it ran inside satisfies `match` (its lower-case name)."""
    while event is not None:
        if match(event.name.lower()):
            return True
        event = event.cpu_parent
    return False


def classify(event: Any) -> str:
    """Category of one profiler event, from its name and the ops it ran inside: the optimizer
    step, or an attention op (whose math backend is matmuls and a softmax underneath)."""
    name = event.name.lower()
    if any(key in name for key in _COMMUNICATION):
        return "communication"
    if _under(event, lambda n: n == "optimizer"):
        return "optimizer"
    if _under(event, lambda n: any(key in n for key in _ATTENTION)):
        return "attention"
    return "compute"


def breakdown(events: list[Any], wall_s: float, steps: int, on_device: bool) -> dict[str, Any]:
    """Seconds per step and fractions by category. idle = wall - busy: time nothing of this rank
    ran (waiting for a peer, the data loader, the host)."""
    busy = dict.fromkeys(CATEGORIES[:-1], 0.0)
    for ev in events:
        us = ev.self_device_time_total if on_device else ev.self_cpu_time_total
        busy[classify(ev)] += us / 1e6
    seconds = {k: v / steps for k, v in busy.items()}
    per_step_wall = wall_s / steps
    seconds["idle"] = max(0.0, per_step_wall - sum(seconds.values()))
    # Several host threads can overlap, so busy time may exceed the wall; fractions of the sum.
    total = sum(seconds.values()) or 1.0
    return {
        "steps": steps,
        "wall_s_per_step": per_step_wall,
        "seconds_per_step": seconds,
        "fractions": {k: v / total for k, v in seconds.items()},
    }


def top_operators(prof: Any, on_device: bool, steps: int, n: int = 15) -> list[dict[str, Any]]:
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda a: getattr(a, key), reverse=True)[:n]
    return [{"name": a.key, "self_s_per_step": getattr(a, key) / 1e6 / steps, "calls": a.count} for a in rows]


# How long the profiler stays on after the last step, for the process group's worker threads to
# unwind the callbacks they ran under it (a communication hook's `Future.then`).
DRAIN_S = 0.05


def _drain_collectives() -> None:
    """Give the process group's threads time to leave the profiler's callbacks before it stops.
    A gloo thread that completes a collective's future may still be inside them when the main
    thread, woken by that future, stops the profiler and frees what they write to: the likely
    cause of a crash seen once in CI (one stop in about forty), where rank 0 of a 2-rank profile
    with an fp16 gradient hook died of SIGSEGV right after the profiler stopped (forty runs here
    did not repeat it; faulthandler now names the frame if it happens again). No collective here:
    it would be recorded as the steps' communication. Costs 0.05 s once per profiled trial."""
    time.sleep(DRAIN_S)


def profile_steps(train: Any, steps: int, out_dir: Path, rank: int, family: str) -> dict[str, Any]:
    """Profile `steps` more steps of `train` (a `Training`). Profiling slows the steps it
    watches, so these come after the timed steps and never count in step_time_s."""
    on_device = family == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            train.step()
        synchronize(family)
        wall = time.perf_counter() - t0
        _drain_collectives()
    out_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out_dir / f"trace-rank{rank}.json"))
    report = breakdown(list(prof.events()), wall, steps, on_device)
    report["top_operators"] = top_operators(prof, on_device, steps)
    return report


def write_breakdown(report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "breakdown.json").write_text(json.dumps(report, indent=1))
