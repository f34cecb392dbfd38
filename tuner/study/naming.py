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

    The recipe's name is free text; in the study name it is `name_slug`, since a study name also
    names its build directory."""
    name = f"{name_slug(recipe.name)}-{recipe.hash()}-{fingerprint_hash(fp)}"
    return name + "-pareto" if recipe.search.objective == "throughput_memory" else name


def name_slug(name: str) -> str:
    """A recipe's free-text name as part of a file or directory name: letters, digits, '.', '_'
    and '-' (a '/' would be a directory, '..' a way out of it), at most `SLUG_MAX` characters."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:SLUG_MAX].rstrip("-.") or "recipe"
