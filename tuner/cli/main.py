"""Entry point of the `tuner` command. Heavy imports (torch, optuna, ray) happen inside commands
so that `tuner --help` answers at once."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="tuner",
    help=(
        "Find the fastest training configuration for a model recipe on your real devices.\n\n"
        "Start with:  tuner measure recipes/gpt-tiny.yaml   (one config)\n"
        "then:        tuner tune recipes/gpt-tiny.yaml      (search; results in ./tuner.db)"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module registers its commands; a module that is not there yet is simply absent.
_COMMAND_MODULES = ("measure", "tune", "plan", "build", "serve", "token", "nightly", "db", "models")

for _name in _COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"tuner.cli.{_name}")
    except ModuleNotFoundError as _err:
        if _err.name != f"tuner.cli.{_name}":
            raise
        continue
    _mod.register(app)


if __name__ == "__main__":
    app()
