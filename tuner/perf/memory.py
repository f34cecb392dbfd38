"""The chance that a config fits the memory budget: the estimator's prediction times a ratio
(measured over estimated peak) fitted to this study's trials by a small ridge regression on the
knobs the ratio depends on (micro-batch, AMP level, recompute, the split), and its uncertainty."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tuner.config import Config
from tuner.devices import DeviceInfo
from tuner.estimate import budget_bytes
from tuner.perf.observations import Observation
from tuner.record.status import OK, OOM

RATIO_PRIOR_SD = 0.15  # log ratio before anything was measured: the estimator's stated error
# Prior sd of each knob's effect on the log ratio (log2 of the micro-batch counts per doubling).
# On CPU glibc's retained heap moves a rank's reserved peak from 1.10 to 1.85 times the allocated
# one with the config (BENCHMARKS section 9): wide. On an H200 the reserved peak over the estimate
# was 0.98-1.10 over six configs of micro-batch 1 and 8, three precisions and two attention
# kernels (log sd 0.04, BENCHMARKS section 13); at 0.5 a 100 GiB config on the 140 GiB device
# had a 0.58 chance to fit before any trial. Ascend is not measured here: as wide as CPU.
KNOB_SD = {"cuda": 0.1}
KNOB_SD_DEFAULT = 0.5
OOM_EDGE = 0.05  # how far over the edge an out-of-memory trial is placed (log units)


def _budget(o: Observation, device: DeviceInfo | None) -> float | None:
    """The budget the trial was judged against (`estimate.budget_bytes`: the recipe's, else the
    device's memory); without the device, only a budget the recipe sets."""
    if device is not None:
        return float(budget_bytes(o.recipe, device))
    gb = o.recipe.hardware.memory_budget_gb
    return gb * 2**30 if gb else None


def _row(c: Config) -> list[float]:
    return [
        1.0,
        math.log2(c.micro_batch_size),
        c.amp == "O1",
        c.amp == "O2",
        c.recompute == "selective",
        c.recompute == "full",
        c.tp > 1,
        c.pp > 1,
        c.attention != "math",
        c.dp > 1 and c.dp_shard == "fsdp",
        c.compile != "none",
    ]


class MemoryModel:
    """log(measured / estimated peak) ~ N(x . beta, s^2), fitted with a ridge prior centred on the
    device's reserved/allocated ratio (`tuner.estimate.reserved_ratio_prior`), each knob's effect
    as wide as the device `family`'s `KNOB_SD`."""

    def __init__(
        self,
        observations: Sequence[Observation] = (),
        prior_ratio: float = 1.0,
        family: str = "",
        device: DeviceInfo | None = None,
    ):
        self.centre = math.log(prior_ratio)
        pairs = [
            (o.config, math.log(o.peak_mem_bytes / o.estimated_peak_mem_bytes))
            for o in observations
            if o.status == OK and o.peak_mem_bytes and o.estimated_peak_mem_bytes and o.peak_mem_bytes > 0
        ]
        # A trial that ran out of memory says its ratio was above budget / estimate; it enters as
        # a point just over that edge (its own peak, when reported, is only a lower bound).
        pairs += [
            (o.config, math.log(limit / o.estimated_peak_mem_bytes) + OOM_EDGE)
            for o in observations
            if o.status == OOM and o.estimated_peak_mem_bytes and (limit := _budget(o, device))
        ]
        p = len(_row(Config()))
        precision = np.eye(p) / KNOB_SD.get(family, KNOB_SD_DEFAULT) ** 2
        precision[0, 0] = 1.0 / RATIO_PRIOR_SD**2
        x = np.array([_row(c) for c, _ in pairs], dtype=float).reshape(len(pairs), p)
        y = np.array([r - self.centre for _, r in pairs])
        a = x.T @ x + precision * RATIO_PRIOR_SD**2  # in units of the misfit variance
        self.beta = np.linalg.solve(a, x.T @ y) if pairs else np.zeros(p)
        resid = y - x @ self.beta if pairs else np.zeros(0)
        # The misfit, shrunk towards the prior with three pseudo-points.
        self.sd = math.sqrt((float(resid @ resid) + 3 * RATIO_PRIOR_SD**2) / (len(pairs) + 3))
        self.cov = np.linalg.inv(a) * self.sd**2
        self.n = len(pairs)

    def log_ratio(self, configs: Sequence[Config]) -> tuple[np.ndarray, np.ndarray]:
        """(mean, sd) of the log ratio per config, the sd covering a new trial's scatter."""
        x = np.array([_row(c) for c in configs], dtype=float).reshape(len(configs), len(self.beta))
        var = np.einsum("ij,jk,ik->i", x, self.cov, x) + self.sd**2
        return x @ self.beta + self.centre, np.sqrt(var)

    def p_fit(self, configs: Sequence[Config], estimates: Sequence[float], budget: float) -> np.ndarray:
        """Probability that each config's measured peak stays within `budget` bytes."""
        mean, sd = self.log_ratio(configs)
        est = np.maximum(np.asarray(estimates, dtype=float), 1.0)
        z = (math.log(budget) - np.log(est) - mean) / sd
        return 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
