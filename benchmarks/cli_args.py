"""Argument types the benchmark scripts share: a recipe file or a table that cannot be read is a
usage error naming the argument and the reason (argparse's `error: argument recipe: ...`, exit 2),
as in the `tuner` CLI, not a traceback after minutes of setup.

    ap.add_argument("recipe", type=recipe_path)
    ap.add_argument("table", type=table_path)
"""

from __future__ import annotations

import argparse
import csv


def recipe_path(path: str) -> str:
    """`path`, once it loads as a recipe (the scripts load it again where they need it)."""
    from tuner.recipe import RecipeError, load_recipe

    try:
        load_recipe(path)
    except RecipeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return path


def table_path(path: str) -> str:
    """`path`, once it reads as a table written by benchmarks/make_table.py."""
    from make_table import read_table

    try:
        header, rows = read_table(path)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise argparse.ArgumentTypeError(
            f"{path}: cannot read the table: {getattr(err, 'strerror', None) or err}"
        ) from None
    if "recipe" not in header or not rows:
        raise argparse.ArgumentTypeError(
            f"{path}: not a table written by benchmarks/make_table.py (it needs a '# recipe:' line "
            "and a row per config); make one with `python benchmarks/make_table.py RECIPE --out "
            "TABLE.csv`"
        )
    return path
