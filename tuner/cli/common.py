"""Helpers shared by CLI commands: loading a recipe with a clean error, parsing --set."""

from __future__ import annotations

from typing import Any, NoReturn

import typer
from rich.console import Console

err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a user error (no traceback) and exit; 2 means bad input."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def load_recipe_or_exit(path: str):
    from tuner.recipe import RecipeError, load_recipe

    try:
        return load_recipe(path)
    except RecipeError as err:
        fail(str(err))


def parse_sets(sets: list[str]) -> dict[str, Any]:
    """`--set name=value` pairs into a dict (values stay strings; Config parses them)."""
    from tuner.config import KNOBS

    out: dict[str, Any] = {}
    for item in sets:
        if "=" not in item:
            fail(f"--set {item!r}: expected name=value, e.g. --set tp=2; knobs: {', '.join(KNOBS)}")
        name, value = item.split("=", 1)
        out[name.strip()] = value.strip()
    return out
