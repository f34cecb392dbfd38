"""`make_plan`: rank every feasible config of a recipe by predicted tokens/s without running one,
from the device table's priors and whatever the database measured on this fingerprint, also for
more devices than this machine has (then every number is an extrapolation, and says so)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tuner.baseline import baseline_config
from tuner.config import Config, run_key
from tuner.device_table import CATALOG_NODE_DEVICES
from tuner.devices import FAMILIES, DeviceInfo, describe, known_device, resolve_family
from tuner.estimate import reserved_ratio_prior
from tuner.perf.candidates import candidates
from tuner.perf.observations import Observation, fingerprint_observations, same_model
from tuner.perf.predictor import Predicted, Predictor
from tuner.perf.priors import DevicePriors, device_priors
from tuner.prune import calibration_factor, oom_floor, verdict
from tuner.recipe import Recipe
from tuner.record.status import OK, OOM
from tuner.space import SearchSpace, SpaceError, load_space

MAX_DEVICES = 1 << 16
MAX_TOP = 1000


class PlanError(ValueError):
    """Input a plan cannot be made for: `field` names what to fix; `example`, a value that would
    do, which each entry point words as its own option (`worded`): the command line's `--devices
    8`, REST's `?devices=8`. `str()` is the command line's wording."""

    def __init__(self, field: str, message: str, example: str | None = None, here: str = ""):
        self.field, self.message, self.example, self.here = field, message, example, here
        super().__init__(f"{field}: {self.worded(cli_option)}{here}")

    def worded(self, option: Callable[[str, str], str]) -> str:
        """The message with its example as `option(field, value)` spells it (without `here`: a
        way out only on the machine that has the files, which the command line's `str()` adds)."""
        if self.example is None:
            return self.message
        return f"{self.message}, e.g. {option(self.field, self.example)}"


def cli_option(field: str, value: str) -> str:
    return f"--{field} {value}"


@dataclass(frozen=True)
class PlanRow:
    rank: int
    config: dict[str, Any]  # the knobs that apply (as stored trial params name them)
    tokens_per_s: float  # predicted
    tokens_per_s_interval: tuple[float, float]  # 90%
    step_time_s: float
    estimated_peak_mem_bytes: int
    p_fit: float  # chance it fits the memory budget
    measured_tokens_per_s: float | None  # when this very config was measured on this fingerprint


@dataclass(frozen=True)
class Plan:
    recipe: str
    devices: int
    machine_devices: int
    extrapolated: bool  # more devices than any measured trial (or this machine) had
    observations: int  # measured trials the model was fitted to
    considered: int  # feasible configs ranked, one per run (`run_key`)
    basis: str  # one line: what the numbers rest on
    rows: list[PlanRow]
    why_none: str | None = None  # when nothing is feasible: why (the config closest to fitting's reason)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PlanOrder:
    """Every config a plan ranked, best first: where a given config landed (a plan lists only
    its top rows, and each run once: configs that run the same program share a `run_key`)."""

    pool: list[Config]
    order: np.ndarray  # indices into `pool`, best first
    predicted: Predicted | None  # None when nothing was feasible
    recipe: Recipe  # the recipe planned for, whose model decides which configs run the same program

    def place(self, config: Config) -> tuple[int, int] | None:
        """(the config's place in the plan, 1 first, counting each run once as the rows do; the
        index in `pool` of the config its row shows), None when it was not a ranked candidate."""
        want, seen = run_key(config, self.recipe), set()
        for i in self.order:
            key = run_key(self.pool[i], self.recipe)
            if key == want:
                return len(seen) + 1, int(i)
            seen.add(key)
        return None


def _for_devices(recipe: Recipe, devices: int, node: int) -> Recipe:
    """The recipe on `devices`, over whole nodes as a study would run it: its own nodes' size when
    it spans machines, else nodes of `node` devices once one cannot hold them all (tensor-parallel
    groups then stay inside a node, and the priors' cross-node link prices the larger groups)."""
    per_node = recipe.hardware.devices_per_node if recipe.hardware.nodes > 1 else node
    if devices <= per_node and recipe.hardware.nodes == 1:
        nodes = 1
    elif devices % per_node:
        up = -(-devices // per_node) * per_node
        raise PlanError(
            "devices",
            f"{devices} devices do not fill whole nodes of {per_node} (devices beyond one node come in "
            f"whole nodes); give a multiple of {per_node}",
            example=str(up),
        )
    else:
        nodes = devices // per_node
    hardware = recipe.hardware.model_copy(update={"devices": devices, "nodes": nodes})
    return recipe.model_copy(update={"hardware": hardware})


def check_plan_input(recipe: Recipe, devices: int | None, top: int) -> None:
    """The plan's own input rules, for the CLI and REST alike (raises PlanError)."""
    if devices is not None and not 1 <= devices <= MAX_DEVICES:
        raise PlanError("devices", f"give a device count from 1 to {MAX_DEVICES}", example="8")
    if not 1 <= top <= MAX_TOP:
        raise PlanError("top", f"give how many configs to list, from 1 to {MAX_TOP}", example="10")


def make_plan(
    recipe: Recipe,
    *,
    devices: int | None = None,
    top: int = 10,
    storage_url: str | None = None,
    device: DeviceInfo | None = None,
    priors: DevicePriors | None = None,
    observations: list[Observation] | None = None,
    catalogued: str | None = None,
    fingerprint: dict | None = None,
) -> Plan:
    """The plan for `recipe` on `devices` (default: the recipe's). Observations default to every
    measured trial on this machine's fingerprint in `storage_url` (none without one).
    `catalogued`: plan for a device of the catalogue (`tuner.device_table.CATALOG`, e.g. "H100")
    instead of this machine's, from its datasheet priors alone: before any GPU is booked.
    `fingerprint`: whose measured trials count, when `device` is not this machine's (a Ray
    cluster's nodes, `Executor.describe`)."""
    return ranked_plan(
        recipe, devices=devices, top=top, storage_url=storage_url, device=device, priors=priors,
        observations=observations, catalogued=catalogued, fingerprint=fingerprint,
    )[0]  # fmt: skip


def _checked_space(
    recipe: Recipe, device: DeviceInfo, catalogued: str | None, devices: int | None
) -> tuple[SearchSpace, Recipe]:
    """The recipe's space narrowed by its overrides, and the recipe on the devices planned for;
    PlanError when a config of it could never run (then nothing would be ranked): an override
    outside the space, no dp*tp*pp split of the count, or none that fits the shapes and batch."""
    n = devices or recipe.hardware.devices
    try:
        space = load_space(_space_name(recipe, device.family, catalogued)).narrow(recipe.search.overrides)
    except SpaceError as err:
        raise PlanError(err.field or "search.space", err.message, here=err.here) from None
    # One CPU machine holds every rank (ranks beyond its cores share them); accelerators come in
    # nodes of this machine's count (a cluster's largest node, a catalogued server's).
    node = (device.count or n) if device.family != "cpu" else max(n, recipe.hardware.devices_per_node)
    target = _for_devices(recipe, n, node)
    problem = space.shape_problem(target)
    if problem is not None and problem.field == "hardware.devices" and devices is not None:
        # The count asked for, not the recipe's: the way out is another --devices / ?devices=.
        raise PlanError("devices", problem.why, example=problem.devices and str(problem.devices))
    if problem is not None:
        raise PlanError(*problem.pair())
    return space, target


def ranked_plan(
    recipe: Recipe,
    *,
    devices: int | None = None,
    top: int = 10,
    storage_url: str | None = None,
    device: DeviceInfo | None = None,
    priors: DevicePriors | None = None,
    observations: list[Observation] | None = None,
    catalogued: str | None = None,
    fingerprint: dict | None = None,
) -> tuple[Plan, PlanOrder]:
    """`make_plan`, and where every ranked config landed."""
    check_plan_input(recipe, devices, top)
    n = devices or recipe.hardware.devices
    if catalogued is not None:
        # Nothing measured on this machine says how that one runs: its priors alone.
        try:  # described as one server of it: a larger count spans servers
            device, observations = known_device(catalogued, count=min(n, CATALOG_NODE_DEVICES)), []
        except ValueError as err:  # not in the catalogue: the error lists what is
            raise PlanError("device", str(err), example="H100") from None
    # A given device may be one this machine lacks (a study's, read from its fingerprint).
    family = device.family if device else resolve_family(recipe.hardware.device)
    device = device or describe(family)
    space, target = _checked_space(recipe, device, catalogued, devices)
    if observations is None:
        observations = _stored(storage_url, fingerprint or _here(family), target) if storage_url else []
    observations = same_model(observations, target)
    # Feasibility counts the devices asked for, not this machine's: a plan may go beyond it.
    wide = dataclasses.replace(device, count=max(device.count, n))
    predictor = Predictor(device, priors or device_priors(device)).fit(observations)
    same = [o for o in observations if o.recipe.hash() == target.hash() and o.peak_mem_bytes]
    # Completed trials only, as the study calibrates (`study_calibration`): an out-of-memory
    # trial's peak is only a lower bound, and high by selection.
    pairs = [(o.peak_mem_bytes, o.estimated_peak_mem_bytes) for o in same if o.status == OK]
    calibration = calibration_factor(pairs, prior=reserved_ratio_prior(device.family))
    best = sorted((o for o in same if o.tokens_per_s), key=lambda o: -(o.tokens_per_s or 0))[:3]
    # The baseline's neighbours are always ranked, even when the space is only sampled.
    around = [baseline_config(target, wide, space), *(o.config for o in best)]
    # What ran out of memory bounds what else may fit, as in the study (`oom_floor`).
    floor = oom_floor(
        (o.config, o.estimated_peak_mem_bytes, o.trial if o.trial is not None else -1)
        for o in observations
        if o.status == OOM and o.recipe.hash() == target.hash()
    )
    every, _ = candidates(space, target, wide, around=around)
    works, feats = predictor.features(target, every)  # each estimate made once: verdict reuses it
    keep = [
        i
        for i, (c, w) in enumerate(zip(every, works, strict=True))
        if verdict(c, target, wide, calibration, floor, est=w.estimate).reason is None
    ]
    pool = [every[i] for i in keep]
    order = _order(predictor, target, pool, ([works[i] for i in keep], feats.take(keep)))
    rows = _rows(order, same, top, target)
    measured_ranks = max((o.config.world_size for o in observations), default=0)
    extrapolated = catalogued is not None or n > device.count or bool(observations) and n > measured_ranks
    plan = Plan(
        recipe=recipe.name,
        devices=n,
        machine_devices=device.count,
        extrapolated=extrapolated,
        observations=len(observations),
        considered=len({run_key(c, target) for c in pool}),
        basis=_basis(observations, n, device, measured_ranks, catalogued),
        rows=rows,
        why_none=None if pool else _why_none(space, target, wide, every, works, calibration, floor),
    )
    return plan, order


def _why_none(
    space, recipe: Recipe, device: DeviceInfo, every: list[Config], works, calibration, floor
) -> str:
    """Why a plan found no config to rank: the reason the config with the smallest estimated peak
    (the closest to fitting) was refused, else why no config of the space can run the recipe."""
    if every:
        i = min(range(len(every)), key=lambda j: works[j].peak_mem_bytes)
        reason = verdict(every[i], recipe, device, calibration, floor, est=works[i].estimate).reason
        return f"even the config with the smallest estimated peak is refused: {reason}"
    problem = space.shape_problem(recipe)
    if problem is not None:
        return f"{problem.field}: {problem.why}"
    return "no config of the search space can run this recipe on these devices"


def _space_name(recipe: Recipe, family: str, catalogued: str | None) -> str:
    """The recipe's space; for a catalogued device, that device family's own space where the
    recipe names another family's (a CPU recipe planned for an H100)."""
    name = recipe.search.space or family
    if catalogued is not None and name in FAMILIES and name != family:
        return family
    return name


def _here(family: str) -> dict:
    from tuner.fingerprint import fingerprint

    return fingerprint(family)


def _stored(url: str, fp: dict, recipe: Recipe) -> list[Observation]:
    from tuner.fingerprint import fingerprint_hash

    return fingerprint_observations(url, fingerprint_hash(fp), recipe)


def _order(predictor: Predictor, recipe: Recipe, pool: list[Config], cached) -> PlanOrder:
    if not pool:
        return PlanOrder(pool, np.zeros(0, dtype=int), None, recipe)
    p = predictor.predict(recipe, pool, cached)
    # Rank by what a run is expected to deliver: a config that may not fit counts for less.
    # Among equals (within 1%: knobs the model has no evidence on) the plainer config comes first,
    # and among equally plain ones the higher expectation.
    default = Config()
    plain = np.array([sum(1 for k, v in c.active_params().items() if v != getattr(default, k)) for c in pool])
    expected = p.tokens_per_s * np.minimum(1.0, p.p_fit / 0.5)
    value = np.round(np.log(expected) / 0.01)
    return PlanOrder(pool, np.lexsort((-expected, plain, -value)), p, recipe)


def _rows(order: PlanOrder, same: list[Observation], top: int, recipe: Recipe) -> list[PlanRow]:
    p, pool = order.predicted, order.pool
    if p is None:
        return []
    measured = {run_key(o.config, recipe): o.tokens_per_s for o in same if o.tokens_per_s}
    # One row per run: configs that run the same program (`run_key`) rank once, the plainer first.
    firsts, seen = [], set()
    for i in order.order:
        if len(firsts) == top:
            break
        if (k := run_key(pool[i], recipe)) not in seen:
            seen.add(k)
            firsts.append((i, k))
    return [
        PlanRow(
            rank=rank,
            config=pool[i].active_params(),
            tokens_per_s=round(float(p.tokens_per_s[i]), 1),
            tokens_per_s_interval=(round(float(p.tokens_low[i]), 1), round(float(p.tokens_high[i]), 1)),
            step_time_s=round(float(p.step_time_s[i]), 6),
            estimated_peak_mem_bytes=int(p.estimated_peak_mem_bytes[i]),
            p_fit=round(float(p.p_fit[i]), 3),
            measured_tokens_per_s=measured.get(k),
        )
        for rank, (i, k) in enumerate(firsts, 1)
    ]


def _basis(
    observations: list[Observation], n: int, device: DeviceInfo, measured_ranks: int, catalogued: str | None
) -> str:
    if catalogued is not None:
        return f"the catalogued {device.name}'s datasheet priors only (no trial measured on one)"
    if not observations:
        head = "device-table priors only (no measured trial of this model on this machine's fingerprint)"
    else:
        head = (
            f"fitted to {len(observations)} measured trials of this model on this fingerprint "
            f"(up to {measured_ranks} ranks)"
        )
    if n > device.count:
        return f"{head}; a prediction for {n} devices, beyond this machine's {device.count}"
    if observations and n > measured_ranks:
        return f"{head}; a prediction for {n} ranks, more than any measured trial had"
    return head
