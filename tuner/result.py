"""What one trial asks for (`TrialSpec`) and what it reports (`TrialResult`).

Both are plain JSON so they cross process, Ray and HTTP boundaries unchanged. The result keys
are fixed by DESIGN.md and used everywhere (CLI --json, trial user attributes, REST).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tuner.record import keys
from tuner.record.status import OK, Status

# Where a profiled step's time goes (`TrialResult.breakdown`), in the dashboard's stacking order.
BREAKDOWN_CATEGORIES = ("compute", "attention", "communication", "optimizer", "idle")

# The public result keys, in display order (DESIGN.md), are defined with every stored key name.
RESULT_KEYS = keys.RESULT_KEYS


def budget_peak(values: Mapping[str, Any]) -> int | None:
    """The peak a trial's memory budget is checked against, from its result keys (a result, its
    stored attributes, a table row): reserved (what the device's pool, or a CPU rank's process,
    held at its peak), else allocated where only that is known."""
    return values.get(keys.PEAK_MEM_RESERVED_BYTES) or values.get(keys.PEAK_MEM_ALLOCATED_BYTES)


@dataclass
class TrialSpec:
    """Everything a trial process needs; serialised to JSON and handed to every rank."""

    recipe: dict[str, Any]  # Recipe.to_dict()
    config: dict[str, Any]  # Config.to_dict()
    family: str  # resolved device family: cpu | cuda | npu
    workdir: str  # the trial's own directory: logs, result.json, profile
    timeout_s: float = 300.0
    profile: bool = False  # write a Chrome trace + breakdown into workdir/profile
    estimated_peak_mem_bytes: int | None = None
    memory_budget_bytes: int | None = None  # per device; exceeding it is an oom
    seed: int = 0
    tag: str = ""  # caller's handle (e.g. Optuna trial number), echoed back in the result
    # A throughput the config is out of contention below (the study's best so far, with a margin):
    # its measurement may stop before its interval is tight (`tuner.workload.adaptive.Plan`).
    slower_than_tokens_per_s: float | None = None
    # Replaces the recipe's measure.target_ci where set (a re-measurement is measured to the
    # run-to-run noise: `tuner.record.ranking.run_noise_ci`).
    target_ci: float | None = None
    # A throughput the config is clearly behind the best below (`tuner.record.ranking.behind_line`):
    # once its median is slower, its steps stop at the interval `behind_ci` instead of target_ci.
    behind_tokens_per_s: float | None = None
    behind_ci: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialSpec:
        return cls(**d)


@dataclass
class TrialResult:
    status: Status  # a measured status word (tuner.record.status.MEASURED) when it ran
    step_time_s: float | None = None
    step_time_spread: float | None = None
    step_time_ci: float | None = None  # relative half-width of the median's 95% interval
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_mem_allocated_bytes: int | None = None
    peak_mem_reserved_bytes: int | None = None
    peak_mem_active_bytes: int | None = None  # CUDA/NPU allocator only
    mem_fragmentation_bytes: int | None = None  # reserved - allocated at the peak
    estimated_peak_mem_bytes: int | None = None
    loss: float | None = None
    error: str | None = None
    measured_s: float | None = None  # time inside measured steps
    wall_s: float | None = None  # launch to exit, as the executor saw it
    # Beyond the public keys: evidence kept with the trial.
    error_kind: str | None = None  # e.g. exception class, "timeout", "budget", "worker_died"
    losses: list[float] = field(default_factory=list)  # steps warmup_steps.., same seed and data
    step_times: list[float] = field(default_factory=list)  # of the measured steps
    breakdown: dict[str, float] | None = None  # step-time seconds by category (with --profile)
    log_path: str | None = None
    log_tail: str | None = None
    node: str | None = None  # host that ran it (node 0's, for a multi-node trial)
    nodes: int | None = None  # distinct nodes its ranks ran on
    rank_nodes: list[str | None] = field(default_factory=list)  # each rank's node id, by rank
    tag: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RESULT_KEYS}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialResult:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def budget_peak(self) -> int | None:
        """The peak the memory budget is checked against (`budget_peak`)."""
        return budget_peak(vars(self))

    @property
    def measured_ok(self) -> bool:
        """Whether it ran to a throughput the study may use: ok, and a finite, positive tokens/s."""
        tps = self.tokens_per_s
        return self.status == OK and tps is not None and math.isfinite(tps) and tps > 0

    @property
    def overhead_s(self) -> float | None:
        """Time the trial cost outside its measured steps (launch, build, warm-up, teardown)."""
        if self.wall_s is None or self.measured_s is None:
            return None
        return max(0.0, self.wall_s - self.measured_s)
