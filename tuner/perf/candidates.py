"""The configs the model ranks: every feasible config of the space when there are at most
`LIMIT`, else a seeded sample of them plus every one-knob neighbour of the best measured ones."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable

from tuner.config import Config, infeasible_reasons
from tuner.devices import DeviceInfo
from tuner.recipe import Recipe
from tuner.space import SearchSpace

LIMIT = 4000
# Configs looked at before the whole space is given up for a sample (about 2 s): where few are
# feasible (a small model on many GPUs), walking a space of millions to find LIMIT took minutes.
EXAMINE_LIMIT = 100_000


def _random_config(space: SearchSpace, devices: int, rng: random.Random) -> Config:
    dp, tp, pp = rng.choice(space.splits(devices))
    values = {"dp": dp, "tp": tp, "pp": pp}
    for name, domain in space.domains.items():
        if name not in values:
            values[name] = rng.choice(domain) if domain else getattr(Config(), name)
    return Config(**values).normalized()


def neighbours(space: SearchSpace, config: Config, devices: int) -> Iterable[Config]:
    """Configs that differ from `config` in one knob (the split counts as one knob)."""
    base = config.to_dict()
    for dp, tp, pp in space.splits(devices):
        yield Config(**{**base, "dp": dp, "tp": tp, "pp": pp}).normalized()
    for name, domain in space.domains.items():
        if name in ("dp", "tp", "pp") or not domain:
            continue
        for value in domain:
            if value != base[name]:
                yield Config(**{**base, name: value}).normalized()


def candidates(
    space: SearchSpace,
    recipe: Recipe,
    device: DeviceInfo,
    *,
    seed: int = 0,
    around: Iterable[Config] = (),
    limit: int = LIMIT,
) -> tuple[list[Config], bool]:
    """(feasible configs of the space, whether they are all of them): all of them where the walk
    ended, else a sample and the neighbours of `around`, which may be fewer than `limit` (a walk
    given up after EXAMINE_LIMIT looks where few configs are feasible) yet are not the space."""
    devices = recipe.hardware.devices
    every: list[Config] = []
    for looked, (config, feasible) in enumerate(space.walk(recipe, device), 1):
        if feasible:
            every.append(config)
        if len(every) > limit or looked >= EXAMINE_LIMIT:
            break
    else:  # walked the whole space
        return every, True
    rng = random.Random(seed)
    seen: dict[Config, Config] = {}  # by the normalized config itself: equal exactly when keys are
    pool = itertools.chain(
        (n for c in around for n in neighbours(space, c, devices)),
        (c.normalized() for c in every[:limit]),  # what the walk found: all there is, where few are
        (_random_config(space, devices, rng) for _ in range(limit * 3)),
    )
    for config in pool:  # each normalized already
        if (
            config in seen
            or not space.contains(config, devices)
            or infeasible_reasons(config, recipe, device)
        ):
            continue
        seen[config] = config
        if len(seen) >= limit:
            break
    return list(seen.values()), False
