"""Search spaces: each knob's domain for one device family (search_spaces/*.yaml), and how a
trial samples a `Config` from it with conditional knobs."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuner.config import KNOBS, Config, ConfigError, infeasible_reasons, shape_reasons
from tuner.devices import FAMILIES, DeviceInfo
from tuner.recipe import Recipe, RecipeError, load_document, read_text_file

# The repo root holds search_spaces/; with `pip install -e .` the package sits next to it.
SPACES_DIR = Path(__file__).resolve().parent.parent / "search_spaces"

# The parallel split is one categorical so dp * tp * pp == devices always holds; dp, tp and pp
# are also recorded as params (not sampled) so trial params keep the canonical knob names.
SPLIT_PARAM = "parallel"
_DEGREES = ("dp", "tp", "pp")


class SpaceError(ValueError):
    """A search space file, or an override of it, that cannot be used. An override's error names
    its `field` (`search.overrides.<knob>`) and keeps apart the `file` the values come from: `str()`
    offers editing it (the command line runs where the file is), `for_client` does not (a REST
    client cannot reach the server's disk)."""

    def __init__(self, message: str, field: str | None = None, file: str | None = None):
        self.message, self.field, self.file = message, field, file
        super().__init__(f"{field}: {message}{self.here}" if field else f"{message}{self.here}")

    @property
    def here(self) -> str:
        """The way out only the machine that has the file offers (the command line's)."""
        return f" (or edit {self.file})" if self.file else ""

    def for_client(self, hint: str) -> tuple[str, str]:
        """(field, message) for an entry point whose user has no server files: `hint` instead."""
        return self.field or "search.overrides", self.message + (hint if self.file else "")


@dataclass(frozen=True)
class ShapeProblem:
    """Why no config of a space can run a recipe (`SearchSpace.shape_problem`): the recipe `field`
    to change and `why`; where the device count is that field, `devices` is the nearest count at
    which a split fits (None: none near), for each entry point to offer as its own option."""

    field: str
    why: str
    devices: int | None = None

    def pair(self) -> tuple[str, str]:
        """(field, message) with the fix worded for the recipe."""
        if self.field != "hardware.devices":
            return self.field, self.why
        fix = f"set hardware.devices to {self.devices}" if self.devices else "change hardware.devices"
        return self.field, f"{self.why}; {fix}"


def split_label(dp: int, tp: int, pp: int) -> str:
    return f"dp{dp}-tp{tp}-pp{pp}"


def _parse_split(label: str) -> tuple[int, int, int]:
    dp, tp, pp = (int(part[2:]) for part in label.split("-"))
    return dp, tp, pp


@functools.lru_cache(maxsize=256)
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


@functools.lru_cache(maxsize=1024)
def _splits(allowed: tuple[tuple[int, ...], ...], devices: int) -> tuple[tuple[int, int, int], ...]:
    """The (dp, tp, pp) of those domains that multiply to `devices`. Cached: a plan or a sampled
    pool asks again for every config it draws or checks (over 12,000 times; on 4,096 devices the
    divisors alone took half a minute)."""
    return tuple(s for s in itertools.product(*allowed) if s[0] * s[1] * s[2] == devices)


def _applies(name: str, values: dict[str, Any]) -> bool:
    """Whether a conditional knob matters for the knobs chosen so far (see Config.normalized)."""
    if name == "pp_schedule":
        return values["pp"] > 1
    if name == "dp_shard":
        return values["dp"] > 1
    if name in ("bucket_mb", "grad_compression"):
        return values["dp"] > 1 and values["dp_shard"] == "ddp"
    if name == "amp_dtype":
        return values["amp"] != "O0"
    if name == "recompute_layers":
        return values["recompute"] != "none"
    if name == "sequence_parallel":
        return values["tp"] > 1
    return True


# Sampling order: a conditional knob comes after the knobs it depends on.
_ORDER = (
    "micro_batch_size",
    "dp_shard",
    "pp_schedule",
    "bucket_mb",
    "grad_compression",
    "recompute",
    "recompute_layers",
    "sequence_parallel",
    "offload",
    "attention",
    "amp",
    "amp_dtype",
    "tf32",
    "compile",
    "optimizer_impl",
    "loader_workers",
    "pin_memory",
    "cpu_affinity",
    "alloc_conf",
)
assert set(_ORDER) | set(_DEGREES) == set(KNOBS)


@dataclass(frozen=True)
class SearchSpace:
    """Domains of every knob. dp/tp/pp domains of None mean "every divisor of the devices"."""

    name: str
    family: str
    domains: dict[str, tuple[Any, ...] | None]
    source: str = ""

    def splits(self, devices: int) -> list[tuple[int, int, int]]:
        """Every (dp, tp, pp) in the domains with dp * tp * pp == devices."""
        allowed = tuple(tuple(self.domains[d] or ()) or _divisors(devices) for d in _DEGREES)
        return list(_splits(allowed, devices))

    def narrow(self, overrides: dict[str, list[Any]]) -> SearchSpace:
        """Restrict domains to a recipe's `search.overrides`; values must lie in the space."""
        domains = dict(self.domains)
        for name, raw_values in overrides.items():
            field = f"search.overrides.{name}"
            knob = KNOBS.get(name)
            if knob is None:
                raise SpaceError(f"unknown knob; valid knobs: {', '.join(KNOBS)}", field)
            if not isinstance(raw_values, list) or not raw_values:
                raise SpaceError(f"give a non-empty list of values, e.g. {name}: [...]", field)
            values = []
            for raw in raw_values:
                try:
                    value = knob.parse(raw)
                except ConfigError as err:
                    raise SpaceError(str(err), field) from None
                current = domains[name]
                if current is not None and value not in current:
                    raise SpaceError(
                        f"{raw!r} is not in the {self.name} space; choose from {_show(current)}",
                        field,
                        self.source or self.name,
                    )
                if value not in values:
                    values.append(value)
            domains[name] = tuple(values)
        return replace(self, domains=domains)

    def contains(self, config: Config, devices: int) -> bool:
        """Whether `config` could have been sampled from this space (enqueue needs that)."""
        if (config.dp, config.tp, config.pp) not in self.splits(devices):
            return False
        chosen = config.to_dict()
        return all(chosen[n] in self.domains[n] for n in _ORDER if _applies(n, chosen) and self.domains[n])

    def shape_problem(self, recipe: Recipe) -> ShapeProblem | None:
        """Why no config of this space can run the recipe, so a study would prune every trial:
        no split multiplies to its devices, or none fits the model's shapes (say kv_heads 1 with
        every allowed tp > 1) or the global batch; else None."""
        n = recipe.hardware.devices
        splits = self.splits(n)
        if not splits:
            why = f"no dp*tp*pp split of the space (search.overrides dp, tp, pp) multiplies to {n}"
            return ShapeProblem("hardware.devices", why, self.fitting_devices(recipe))
        reasons = self._split_reasons(recipe, splits)
        if not all(reasons):
            return None
        field, message = reasons[0][0]
        allowed = _some((split_label(*s) for s in splits), ", ")
        if all(r[0][0] == field for r in reasons):
            why = f"{message} in every split the space allows ({allowed}); widen search.overrides or change {field}"
            return ShapeProblem(field, why)
        # Each split fails for its own reason: the device count is what to change.
        each = _some(f"{split_label(*s)}: {r[0][1]}" for s, r in zip(splits, reasons, strict=True))
        why = f"no split of {n} devices fits the model and batch ({each})"
        return ShapeProblem("hardware.devices", why, self.fitting_devices(recipe))

    def _split_reasons(
        self, recipe: Recipe, splits: list[tuple[int, int, int]]
    ) -> list[list[tuple[str, str]]]:
        """Per split, every way it does not fit the model's shapes or the global batch."""
        return [
            shape_reasons(Config(dp=dp, tp=tp, pp=pp), recipe) + self._batch_reasons(recipe, dp, pp)
            for dp, tp, pp in splits
        ]

    def fitting_devices(self, recipe: Recipe) -> int | None:
        """The device count nearest the recipe's at which some split fits its shapes and batch
        (the shapes do not depend on the count; which splits exist does)."""
        n = recipe.hardware.devices
        for k in sorted(range(1, 2 * n + 9), key=lambda k: (abs(k - n), k)):
            splits = self.splits(k)
            if splits and not all(self._split_reasons(recipe, splits)):
                return k
        return None

    def _batch_reasons(self, recipe: Recipe, dp: int, pp: int) -> list[tuple[str, str]]:
        """The global batch fits no micro-batch size of the space at this dp (and pp's microbatches)."""
        gbs, sizes = recipe.train.global_batch_size, self.domains.get("micro_batch_size") or ()
        if not sizes or any(gbs % (m * dp) == 0 and gbs // (m * dp) >= pp for m in sizes):
            return []
        why = f"global batch ({gbs}) splits into no micro_batch_size*dp with dp={dp}"
        return [("train.global_batch_size", why + (f" and {pp} microbatches" if pp > 1 else ""))]

    def suggest(self, trial: Any, recipe: Recipe, device: DeviceInfo) -> Config:
        """Sample a Config in an Optuna trial; knobs that do not apply are not sampled at all."""
        labels = [split_label(*s) for s in self.splits(recipe.hardware.devices)]
        if not labels:
            raise SpaceError(
                f"{self.source or self.name}: no dp*tp*pp split equals hardware.devices "
                f"({recipe.hardware.devices}); widen dp/tp/pp or change hardware.devices"
            )
        chosen: dict[str, Any] = dict(
            zip(_DEGREES, _parse_split(trial.suggest_categorical(SPLIT_PARAM, labels)), strict=True)
        )
        degrees = _divisors(recipe.hardware.devices)
        for name in _DEGREES:
            _record(trial, name, chosen[name], degrees)
        default = Config()
        for name in _ORDER:
            if _applies(name, chosen):
                chosen[name] = trial.suggest_categorical(name, list(self.domains[name]))
            else:
                chosen[name] = getattr(default, name)
        return Config(**chosen)

    def configs(self, recipe: Recipe, device: DeviceInfo, feasible_only: bool = True) -> Iterator[Config]:
        """Every distinct config of the space (for grid search and benchmarks).

        With `feasible_only`, configs the feasibility rules reject for this recipe and device
        are skipped.
        """
        for config, feasible in self.walk(recipe, device, feasible_only):
            if feasible:
                yield config

    def walk(self, recipe: Recipe, device: DeviceInfo, judge: bool = True) -> Iterator[tuple[Config, bool]]:
        """Every config `configs` looks at, with whether it is feasible (`judge`; else all are):
        a caller can stop after so many looks, which a sparse space's `configs` may not give it.
        A split that misfits the model's shapes is skipped whole: no other knob can fix it."""
        for split in self.splits(recipe.hardware.devices):
            chosen = dict(zip(_DEGREES, split, strict=True))
            if judge and shape_reasons(Config(**chosen), recipe):
                continue
            for config in self._expand(chosen, 0):
                yield config, not judge or not infeasible_reasons(config, recipe, device)

    def _expand(self, chosen: dict[str, Any], i: int) -> Iterator[Config]:
        if i == len(_ORDER):
            yield Config(**chosen)
            return
        name = _ORDER[i]
        values = self.domains[name] if _applies(name, chosen) else (getattr(Config(), name),)
        for value in values:
            yield from self._expand({**chosen, name: value}, i + 1)


def _record(trial: Any, name: str, value: Any, choices: list[Any]) -> None:
    """Store a knob that follows from an earlier choice as a param, without sampling it.

    Optuna has no public call for this; a fixed param is how `enqueue_trial` does the same. The
    choices stay the same in every trial, since Optuna rejects a categorical whose choices change.
    """
    fixed = getattr(trial, "_fixed_params", None)
    if fixed is not None:
        fixed[name] = value
    got = trial.suggest_categorical(name, choices)
    assert got == value, f"{name}: recorded {got!r}, expected {value!r}"


def trial_params(config: Config) -> dict[str, Any]:
    """The Optuna params `SearchSpace.suggest` would record for `config` (for enqueue_trial)."""
    params = config.active_params()
    params[SPLIT_PARAM] = split_label(config.dp, config.tp, config.pp)
    return params


def config_from_params(params: dict[str, Any]) -> Config:
    """The Config of a stored trial (its params minus the split label)."""
    return Config.from_params({k: v for k, v in params.items() if k != SPLIT_PARAM})


def _show(values: tuple[Any, ...]) -> str:
    return ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values)


def _space_path(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or path.exists() or "/" in text:
        return path
    return SPACES_DIR / f"{text}.yaml"


def _some(items: Iterable[str], sep: str = "; ", shown: int = 4) -> str:
    """The first `shown` of `items` joined, and how many more (4,096 devices have 91 splits)."""
    items = list(items)
    more = f"{sep}and {len(items) - shown} more" if len(items) > shown else ""
    return sep.join(items[:shown]) + more


def available_spaces() -> list[str]:
    return sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))


def recipe_space_problems(
    recipe: Recipe, *, client_hint: str | None = None, shapes: bool = True
) -> list[tuple[str, str]]:
    """(field, message) problems of the recipe's space and overrides, found before any machine is
    asked (the REST service on submit, the nightly before its first recipe). With `hardware.device:
    auto` the machine picks the space, so the overrides must hold, and the model's shapes fit, in
    one of them. `client_hint`: the entry point's user has no server files
    (REST): a space is only a name there (a recipe must not point a worker at a file on its disk),
    and the hint, where every space's values are listed, replaces "edit the file". `shapes=False`
    leaves the model's shapes to a later check that knows the machine (the CLI's preflight,
    whose "this machine has N devices" says more than "no split of N devices fits")."""
    device = recipe.hardware.device
    named = recipe.search.space or (device if device != "auto" else None)
    if client_hint is not None and named is not None and named not in available_spaces():
        known = ", ".join(available_spaces()) or "none"
        return [("search.space", f"unknown search space; this service has: {known}")]
    errors, misfits = [], []
    for name in [named] if named is not None else available_spaces():
        try:
            space = load_space(name).narrow(recipe.search.overrides)
        except SpaceError as err:
            errors.append(err)
            continue
        problem = space.shape_problem(recipe) if shapes else None
        if problem is None:
            return []
        misfits.append(problem)
    if misfits:  # no space that loaded fits the model (with `auto`: whichever machine runs it)
        return [misfits[0].pair()]
    if not errors:
        return []
    err = errors[0]
    if client_hint is not None:
        return [err.for_client(client_hint)]
    return [(err.field or "search.space", err.message + err.here)]


def _first_problem(err: ValueError) -> str:
    return err.problems[0][1] if isinstance(err, RecipeError) and err.problems else str(err)


def load_space(name_or_path: str | Path) -> SearchSpace:
    """Load a space by name (search_spaces/<name>.yaml) or by path to a YAML file."""
    path = _space_path(name_or_path)
    src = str(path)
    if not path.exists():
        known = ", ".join(available_spaces()) or "none"
        raise SpaceError(
            f"search space {str(name_or_path)!r} not found ({src}); known spaces: {known}, "
            "or give a path to a YAML file"
        )
    try:
        data = load_document(read_text_file(path, "search space"), src)
    except ValueError as err:  # the file (RecipeError is one too: the text is not YAML)
        raise SpaceError(f"{src}: {_first_problem(err)}") from None
    if not isinstance(data, dict):
        raise SpaceError(f"{src}: expected a mapping with keys 'family' and 'knobs'")
    unknown = set(data) - {"family", "knobs"}
    if unknown:
        raise SpaceError(f"{src}: {sorted(unknown)[0]}: unknown key; a space has 'family' and 'knobs'")
    family = data.get("family")
    if family not in FAMILIES:
        raise SpaceError(
            f"{src}: family: {family!r} is not a device family; use one of {', '.join(FAMILIES)}"
        )
    knobs = data.get("knobs")
    if not isinstance(knobs, dict):
        raise SpaceError(f"{src}: knobs: expected a mapping of knob name to a list of values")
    defaults = Config()
    domains: dict[str, tuple[Any, ...] | None] = {
        n: (None if n in _DEGREES else (getattr(defaults, n),)) for n in KNOBS
    }
    for name, raw in knobs.items():
        domains[name] = _parse_domain(src, name, raw)
    return SearchSpace(name=path.stem, family=family, domains=domains, source=src)


def _parse_domain(src: str, name: str, raw: Any) -> tuple[Any, ...] | None:
    where = f"{src}: knobs.{name}"
    knob = KNOBS.get(name)
    if knob is None:
        raise SpaceError(f"{where}: unknown knob; valid knobs: {', '.join(KNOBS)}")
    if name in _DEGREES and raw == "divisors":
        return None
    if not isinstance(raw, list) or not raw:
        hint = " or 'divisors'" if name in _DEGREES else ""
        raise SpaceError(f"{where}: expected a non-empty list of values{hint}")
    values: list[Any] = []
    for item in raw:
        try:
            value = knob.parse(item)
        except ConfigError as err:
            raise SpaceError(f"{where}: {err}") from None
        if value in values:
            raise SpaceError(f"{where}: {item!r} is listed twice")
        values.append(value)
    return tuple(values)
