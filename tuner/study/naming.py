"""What a study is called: the recipe's build-safe name, its hash and the fingerprint's hash, so a
result never silently mixes recipes, devices or software versions."""

from __future__ import annotations

import re
from typing import Any

from tuner.fingerprint import fingerprint_hash
from tuner.recipe import Recipe

SLUG_MAX = 100  # characters of the recipe's name a study name keeps


def study_name(recipe: Recipe, fp: dict[str, Any]) -> str:
    """`<recipe name>-<recipe hash>-<fingerprint hash>`; a Pareto study gets `-pareto` too,
    since it has two objectives and cannot share trials with a throughput-only study.

    The recipe's name is free text; in the study name it is reduced to letters, digits, '.', '_'
    and '-' (at most `SLUG_MAX`), since a study name also names its build directory."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", recipe.name).strip("-.")[:SLUG_MAX].rstrip("-.") or "recipe"
    name = f"{slug}-{recipe.hash()}-{fingerprint_hash(fp)}"
    return name + "-pareto" if recipe.search.objective == "throughput_memory" else name
