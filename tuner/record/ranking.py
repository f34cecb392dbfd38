"""The one definition of which trial is best (`rank_trials`): the ranking of a study's completed
trials by their median throughput over every measurement, with the loss-drift check against the
fp32 reference, the memory constraint, the runner-up, the tie rule and the steps of the best-so-far
line (`Ranking.improvements`). The summary, the worker, the build, the nightly, the REST API and
the dashboard all call it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tuner.record import keys
from tuner.record.trial import TrialRecord

# Largest relative gap, at any measured step, between a trial's loss and the fp32 (amp O0)
# reference trial of the same study (same seed, same data). Low-precision training drifts a
# little; a larger gap means the config computes something else and must not win.
LOSS_TOLERANCE = {"O0": 0.01, "bf16": 0.02, "fp16": 0.02}

# Relative sd of a config's throughput from one run (process) to the next, on top of what one
# run's own steps show: where the ranks land on the cores, clocks, the machine's other load. One
# run's step interval cannot see it, so an interval without it claims a precision that the next run
# does not keep (issue 16: 2 of 6 re-measurements inside the first run's interval). The prior per
# device family counts as RUN_NOISE_PRIOR_DOF degrees of freedom and is pooled with the study's own
# re-measurements. cpu: the 234 pairs of repeats in benchmarks/tables/cpu-gpt-tiny.csv differ by a
# median 5.9%, an sd of about 5% per run; the 5 runs of `tuner measure` in BENCHMARKS section 8
# spread by 24-31% (max/min). A dedicated accelerator repeats to about 1% (prior, not measured here).
RUN_NOISE_PRIOR = {"cpu": 0.05, "cuda": 0.01, "npu": 0.015}
RUN_NOISE_UNKNOWN = 0.03  # a study that does not say its device family
RUN_NOISE_PRIOR_DOF = 4.0
Z95 = 1.96


def run_noise(measurements: Iterable[Sequence[float]], family: str | None = None) -> float:
    """Run-to-run relative sd: the pooled sd of log throughput over the configs measured more than
    once (`measurements`: each config's throughputs), shrunk to the family's prior."""
    prior = RUN_NOISE_PRIOR.get(family or "", RUN_NOISE_UNKNOWN)
    squares, dof = RUN_NOISE_PRIOR_DOF * prior**2, RUN_NOISE_PRIOR_DOF
    for values in measurements:
        logs = [math.log(v) for v in values if v and v > 0]
        if len(logs) > 1:
            mean = statistics.fmean(logs)
            squares += sum((x - mean) ** 2 for x in logs)
            dof += len(logs) - 1
    return math.sqrt(squares / dof)


def throughput_interval(step_ci: float, noise: float, runs: int = 1) -> float:
    """Relative half-width of the 95% interval of a config's throughput over `runs` runs, each with
    the step interval `step_ci`: each run's steps and the run-to-run `noise` together."""
    return runs_interval([step_ci] * max(1, runs), noise)


def runs_interval(step_cis: Sequence[float], noise: float) -> float:
    """Relative half-width of the 95% interval of a config's throughput over its runs, run i with
    the step interval `step_cis[i]`: the mean of the runs, each off by its steps and by `noise`."""
    variance = sum(ci**2 + (Z95 * noise) ** 2 for ci in step_cis)
    return math.sqrt(variance) / max(1, len(step_cis))


def run_noise_ci(target_ci: float, noise: float) -> float:
    """The step interval worth measuring a run to where its own precision decides nothing: the
    recipe's `target_ci`, or the run-to-run `noise` where that is wider. Each run is off by about
    Z95 * noise from the next whatever its steps show, so steps measured tighter than `noise`
    hardly narrow the config's interval (at `noise` a run's interval is 12% wider than with
    perfect steps) and cost device time: a CPU measured to 3% instead of 5% runs about three times
    the steps. Re-measurements use it, and new trials clearly behind the best (`behind_line`)."""
    return max(target_ci, noise)


def contention_line(best_tokens_per_s: float, noise: float) -> float:
    """The throughput a new trial is out of contention below once its whole step interval is:
    the tie rule's line for two single runs, each off by Z95 * noise, so their gap's interval is
    sqrt(2) * Z95 * noise of the best wide. Below it the trial cannot tie with the best, let alone
    beat it, and its figure needs no tight interval. 86% of the best on a CPU (5% noise), 97% on
    a GPU (1%)."""
    return best_tokens_per_s * max(0.0, 1 - math.sqrt(2.0) * Z95 * noise)


def behind_line(best_tokens_per_s: float, noise: float) -> float:
    """The throughput a new trial is clearly behind the study's best below: further off it than
    one run's 95% run-to-run noise, so that a tighter step interval of its own cannot make it the
    winner (it may still be a tie: its interval says so). 90% of the best on a CPU (5% noise),
    98% on a GPU (1%)."""
    return best_tokens_per_s * (1 - Z95 * noise)


def rerun_interval(step_ci: float, noise: float) -> float:
    """Relative half-width of the 95% interval in which ANOTHER run of a config lands, around one
    run that had the step interval `step_ci`: the two runs differ by both runs' steps and twice the
    run-to-run `noise` (the second run's steps taken as wide as the first's). `throughput_interval`
    bounds the config's true throughput; a re-run is a second noisy draw, so it scatters sqrt(2)
    times as far (an interval of the true throughput covers a re-run about 83% of the time)."""
    return math.sqrt(2.0) * throughput_interval(step_ci, noise)


def throughput_bounds(tokens_per_s: float, half_width: float) -> tuple[float, float]:
    """(low, high) tokens/s of an interval whose relative half-width is on the step time, as every
    interval above is: a step time within (1 -+ h) of its median is a throughput in these."""
    return tokens_per_s / (1 + half_width), tokens_per_s / max(1e-9, 1 - half_width)


@dataclass(frozen=True)
class Ranked:
    """A completed trial as the ranking sees it."""

    trial: int
    config: dict[str, Any]  # the knobs that apply
    tokens_per_s: float  # median over the trial's measurement and its re-measurements
    remeasured_tokens_per_s: list[float]
    noise: float  # relative: the larger of the spread over measurements and within the trial's steps
    metrics: dict[str, Any]  # the public result keys as measured
    role: str | None
    constraint_ok: bool
    loss_drift: float | None = None
    loss_reference_trial: int | None = None
    flag: str | None = None  # why it cannot win (loss drift)
    # Relative half-width of the throughput's 95% interval (`throughput_interval`: the first
    # measurement's step interval and the run-to-run noise, over the runs), at least half the spread
    # over re-measurements. None for trials measured before intervals existed (the tie rule then
    # falls back to `noise`).
    ci: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Ranking:
    """Eligible trials best first, the ones excluded for loss drift, and the baseline."""

    ranked: tuple[Ranked, ...] = ()
    flagged: tuple[Ranked, ...] = ()
    baseline: Ranked | None = None
    reference: int | None = None  # the fp32 trial losses are checked against
    counts: dict[str, int] = field(default_factory=dict)
    run_noise: float | None = None  # the run-to-run sd the intervals were computed with

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None

    @property
    def runner_up(self) -> Ranked | None:
        return self.ranked[1] if len(self.ranked) > 1 else None

    @property
    def tie(self) -> bool:
        """The winner is within the measurement noise of the runner-up: either is fine.

        With intervals: the gap is within the 95% interval of the difference of the two throughputs
        (their half-widths added in quadrature). Without (older trials): the gap is within the
        larger noise (spread) of the two."""
        return self.runner_up is not None and self.tied_with_best(self.runner_up)

    def tied_with_best(self, entry: Ranked) -> bool:
        """`entry` is within the measurement noise of the best (the tie rule of `tie`)."""
        best = self.best
        if best is None:
            return False
        if best.ci is not None and entry.ci is not None:
            spread = difference_half_width(best.tokens_per_s, best.ci, entry.tokens_per_s, entry.ci)
            return best.tokens_per_s - entry.tokens_per_s <= spread
        gap = (best.tokens_per_s - entry.tokens_per_s) / best.tokens_per_s
        return gap <= max(best.noise, entry.noise)

    def improvements(self) -> list[Ranked]:
        """The steps of the best-so-far line, in trial order: each eligible trial that ranks above
        every eligible trial numbered before it (a tie goes to the earlier, as in the ranking).
        Trials are judged as the study ranks them now (the median over re-measurements, loss
        drift, the memory constraint), so the last step is `best`."""
        steps: list[Ranked] = []
        for entry in sorted(self.ranked, key=lambda e: e.trial):
            if not steps or entry.tokens_per_s > steps[-1].tokens_per_s:
                steps.append(entry)
        return steps

    @property
    def speedup(self) -> float | None:
        if self.best is None or self.baseline is None or not self.baseline.tokens_per_s:
            return None
        return self.best.tokens_per_s / self.baseline.tokens_per_s


def difference_half_width(a: float, a_ci: float, b: float, b_ci: float) -> float:
    """Half-width (tokens/s) of the 95% interval of the difference of two measured throughputs,
    each with its interval's relative half-width (`Ranked.ci`): the two added in quadrature. The
    one noise rule for "these differ": the tie rule, and the nightly verdict across nights."""
    return math.hypot(a * a_ci, b * b_ci)


def config_throughput(first: float | None, again: Sequence[float]) -> float:
    """What a study measured a config at: the median tokens/s over its trial's measurement (when
    it has one) and its re-measurements (a non-finite one, which no run can measure, left out).
    The ranking, the plan and the performance model's data all take this figure."""
    runs = finite_runs(again)
    return statistics.median([first, *runs] if first is not None else runs)


def finite_runs(values: Sequence[Any]) -> list[float]:
    """The re-measurements a run could have measured: numbers, finite."""
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _relative_spread(values: Sequence[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def ranked(
    t: TrialRecord, again: Sequence[float], run_sd: float | None = None, again_ci: Sequence[float] = ()
) -> Ranked:
    """`t` with its measurements folded into one median (it must have completed with a throughput);
    `run_sd`: the run-to-run noise (`run_noise`; None: the prior of an unknown family); `again_ci`:
    the re-measurements' step intervals (one missing counts as wide as the first measurement's)."""
    measured = [t.tokens_per_s, *again] if t.tokens_per_s is not None else list(again)
    run_sd = run_noise([]) if run_sd is None else run_sd
    config = t.config()
    ci = t.attrs.get(keys.STEP_TIME_CI)
    cis: list[float] = []
    if ci is not None:  # each run's step interval, the first measurement's first
        theirs = [c if c is not None else ci for c in again_ci][: len(again)]
        cis = [ci] * (t.tokens_per_s is not None) + theirs + [ci] * (len(again) - len(theirs))
    return Ranked(
        trial=t.number,
        config=config.active_params() if config is not None else dict(t.params),
        tokens_per_s=config_throughput(t.tokens_per_s, again),
        remeasured_tokens_per_s=list(again),
        noise=max(_relative_spread(measured), t.attrs.get(keys.STEP_TIME_SPREAD) or 0.0),
        metrics={k: t.attrs.get(k) for k in keys.RESULT_KEYS},
        role=t.role,
        constraint_ok=t.constraint_ok,
        ci=max(runs_interval(cis, run_sd), _relative_spread(measured) / 2) if ci is not None else None,
    )


def loss_drift(t: TrialRecord, reference: TrialRecord | None) -> float | None:
    """Largest relative gap between the trial's per-step losses and the reference's."""
    losses = t.attrs.get(keys.LOSSES) or []
    ref_losses = (reference.attrs.get(keys.LOSSES) or []) if reference else []
    pairs = list(zip(losses, ref_losses, strict=False))
    if not pairs:
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)


def tolerance(t: TrialRecord) -> float:
    if t.params.get("amp", "O0") == "O0":
        return LOSS_TOLERANCE["O0"]
    return LOSS_TOLERANCE.get(t.params.get("amp_dtype", "bf16"), LOSS_TOLERANCE["bf16"])


def rank_trials(
    trials: Iterable[TrialRecord],
    remeasured: Mapping[int, Sequence[float]],
    family: str | None = None,
    remeasured_ci: Mapping[int, Sequence[float]] | None = None,
) -> Ranking:
    """Rank a study's trials. `remeasured` holds each trial's re-measurements (tokens/s), and
    `remeasured_ci` their step intervals; `family` (the study's device family) picks the run-to-run
    noise prior they are pooled with.

    Eligible: completed with a throughput, within the memory constraint, and with losses within
    `LOSS_TOLERANCE` of the first fp32 trial's (the reference; it is eligible itself). Ordered by
    median tokens/s, then trial number.
    """
    trials = list(trials)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.status] = counts.get(t.status, 0) + 1
    # A throughput no run can measure (inf, from a study another version or program wrote) is not
    # a result: it won, and /best then answered null where its schema promises a number.
    complete = [t for t in trials if t.completed and t.tokens_per_s and math.isfinite(t.tokens_per_s)]
    repeated = [[t.tokens_per_s, *remeasured[t.number]] for t in complete if remeasured.get(t.number)]
    run_sd = run_noise(repeated, family)
    cis = remeasured_ci or {}
    fp32 = [t for t in complete if t.params.get("amp") == "O0"]
    reference = min(fp32, key=lambda t: t.number) if fp32 else None
    eligible, flagged = [], []
    for t in complete:
        entry = ranked(t, remeasured.get(t.number, []), run_sd, cis.get(t.number, ()))
        drift = loss_drift(t, reference) if t is not reference else 0.0
        extra = {"loss_drift": drift, "loss_reference_trial": reference.number if reference else None}
        if drift is not None and drift > tolerance(t):
            flag = f"loss drifts {drift:.1%} from the fp32 reference (trial {reference.number})"
            flagged.append(_with(entry, **extra, flag=flag))
        elif entry.constraint_ok:
            eligible.append(_with(entry, **extra))
    eligible.sort(key=lambda e: (-e.tokens_per_s, e.trial))
    base = _baseline(trials, complete)
    return Ranking(
        ranked=tuple(eligible),
        flagged=tuple(flagged),
        baseline=ranked(base, remeasured.get(base.number, []), run_sd, cis.get(base.number, ()))
        if base is not None
        else None,
        reference=reference.number if reference else None,
        counts=counts,
        run_noise=run_sd,
    )


def _baseline(trials: list[TrialRecord], complete: list[TrialRecord]) -> TrialRecord | None:
    """The first baseline trial that measured; where that baseline was a duplicate (another trial
    had run its very program, `keys.DUPLICATE_OF`), the trial whose measurement it reuses."""
    measured = {t.number: t for t in complete}
    for t in sorted(trials, key=lambda t: t.number):
        if t.role != keys.BASELINE:
            continue
        found = measured.get(t.number) or measured.get(t.attrs.get(keys.DUPLICATE_OF))
        if found is not None:
            return found
    return None


def _with(entry: Ranked, **changes: Any) -> Ranked:
    from dataclasses import replace

    return replace(entry, **changes)
