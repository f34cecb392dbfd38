"""What a nightly run is given: the recipe folder, the regression threshold, the night, the daily
start time; each bad value is a `NightlyError` naming the option and the fix."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

from tuner.recipe import Recipe, RecipeError, load_recipe
from tuner.space import recipe_space_problems


class NightlyError(ValueError):
    """Bad input to a nightly run (folder, threshold, date); the message names the option and the fix."""


def parse_threshold(text: str) -> float:
    """'5%' or '0.05' -> 0.05 (a fraction of the previous best)."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise NightlyError(
            f"--fail-on-regression {text!r}: expected a percentage like 5% or a fraction like 0.05"
        ) from None
    if not 0 <= value < 1:
        raise NightlyError(f"--fail-on-regression {text!r}: must be between 0% and 100% (e.g. 5%)")
    return value


def parse_night(text: str | None) -> dt.date:
    if text is None:
        return dt.date.today()
    try:
        return dt.date.fromisoformat(text.strip())
    except ValueError:
        raise NightlyError(f"--night {text!r}: expected a date like 2026-11-29 (YYYY-MM-DD)") from None


def next_start(hhmm: str, now: dt.datetime) -> dt.datetime:
    """The next local wall-clock HH:MM after `now` (naive local time; tomorrow's when today's has
    passed). Its date is the night that pass runs for, whenever the sleep ends."""
    m = re.fullmatch(r"([01]?\d|2[0-3]):([0-5]\d)", hhmm.strip())
    if not m:
        raise NightlyError(f"--daily-at {hhmm!r}: expected a time like 02:00 (24-hour HH:MM)")
    target = now.replace(hour=int(m.group(1)), minute=int(m.group(2)), second=0, microsecond=0)
    if target <= now:
        target += dt.timedelta(days=1)
    return target


def seconds_until(hhmm: str, now: dt.datetime) -> float:
    """Seconds from `now` to `next_start`, in real time: both are naive local times, and their
    POSIX timestamps count a daylight-saving change between them (a wall-clock difference would
    wake an hour off on those nights)."""
    return next_start(hhmm, now).timestamp() - now.timestamp()


def find_recipes(path: Path, client_hint: str | None = None) -> list[tuple[Path, Recipe]]:
    """Every *.yaml/*.yml/*.json recipe in `path` (or `path` itself), all validated before any runs;
    hidden files (macOS's `._NAME.yaml` beside a copied file, an editor's) are not recipes.
    `client_hint`: the recipes go to the REST service (--api), which takes a search space by name
    only; its rule applies here (`recipe_space_problems`), not this machine's files."""
    if path.is_dir():
        files = sorted(
            p
            for p in path.iterdir()
            if p.suffix in (".yaml", ".yml", ".json") and p.is_file() and not p.name.startswith(".")
        )
        if not files:
            raise NightlyError(f"{path}: no recipe files (*.yaml, *.yml, *.json) in this folder")
    elif path.exists():
        files = [path]  # a pipe or a device too: load_recipe refuses it by name
    else:
        raise NightlyError(f"{path}: no such folder or file; pass the folder of nightly recipes")
    problems, found, seen = [], [], {}
    for f in files:
        if re.fullmatch(r"nightly-\d{4}-\d{2}-\d{2}\.json", f.name):
            # What a night with --report pointed here wrote: named as such, not as a broken recipe.
            problems.append(f"{f}: is a nightly report (--report), not a recipe; move it out of this folder")
            continue
        try:
            recipe = load_recipe(f)
        except RecipeError as err:
            problems.append(str(err))
            continue
        if recipe.name in seen:
            # The history is keyed by recipe name: two files with one name would overwrite each other.
            problems.append(
                f"{f}: name {recipe.name!r} is also used by {seen[recipe.name]}; names must be unique"
            )
            continue
        # What the REST service checks on submit: a bad space or override fails the run now,
        # not after the recipes before it tuned.
        space_problems = recipe_space_problems(recipe, client_hint=client_hint)
        problems += [f"{f}: {field}: {why}" for field, why in space_problems]
        seen[recipe.name] = f
        found.append((f, recipe))
    if problems:
        raise NightlyError("\n".join(problems))
    return found
