"""When to stop warming up and when to stop measuring (pure Python, no torch): warm-up ends when
the step time settles, measurement ends when the 95% confidence interval of the median step time
is tight enough, or its time cap passes. Every rank feeds the same step times (the slowest rank's),
so every rank takes the same decision and no collective is left waiting. A trial of a study also
stops once it is surely out of contention for the best (`Plan.slower_than_s`): its figure needs
no tight interval to lose; and one clearly behind the best stops at the run-to-run noise's
interval (`Plan.behind_s`), which more steps of its own could not narrow much."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# Warm-up has settled when the median of the last SETTLE_WINDOW steps is within SETTLE_REL of the
# median of the window one step earlier. A median of three ignores one odd step, so a trial whose
# first step alone is slow (allocator, autotuning, lazy init) settles after four; 10% because a
# shared CPU jitters that much from step to step even once warm.
SETTLE_WINDOW = 3
SETTLE_REL = 0.10
# Below this many steps no distribution-free 95% interval of the median exists (1 - 2 * 0.5**6 > 95%).
MIN_CI_STEPS = 6
_Z95 = 1.959964
_EXACT_UP_TO = 200  # exact binomial order statistics up to here, the normal approximation above


def _ci_rank(n: int) -> int:
    """The 0-based index k such that [x_(k), x_(n-1-k)] of n sorted samples is a >= 95% interval
    of the median (order statistics: the count of samples below the median is Binomial(n, 1/2))."""
    if n < MIN_CI_STEPS:
        raise ValueError(f"a 95% interval of the median needs at least {MIN_CI_STEPS} samples, got {n}")
    if n > _EXACT_UP_TO:
        return max(0, math.floor(n / 2 - _Z95 * math.sqrt(n) / 2) - 1)
    cdf, k = 0.0, 0
    # Largest k with P(Binomial(n, 1/2) <= k - 1) <= 2.5%.
    while True:
        cdf += math.comb(n, k) / 2**n
        if cdf > 0.025:
            return max(0, k - 1) if k else 0
        k += 1


def median_ci(sorted_values: list[float]) -> tuple[float, float]:
    """The 95% confidence interval (low, high) of the median of `sorted_values` (ascending)."""
    n = len(sorted_values)
    k = _ci_rank(n)
    return sorted_values[k], sorted_values[n - 1 - k]


def relative_half_width(sorted_values: list[float]) -> float | None:
    """Half the width of the median's 95% interval over the median; None with too few samples."""
    if len(sorted_values) < MIN_CI_STEPS:
        return None
    low, high = median_ci(sorted_values)
    median = _median(sorted_values)
    return (high - low) / 2 / median if median > 0 else None


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2


def settled(times: list[float]) -> bool:
    """Whether the step time stopped changing: the last window's median against the one a step earlier."""
    w = SETTLE_WINDOW
    if len(times) < w + 1:
        return False
    last, before = sorted(times[-w:]), sorted(times[-w - 1 : -1])
    now = _median(last)
    return now > 0 and abs(now - _median(before)) <= SETTLE_REL * now


@dataclass
class Plan:
    """The measure section's limits: warm-up ceiling, minimum measured steps, the CI target and the
    time cap on the measured steps. `target_ci=None` measures exactly `steps` steps.
    `slower_than_s`: a step time the config is out of contention above (the study's best so far,
    with a margin): measurement also stops, after the minimum steps, once the median's whole 95%
    interval lies above it. `behind_s`: a step time the config is clearly behind the best above: once
    its median is slower, `behind_ci` is interval enough (the run-to-run noise's level)."""

    warmup_steps: int
    steps: int
    target_ci: float | None = 0.03
    max_seconds: float = 20.0
    max_steps: int = 100_000  # a bound for very fast steps that never reach the target
    slower_than_s: float | None = None
    behind_s: float | None = None
    behind_ci: float | None = None
    # Warm-up steps the config needs whatever the ceiling and the step times say: once-only work
    # at a fixed step (`tuner.workload.apply.first_steady_step`).
    min_warmup: int = 0


@dataclass
class Measurement:
    """Feeds step times in order and says which phase each is in and when to stop."""

    plan: Plan
    warmup: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # the measured steps, in order
    _sorted: list[float] = field(default_factory=list)
    measured_s: float = 0.0
    stop_reason: str | None = None

    @property
    def warming_up(self) -> bool:
        if self.times:
            return False
        n = len(self.warmup)
        return n < self.plan.min_warmup or (n < self.plan.warmup_steps and not self._warm)

    @property
    def _warm(self) -> bool:
        return bool(self.warmup) and settled(self.warmup)

    @classmethod
    def of(cls, plan: Plan, times: list[float]) -> Measurement:
        """A measurement of these measured step times (no warm-up recorded)."""
        m = cls(plan)
        for dt in times:
            m.times.append(dt)
            bisect.insort(m._sorted, dt)
            m.measured_s += dt
        return m

    def add(self, dt: float) -> None:
        """Record one step that took `dt` seconds (the slowest rank's time)."""
        if self.warming_up:
            self.warmup.append(dt)
            return
        self.times.append(dt)
        bisect.insort(self._sorted, dt)
        self.measured_s += dt

    @property
    def ci(self) -> float | None:
        return relative_half_width(self._sorted)

    def done(self) -> bool:
        """Whether to stop (sets `stop_reason`: target_ci, max_seconds, steps, max_steps,
        out_of_contention or behind)."""
        p = self.plan
        n = len(self.times)
        if self.warming_up or n < p.steps:
            return False
        if p.target_ci is None:
            self.stop_reason = "steps"
        elif self.measured_s >= p.max_seconds:
            self.stop_reason = "max_seconds"
        elif n >= p.max_steps:
            self.stop_reason = "max_steps"
        elif (
            p.slower_than_s is not None and n >= MIN_CI_STEPS and median_ci(self._sorted)[0] > p.slower_than_s
        ):
            self.stop_reason = "out_of_contention"
        elif (ci := self.ci) is not None and ci <= p.target_ci:
            self.stop_reason = "target_ci"
        elif (
            ci is not None
            and p.behind_s is not None
            and p.behind_ci is not None
            and ci <= p.behind_ci
            and _median(self._sorted) > p.behind_s
        ):
            self.stop_reason = "behind"
        return self.stop_reason is not None
