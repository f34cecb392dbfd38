"""A memory budget between two configs, for the tests of pruning by the estimator."""

from __future__ import annotations

from tuner.config import Config
from tuner.devices import describe
from tuner.estimate import estimate, reserved_ratio_prior
from tuner.prune import OOM_MARGIN

CPU = describe("cpu")


def budget_between(recipe, fits: Config, too_big: Config, fits_under: float) -> float:
    """A memory budget (GiB) that prunes `too_big` before it runs, with `fits`'s estimate below
    `fits_under` times it. Both estimates are scaled as a study starts, by the device's
    reserved/allocated prior, as the executor's reading is: it fails a trial whose measured reserved
    peak (on CPU the resident set's growth, glibc's retained heap included) exceeds the budget, and
    that is about the prior times the estimate. A budget placed against the bare estimate left a
    real micro-batch-8 trial within 3% of it, and it ran out of memory in one CI run of three."""
    prior = reserved_ratio_prior(CPU.family)
    est_fits, est_big = (estimate(recipe, c, CPU).peak_mem_bytes * prior for c in (fits, too_big))
    budget = est_big / (1 + OOM_MARGIN) * 0.97
    assert est_fits < budget * fits_under, "the two configs are too close in memory for this test"
    return budget / 2**30
