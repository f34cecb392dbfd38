"""The plan of a study's own recipe, fitted to the study's own measured trials with no device run,
next to what the study found for each planned config: the job page's "plan against the study"."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tuner.config import Config, run_key, short_config
from tuner.device_table import CATALOG
from tuner.devices import (
    DeviceInfo,
    available_families,
    cpu_model_id,
    describe,
    known_device,
    resolve_family,
    same_cpu,
)
from tuner.perf.observations import observation
from tuner.perf.plan import Plan, PlanError, PlanOrder, make_plan, ranked_plan
from tuner.perf.priors import DevicePriors, recorded_priors
from tuner.recipe import Recipe, RecipeError, recipe_from_dict
from tuner.record import keys
from tuner.record.ranking import Ranked, Ranking
from tuner.record.status import OK, OOM
from tuner.record.trial import TrialRecord

TOP = 10
# Measured trials the fit reads, evenly spaced over the study: a 10,000-trial study costs what a
# 1,000-trial one does, and twenty-odd coefficients are pinned long before that.
MAX_FIT = 1000


@dataclass(frozen=True)
class StudyResult:
    """What the study did with one config."""

    trial: int
    status: str  # ok, oom, error, timeout, pruned, ...
    tokens_per_s: float | None  # the ranking's figure (over re-measurements) when it ran
    study_rank: int | None  # its place among the configs the study ranked (1: the study's best)
    note: str | None  # why it failed, was pruned, or cannot win


@dataclass(frozen=True)
class StudyPlanRow:
    rank: int  # in the plan
    config: dict[str, Any]
    label: str  # the config in one line
    tokens_per_s: float  # predicted
    tokens_per_s_interval: tuple[float, float]  # 90%
    p_fit: float
    study: StudyResult | None  # None: the study never tried it


@dataclass(frozen=True)
class StudyPlan:
    available: bool
    reason: str | None  # why there is no plan, when there is none
    basis: str  # one line: what the numbers rest on
    fitted: int  # measured trials the model was fitted to
    learnable: int  # the study's trials it could learn from (ok or out of memory)
    considered: int  # feasible configs ranked
    study_ranked: int  # configs the study ranked
    rows: list[StudyPlanRow]
    study_best: dict[str, Any] | None  # the study's winner and where the plan put it
    seconds: float  # to make this plan

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def unavailable(reason: str) -> StudyPlan:
    return StudyPlan(False, reason, "", 0, 0, 0, 0, [], None, 0.0)


def plan_device(
    fingerprint: dict[str, Any], recorded: Any = None
) -> tuple[DeviceInfo | None, DevicePriors | None, str]:
    """The device the study ran on, as far as this machine can describe it, the priors to start
    from (`recorded`, the study's `keys.DEVICE_PRIORS`, where it kept what its devices measured of
    themselves; None: the device's own here), and a note when the description or the priors are
    borrowed (no device, no priors and the reason when it cannot be described)."""
    family, name = fingerprint.get("family"), str(fingerprint.get("device") or "")
    count = fingerprint.get("device_count")
    priors = recorded_priors(recorded, str(family))
    if family == "cpu":
        here = describe("cpu")
        device = dataclasses.replace(here, count=int(count or here.count))
        if same_cpu(fingerprint, here):
            return device, priors, ""
        if priors is not None:
            return (
                device,
                priors,
                f"; CPU priors as the study's {fingerprint.get('cpu') or 'CPU'} measured them",
            )
        return device, None, f"; CPU priors from this server's {here.name} ({cpu_model_id()})"
    if family in ("cuda", "npu"):
        if family in available_families() and describe(family).name == name:
            here = describe(family)
            return dataclasses.replace(here, count=int(count or here.count)), priors, ""
        for key, entry in CATALOG.items():
            if entry.family == family and (entry.name == name or key in name):
                note = f"; {name} described from the device catalogue"
                return known_device(key, int(count or 8)), priors, note
    return None, None, f"the study ran on {name or 'an unrecorded device'}, which this server cannot describe"


WHERE_JOBS_RAN = "the devices this service's jobs ran on"


def service_plan(recipe: Recipe, storage_url: str, *, devices: int | None = None, top: int = TOP) -> Plan:
    """POST /v1/plans without a catalogued device: the plan for the devices the service's newest
    job of the recipe's device family ran on (what its workers reach: a Ray cluster's nodes, which
    the API host need not have), fitted to what was measured there. Before any job ran, this
    machine's own devices, as `tuner plan` here would plan."""
    from tuner.db import session_scope
    from tuner.record.studies import job_fingerprints

    with session_scope(storage_url) as s:
        ran = job_fingerprints(s)
    if not ran:
        plan = make_plan(recipe, devices=devices, top=top, storage_url=storage_url)
        return dataclasses.replace(
            plan, basis=f"{plan.basis}; no job of this service has run yet: this server's devices"
        )
    families = list(dict.fromkeys(str(fp.get("family")) for _, fp, _ in ran))
    family = resolve_family(recipe.hardware.device, families, WHERE_JOBS_RAN)
    job, fp, recorded = next(r for r in ran if r[1].get("family") == family)
    device, priors, note = plan_device(fp, recorded)
    if device is None:
        raise PlanError("hardware.device", note)
    plan = make_plan(
        recipe,
        devices=devices,
        top=top,
        storage_url=storage_url,
        device=device,
        priors=priors,
        fingerprint=fp,
    )
    # The job's own device name: a CPU node the server is not is described with the server's.
    ran_on = fp.get("device") or device.name
    return dataclasses.replace(plan, basis=f"{plan.basis}; for the {ran_on} job {job} ran on{note}")


def _evenly(items: list[TrialRecord], k: int) -> list[TrialRecord]:
    if len(items) <= k:
        return items
    step = len(items) / k
    return [items[int(i * step)] for i in range(k)]


def _result(t: TrialRecord, ranking: Ranking, place: dict[int, int], flags: dict[int, Ranked]) -> StudyResult:
    if t.number in place:
        rank = place[t.number]
        return StudyResult(t.number, t.status, ranking.ranked[rank - 1].tokens_per_s, rank, None)
    flagged = flags.get(t.number)
    if flagged is not None:
        return StudyResult(t.number, t.status, flagged.tokens_per_s, None, flagged.flag)
    if t.completed and t.tokens_per_s:  # ranked neither way: outside the memory constraint
        return StudyResult(t.number, t.status, t.tokens_per_s, None, "over the memory budget")
    note = t.attrs.get(keys.ERROR) or t.attrs.get(keys.PRUNED_REASON)
    return StudyResult(t.number, t.status, None, None, str(note)[:200] if note else None)


def _weight(r: StudyResult) -> int:
    return 2 if r.study_rank else 1 if r.tokens_per_s is not None else 0


def _results(
    trials: Sequence[TrialRecord], ranking: Ranking, wanted: Sequence[Config], recipe: Recipe
) -> dict[str, StudyResult]:
    """`run_key` of each config of `wanted` -> what the study did with that run (a plan row
    stands for every config that runs the same program, and the study measured one of them): a
    ranked measurement before any other, a measurement before a failure, else the latest outcome."""
    want = {run_key(c, recipe) for c in wanted}
    # Rebuilding every trial's config costs 0.2 ms each (2 s at 10,000 trials): a look at the
    # batch, split and AMP level first leaves only the few trials that could be one of `wanted`.
    quick = {(c.micro_batch_size, c.dp, c.tp, c.pp, c.amp) for c in wanted}
    place = {r.trial: i for i, r in enumerate(ranking.ranked, 1)}
    flags = {r.trial: r for r in ranking.flagged}
    out: dict[str, StudyResult] = {}
    for t in trials:
        p = t.params
        glance = tuple(p.get(k) for k in ("micro_batch_size", "dp", "tp", "pp", "amp"))
        if (
            not t.finished
            or t.attrs.get(keys.DUPLICATE_OF) is not None
            or (None not in glance and glance not in quick)
        ):
            continue
        config = t.config()
        key = run_key(config, recipe) if config is not None else None
        if key not in want:
            continue
        result, held = _result(t, ranking, place, flags), out.get(key)
        if held is None or _weight(result) >= _weight(held):
            out[key] = result
    return out


def study_plan(
    recipe_dict: dict[str, Any],
    fingerprint: dict[str, Any],
    trials: Sequence[TrialRecord],
    ranking: Ranking,
    *,
    top: int = TOP,
    priors_attr: Any = None,
) -> StudyPlan:
    """The plan for the study's recipe on its devices, fitted to (at most `MAX_FIT` of) its own
    measured trials, each row with what the study measured for that config. `priors_attr`:
    the study's `keys.DEVICE_PRIORS`, what its devices measured of themselves."""
    started = time.perf_counter()
    if not recipe_dict:
        return unavailable("the study records no recipe to plan")
    try:
        recipe = recipe_from_dict(recipe_dict)
    except (RecipeError, ValueError, TypeError):
        return unavailable("the study's recipe was written by another version of the tuner")
    device, priors, note = plan_device(fingerprint, priors_attr)
    if device is None:
        return unavailable(note)
    runs = [
        t
        for t in trials
        if t.finished and t.attrs.get(keys.STATUS) in (OK, OOM) and t.attrs.get(keys.DUPLICATE_OF) is None
    ]
    again = {e.trial: e.remeasured_tokens_per_s for e in (*ranking.ranked, *ranking.flagged)}
    picked = [observation(recipe, t.params, t.attrs, again.get(t.number, ())) for t in _evenly(runs, MAX_FIT)]
    fitted = [o for o in picked if o is not None]
    try:
        plan, order = ranked_plan(recipe, top=top, device=device, priors=priors, observations=fitted)
    except (PlanError, ValueError) as err:
        return unavailable(f"cannot plan this study's recipe: {err}")
    winner = _winner(trials, ranking)
    configs = [Config.from_params(r.config) for r in plan.rows]
    results = _results(trials, ranking, configs, recipe)
    rows = [
        StudyPlanRow(
            r.rank,
            r.config,
            short_config(r.config),
            r.tokens_per_s,
            r.tokens_per_s_interval,
            r.p_fit,
            results.get(run_key(c, recipe)),
        )
        for r, c in zip(plan.rows, configs, strict=True)
    ]
    basis = f"fitted to {len(fitted)} of this study's {len(runs)} measured trials"
    if len(picked) < len(runs):
        basis += " (evenly spaced)"
    return StudyPlan(
        available=True,
        reason=None,
        basis=basis + note,
        fitted=len(fitted),
        learnable=len(runs),
        considered=plan.considered,
        study_ranked=len(ranking.ranked),
        rows=rows,
        study_best=_best(winner, ranking, order),
        seconds=round(time.perf_counter() - started, 3),
    )


def _winner(trials: Sequence[TrialRecord], ranking: Ranking) -> TrialRecord | None:
    best = ranking.best
    return next((t for t in trials if t.number == best.trial), None) if best else None


def _best(winner: TrialRecord | None, ranking: Ranking, order: PlanOrder) -> dict[str, Any] | None:
    best = ranking.best
    config = winner.config() if winner else None
    if best is None or config is None:
        return None
    placed = order.place(config)  # its run's place, as the plan's rows count them
    rank = placed[0] if placed is not None else None
    predicted = None
    if placed is not None and order.predicted is not None:
        predicted = round(float(order.predicted.tokens_per_s[placed[1]]), 1)
    return {
        "trial": best.trial,
        "tokens_per_s": best.tokens_per_s,
        "label": short_config(best.config),
        "plan_rank": rank,
        "predicted_tokens_per_s": predicted,
    }
