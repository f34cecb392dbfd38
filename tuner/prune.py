"""Why a config never reaches a device: the feasibility rules and the estimator's predicted OOM.

Both cost no device time, so the study asks these first and tells the trial PRUNED with the reason.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from tuner.config import Config, infeasible_reasons
from tuner.devices import DeviceInfo
from tuner.recipe import Recipe

# The estimator may under-predict; a config predicted within this fraction of the budget is
# still tried on the device rather than pruned.
OOM_MARGIN = 0.15


@dataclass(frozen=True)
class Verdict:
    reason: str | None  # None: worth a device run
    estimated_peak_mem_bytes: int | None = None
    memory_budget_bytes: int | None = None


def _estimator():
    try:
        return importlib.import_module("tuner.estimate")
    except ModuleNotFoundError as err:  # the estimator is optional: no pruning without it
        if err.name != "tuner.estimate":
            raise
        return None


def verdict(config: Config, recipe: Recipe, device: DeviceInfo) -> Verdict:
    """Feasibility first (cheap, certain), then the memory estimate against the budget."""
    reasons = infeasible_reasons(config, recipe, device)
    if reasons:
        return Verdict("infeasible: " + "; ".join(reasons))
    est_mod = _estimator()
    if est_mod is None:
        return Verdict(None)
    est = est_mod.estimate(recipe, config, device)
    budget = est_mod.budget_bytes(recipe, device)
    peak = int(est.peak_mem_bytes)
    if est_mod.predicts_oom(est, budget, margin=OOM_MARGIN):
        return Verdict(
            f"predicted out of memory: estimated peak {peak / 2**30:.2f} GiB per device "
            f"exceeds the {budget / 2**30:.2f} GiB budget (margin {OOM_MARGIN:.0%})",
            peak,
            budget,
        )
    return Verdict(None, peak, budget)
