"""Why a config never reaches a device: the feasibility rules, the estimator's predicted OOM, and
the OOM floor (a config estimated at least as large as one that ran out of memory will too).

Both cost no device time, so the study asks these first and tells the trial PRUNED with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tuner.config import Config, infeasible_reasons
from tuner.devices import DeviceInfo
from tuner.estimate import OOM_MARGIN, Estimate, budget_bytes, estimate, predicts_oom, reserved_ratio_prior
from tuner.recipe import Recipe
from tuner.record import keys
from tuner.result import budget_peak

__all__ = [
    "OOM_MARGIN",
    "OomFloor",
    "Verdict",
    "calibration_factor",
    "oom_floor",
    "study_calibration",
    "verdict",
]


@dataclass(frozen=True)
class Verdict:
    reason: str | None  # None: worth a device run
    estimated_peak_mem_bytes: int | None = None
    memory_budget_bytes: int | None = None


def calibration_factor(pairs: list[tuple[float, float]], minimum: int = 3, prior: float = 1.0) -> float:
    """How much measured peaks exceed the estimator's predictions in this study so far.

    `pairs` are (measured peak, estimated peak) of trials that ran to completion. The median
    ratio, once `minimum` trials have both, bounded to [0.5, 2]; `prior` before that. On the CPU table
    (benchmarks/tables/cpu-gpt-tiny.csv) the ratio is 1.17 (0.98 to 1.46): scaling by it lets the
    OOM check catch 21 of 53 over-budget configs instead of 6, with no config wrongly pruned.
    """
    ratios = sorted(m / e for m, e in pairs if m and e and m > 0 and e > 0)
    if len(ratios) < minimum:
        return prior
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return min(2.0, max(0.5, median))


def study_calibration(attrs: Iterable[Mapping[str, Any]], device: DeviceInfo) -> float:
    """`calibration_factor` over completed trials' stored attributes. The estimator predicts the
    allocated peak; the budget is checked against `budget_peak`, so the factor scales the one to
    the other and carries the pool's slack (glibc's heap on CPU) the estimator does not model:
    the device's `reserved_ratio_prior` until the study has measured three."""
    pairs = [(budget_peak(a), a.get(keys.ESTIMATED_PEAK_MEM_BYTES)) for a in attrs]
    return calibration_factor(pairs, prior=reserved_ratio_prior(device.family))


def _floor_group(config: Config) -> tuple:
    # The estimator's error depends mostly on the split and the AMP level: compare within them.
    return (config.dp, config.tp, config.pp, config.amp)


@dataclass(frozen=True)
class OomFloor:
    """Per split and AMP level, the smallest estimated peak among configs that ran out of memory
    in this study, and the trial that did: anything estimated at least that large is bound to."""

    floors: dict[tuple, tuple[int, int]] = field(default_factory=dict)  # group -> (bytes, trial)

    def bound(self, config: Config, estimated_peak: int) -> int | None:
        """The trial number whose OOM bounds this config, or None."""
        hit = self.floors.get(_floor_group(config))
        return hit[1] if hit is not None and estimated_peak >= hit[0] else None


def oom_floor(ooms: Iterable[tuple[Config, int | None, int]]) -> OomFloor:
    """The floor from (config, its estimated peak, trial number) of every trial that OOMed."""
    floors: dict[tuple, tuple[int, int]] = {}
    for config, est, number in ooms:
        if not est:
            continue
        group = _floor_group(config)
        if group not in floors or est < floors[group][0]:
            floors[group] = (int(est), number)
    return OomFloor(floors)


def verdict(
    config: Config,
    recipe: Recipe,
    device: DeviceInfo,
    calibration: float | None = None,
    floor: OomFloor | None = None,
    est: Estimate | None = None,
    margin: float = OOM_MARGIN,
) -> Verdict:
    """Feasibility first (cheap, certain), then the memory estimate against the budget, then
    the OOM floor.

    `calibration` scales the estimate by what this study measured so far (`study_calibration`;
    None: the device's `reserved_ratio_prior`, as before any trial); `margin`, how far over the
    budget a scaled estimate may be and still be tried (`OOM_MARGIN`);
    `floor` holds what ran out of memory in it (`oom_floor`); `est`, the config's estimate when
    the caller has it already (the model sampler judges thousands of configs per trial).
    """
    reasons = infeasible_reasons(config, recipe, device)
    if reasons:
        return Verdict("infeasible: " + "; ".join(reasons))
    est = est or estimate(recipe, config, device)
    budget = budget_bytes(recipe, device)
    peak = int(est.peak_mem_bytes)
    if calibration is None:
        calibration = reserved_ratio_prior(device.family)
    if predicts_oom(est, budget, margin, calibration):
        predicted = int(peak * calibration)
        scaled = (
            f" (estimate x{calibration:.2f}, the measured/estimated peak ratio of this study, or of "
            "the device before three trials)"
            if calibration != 1
            else ""
        )
        return Verdict(
            f"predicted out of memory: peak {predicted / 2**30:.3f} GiB per device{scaled} "
            f"exceeds the {budget / 2**30:.3f} GiB budget (margin {margin:.0%})",
            peak,
            budget,
        )
    bound = floor.bound(config, peak) if floor is not None else None
    if bound is not None:
        return Verdict(
            f"predicted out of memory: estimated peak {peak / 2**30:.3f} GiB is at least that of "
            f"trial {bound}, which ran out of memory with the same split and AMP level",
            peak,
            budget,
        )
    return Verdict(None, peak, budget)
