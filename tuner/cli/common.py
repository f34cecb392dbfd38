"""Helpers shared by CLI commands: loading a recipe with a clean error, parsing --set, checking a
database URL, and the options every command spells the same way."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

err_console = Console(stderr=True)

# `--timeout` meant seconds in some commands and minutes in others. Each option name now has one
# unit (`--timeout-s`, `--timeout-min`); the old name is kept, hidden, only to say so.
LEGACY_TIMEOUT = typer.Option(
    None, "--timeout", hidden=True, help="Renamed: see --timeout-s / --timeout-min."
)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a user error (no traceback) and exit; 2 means bad input."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def refuse_renamed_timeout(given: str | None, new_name: str, unit: str) -> None:
    """Refuse the old `--timeout` spelling, naming the option that replaced it in this command."""
    if given is not None:
        fail(
            f"--timeout was renamed: use {new_name} {unit} (each option name has one unit: "
            "--timeout-s is seconds, --timeout-min is minutes)"
        )


def load_recipe_or_exit(path: str):
    """The recipe at `path` with the checks every entry point makes (the REST service on submit,
    the nightly before its first recipe): its fields, then its search space and overrides (the
    model's shapes come with the machine's device count, in each command's own checks)."""
    from tuner.recipe import RecipeError, load_recipe
    from tuner.space import recipe_space_problems

    try:
        recipe = load_recipe(path)
    except RecipeError as err:
        fail(str(err))
    for field, why in recipe_space_problems(recipe, shapes=False)[:1]:
        fail(f"{path}: {field}: {why}")
    return recipe


def writable_dir_or_exit(path: Path, source: str) -> None:
    """Check, before any work starts, that the folder `path` can be made and written, or exit
    naming `source` (the option or variable that gave it): such a folder failed the work at its
    end (a night's report after hours of tuning) or stored a failed trial as the config's result.
    Folders made for the check are removed again; the work makes them when it writes."""
    import tempfile

    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        reason = err.strerror or str(err)
        fail(f"{source}: cannot write to the folder {path} ({reason}); give a folder you can write")
    finally:
        for folder in made:  # innermost first
            with contextlib.suppress(OSError):
                folder.rmdir()


def at_least_one_or_exit(option: str, value: int | None) -> None:
    """A count option (`--top`, `--patience`): None (not given) or at least 1."""
    if value is not None and value < 1:
        fail(f"{option}: must be at least 1, got {value}")


def storage_or_exit(url: str | None, create: bool = True) -> str:
    """`--storage URL` (default: the settings' database), made absolute and checked to open.
    `create=False` (a command that only reads): a SQLite file that does not exist in a folder that
    does is left so, not opened (the caller finds nothing in it: `storage.not_made_yet`); a
    folder that does not exist is refused as before, naming --storage (a mistyped path)."""
    from tuner.settings import absolute_database_url, database_url
    from tuner.storage import get_storage, not_made_yet

    source = "--storage" if url else database_source()
    url = absolute_database_url(url) if url else database_url()
    if not create and not_made_yet(url):
        return url
    try:
        get_storage(url, source)
    except ValueError as err:
        fail(str(err))
    return url


def database_source() -> str:
    """Where the database URL came from when no --storage was given, for an error to name: a
    user who never typed --storage fixes the variable (or the default's folder)."""
    import os

    if (os.environ.get("TUNER_DATABASE_URL") or "").strip():
        return "TUNER_DATABASE_URL"
    return "TUNER_DATABASE_URL (default sqlite:///tuner.db)"


def absolute(path: Path | None) -> Path | None:
    """A path option made absolute once, where it is read (nothing downstream uses the cwd)."""
    from tuner.settings import absolute_path

    return absolute_path(path) if path is not None else None


def parse_sets(sets: list[str]) -> dict[str, Any]:
    """`--set name=value` pairs into a dict (values stay strings; Config parses them)."""
    from tuner.config import KNOBS

    out: dict[str, Any] = {}
    for item in sets:
        if "=" not in item:
            fail(f"--set {item!r}: expected name=value, e.g. --set tp=2; knobs: {', '.join(KNOBS)}")
        name, value = item.split("=", 1)
        if name.strip() in out and out[name.strip()] != value.strip():
            fail(f"--set {name.strip()} given twice ({out[name.strip()]} and {value.strip()}); give it once")
        out[name.strip()] = value.strip()
    return out


def warn_unused_sets(given: dict[str, Any], config) -> None:
    """Say which `--set` knobs the config does not use (a conditional knob whose condition does not
    hold: sequence_parallel with tp=1, bucket_mb with dp=1), instead of dropping them silently."""
    from tuner.config import KNOBS

    active = config.active_params()
    for name in given:
        if name in KNOBS and name not in active:
            when = KNOBS[name].applies or "another config"
            err_console.print(
                f"[yellow]note:[/] --set {name} has no effect here; it applies with {when}", highlight=False
            )


def executor_name_or_exit(name: str | None) -> None:
    """Exit 2 when `--executor` names no executor (None: not given, the default stands)."""
    from tuner.executors import unknown_executor

    if name is not None and (why := unknown_executor(name)) is not None:
        fail(why)


def executor_or_exit(name: str):
    """A context for the commands that can reach a cluster (plan, show, build, measure): None for
    `local` (they work on this machine as always), or a started Ray executor that closes with it.
    Its trials start cold (no warm helpers on the nodes): these commands run one at most. Exits 2
    naming --executor when it is unknown or cannot start."""
    import contextlib

    executor_name_or_exit(name)
    if name == "local":
        return contextlib.nullcontext()
    from tuner.executors import make_executor
    from tuner.executors.warm import WARM_ENV

    try:
        return make_executor(name, env={WARM_ENV: "0"})
    except (ImportError, RuntimeError, ValueError, ConnectionError) as err:
        fail(f"--executor {name}: cannot reach it: {err}")


def described_or_exit(recipe, executor: str):
    """(Where `executor`'s trials run as it describes them, `tuner.fingerprint.Described`; the
    performance-model priors it has for them, or None for this machine's own): the local executor
    answers for this machine, Ray's nodes for themselves (`Executor.describe`). Exits 2 naming the
    field or the executor when there is no answer."""
    from tuner.fingerprint import described_here

    with executor_or_exit(executor) as ex:
        try:
            if ex is None:
                return described_here(recipe.hardware.device), None
            described = ex.describe(recipe.hardware.device)
            return described, ex.device_priors(described.device)
        except ValueError as err:
            fail(str(err))
