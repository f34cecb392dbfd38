"""`tuner tune` (search a recipe's space with live progress) and `tuner show` (what a study found)."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import typer

from tuner.recipe import MAX_TRIALS, SAMPLERS
from tuner.settings import shown_url

if TYPE_CHECKING:
    from tuner.summary import StudySummary

from tuner.cli.common import (
    LEGACY_TIMEOUT,
    at_least_one_or_exit,
    described_or_exit,
    err_console,
    executor_name_or_exit,
    fail,
    load_recipe_or_exit,
    refuse_renamed_timeout,
    storage_or_exit,
    writable_dir_or_exit,
)

TUNE_HELP = """Search RECIPE's knob space on this machine's devices and report the fastest config.

Each trial runs the model for real (one process per device). Configs the feasibility rules reject, or that the memory estimator predicts to run out of memory, are skipped without using a device. The baseline (what a careful user would try by hand) runs first, so the result is a speedup.

Results live in an Optuna database (default ./tuner.db, or $TUNER_DATABASE_URL). Interrupt at any time (Ctrl-C, or even kill -9) and run the same command again: the study continues, and --trials counts the study's total.

\b
Examples:
  tuner tune recipes/gpt-tiny.yaml
  tuner tune recipes/gpt-tiny.yaml --trials 50 --timeout-min 20 --sampler tpe --seed 1
  tuner tune recipes/gpt-tiny.yaml --storage postgresql+psycopg://user@db/tuner --json
  tuner tune recipes/gpt-small.yaml --executor ray --patience 10

Exit status: 0 when the study ran (even if no config succeeded; see the counts), 2 on bad input, 130 when interrupted.
"""

SHOW_HELP = """Show what the study of RECIPE on this machine found: the best config, the speedup over the baseline, the top configs and what the search cost. Reads the database only (with --executor ray, the study the Ray cluster's nodes ran, whose devices they describe).

\b
Examples:
  tuner show recipes/gpt-tiny.yaml
  tuner show recipes/gpt-tiny.yaml --top 10 --json
  tuner show recipes/gpt-tiny.yaml --study gpt-tiny-54e6a326cb78ac5c-3dca968c-nightly-2026-01-31
  RAY_ADDRESS=head:6379 tuner show recipes/llama3-8b.yaml --executor ray
"""


def register(app: typer.Typer) -> None:
    app.command("tune", help=TUNE_HELP, no_args_is_help=True)(tune)
    app.command("show", help=SHOW_HELP, no_args_is_help=True)(show)


def short_config(config: dict[str, Any]) -> str:
    from tuner.config import short_config as one_line  # torch loads with it: only when printing

    return one_line(config)


def tune(
    recipe_path: str = typer.Argument(..., metavar="RECIPE", help="Recipe file (YAML or JSON)."),
    trials: int | None = typer.Option(
        None, "--trials", "-n", metavar="N", help="Trials in the study in all (default: search.trials)."
    ),
    timeout_min: float | None = typer.Option(
        None,
        "--timeout-min",
        metavar="MIN",
        help="Start no new trial after MIN minutes (default: search.timeout_min).",
    ),
    legacy_timeout: str | None = LEGACY_TIMEOUT,
    storage: str | None = typer.Option(
        None,
        "--storage",
        metavar="URL",
        help="Optuna database URL (default: $TUNER_DATABASE_URL or sqlite:///tuner.db).",
    ),
    sampler: str | None = typer.Option(
        None, "--sampler", metavar="|".join(SAMPLERS), help="Search algorithm (default: search.sampler)."
    ),
    seed: int | None = typer.Option(
        None, "--seed", min=0, max=2**31 - 1, help="Sampler seed, 0 to 2**31-1 (default: search.seed)."
    ),
    patience: int | None = typer.Option(
        None, "--patience", metavar="N", help="Stop when the best has not improved for N trials."
    ),
    executor: str = typer.Option("local", "--executor", metavar="local|ray", help="Where trials run."),
    remeasure: int = typer.Option(
        3,
        "--remeasure",
        metavar="K",
        help="Measure the top K configs again at the end (the best and the configs tied with it twice).",
    ),
    top: int = typer.Option(5, "--top", metavar="K", help="Rows in the top-configs table."),
    as_json: bool = typer.Option(False, "--json", help="Print the study summary as JSON on stdout."),
) -> None:
    refuse_renamed_timeout(legacy_timeout, "--timeout-min", "MINUTES")
    recipe = load_recipe_or_exit(recipe_path)
    if trials is not None and not 1 <= trials <= MAX_TRIALS:
        fail(f"--trials: must be from 1 to {MAX_TRIALS:,}, got {trials:,}")
    at_least_one_or_exit("--top", top)
    if timeout_min is not None and (not math.isfinite(timeout_min) or timeout_min <= 0):  # NaN too
        fail(
            f"--timeout-min: must be a positive number of minutes, got {timeout_min:g}; e.g. --timeout-min 30"
        )
    at_least_one_or_exit("--patience", patience)
    if remeasure < 0:
        fail(f"--remeasure: must be 0 or more, got {remeasure}")
    if sampler is not None and sampler not in SAMPLERS:
        fail(f"--sampler: unknown sampler {sampler!r}; use one of {', '.join(SAMPLERS)}")
    executor_name_or_exit(executor)
    from tuner.executors import make_executor
    from tuner.resume import StudyBusy
    from tuner.settings import runs_dir
    from tuner.study import run_study
    from tuner.study.preflight import PreflightError, preflight

    # The executor starts before the checks below (about 2.5 s on the test machine): its warm
    # helpers (this process's, or one per Ray node) import torch meanwhile, so the first trial
    # waits that much less for them. A failed check closes it again.
    try:
        runner = make_executor(executor)
    except (ImportError, RuntimeError, ValueError, ConnectionError) as err:
        fail(f"--executor {executor}: cannot start it: {err}")
    total = trials if trials is not None else recipe.search.trials
    try:
        with runner:
            try:
                preflight(recipe, sampler or recipe.search.sampler, runner)
            except PreflightError as err:
                fail(str(err))
            writable_dir_or_exit(runs_dir(), "TUNER_RUNS_DIR (default ./runs: the trials' logs)")
            url = storage_or_exit(storage)
            with _LiveProgress(total) as live:
                summary = run_study(
                    recipe,
                    storage_url=url,
                    executor=runner,
                    trials=trials,
                    timeout_s=timeout_min * 60 if timeout_min is not None else None,
                    patience=patience,
                    sampler=sampler,
                    seed=seed,
                    progress=live.on_event,
                    remeasure_top=remeasure,
                )
    except StudyBusy as err:
        fail(str(err), 1)  # not bad input: the study is busy now
    except KeyboardInterrupt:
        err_console.print(
            "[yellow]interrupted[/]: running trials were stopped; run the same command again to continue"
        )
        raise typer.Exit(130) from None
    _report(summary, as_json, top)


def show(
    recipe_path: str = typer.Argument(..., metavar="RECIPE", help="Recipe file (YAML or JSON)."),
    storage: str | None = typer.Option(
        None,
        "--storage",
        metavar="URL",
        help="Optuna database URL (default: $TUNER_DATABASE_URL or sqlite:///tuner.db).",
    ),
    top: int = typer.Option(5, "--top", metavar="K", help="Rows in the top-configs table."),
    study: str | None = typer.Option(
        None, "--study", metavar="NAME", help="Show this study instead of the recipe's study on this machine."
    ),
    executor: str = typer.Option(
        "local",
        "--executor",
        metavar="local|ray",
        help="Whose study: this machine's, or the one `tuner tune --executor ray` ran on the Ray cluster's nodes.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the study summary as JSON on stdout."),
) -> None:
    recipe = load_recipe_or_exit(recipe_path)
    at_least_one_or_exit("--top", top)
    url = storage_or_exit(storage, create=False)  # it reads the database only: never makes one
    from tuner.db import session_scope
    from tuner.record.reader import read_study
    from tuner.storage import missing_database
    from tuner.study import study_name
    from tuner.summary import summarize_record

    given = study is not None
    if study is None:
        study = study_name(recipe, described_or_exit(recipe, executor)[0].fingerprint)
    record = None
    if not missing_database(url):
        with session_scope(url) as session:
            record = read_study(session, study)
    if record is None:
        fail(
            f"no study {study!r} in {shown_url(url)}; run `tuner tune {recipe_path}` first "
            "(or pass --storage/--study)"
        )
    if given and not _same_recipe(record.recipe, recipe):
        fail(
            f"--study {study!r} measured another recipe than {recipe_path} (its model, training, hardware "
            "or measurement differ); pass the recipe it ran, or leave --study out"
        )
    _report(summarize_record(record, url, top_k=top), as_json, top)


def _same_recipe(stored: dict, recipe) -> bool:
    """Whether a study's stored recipe measures what `recipe` does (`Recipe.hash`: not its name or
    search budget, so a nightly's study of the recipe counts)."""
    from tuner.recipe import RecipeError, recipe_from_dict

    try:
        return recipe_from_dict(stored).hash() == recipe.hash()
    except (RecipeError, ValueError, TypeError):
        return True  # a study written by another version: shown, as before


class _LiveProgress:
    """A rich progress bar on stderr fed by the study's progress events."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]trials"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("best [green]{task.fields[best]}[/] tokens/s"),
            TextColumn("[dim]{task.fields[current]}"),
            console=err_console,
        )
        self.task = self.progress.add_task("tune", total=total, best="-", current="")

    def __enter__(self) -> _LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def on_event(self, event: dict[str, Any]) -> None:
        fields: dict[str, Any] = {"completed": event.get("done", 0), "total": event.get("total")}
        if event.get("best_tokens_per_s") is not None:
            fields["best"] = f"{event['best_tokens_per_s']:,.0f}"
        if event["event"] == "trial_started":
            fields["current"] = f"#{event['trial']} {short_config(event['config'])}"
        elif event["event"] == "trial_finished":
            res = event.get("result") or {}
            fields["current"] = f"#{event['trial']} {res.get('status')}"
        elif event["event"] == "done":
            fields["current"] = f"done ({event.get('reason')})"
        self.progress.update(self.task, **fields)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}{unit}" if abs(value) < 100 else f"{value:,.0f}{unit}"
    return f"{value}{unit}"


def _report(summary: StudySummary, as_json: bool, top: int) -> None:
    if as_json:
        typer.echo(json.dumps(summary.to_dict(), indent=1, default=str))
        return
    from rich.console import Console

    out = Console()
    out.print(f"[bold]study[/] {summary.study_name}  [dim]({shown_url(summary.storage_url)})[/]")
    counts = ", ".join(f"{n} {k}" for k, n in sorted(summary.counts.items()))
    out.print(f"trials: {summary.n_trials} ({counts or 'none'})")
    if summary.best is None:
        out.print(
            "[red]no config finished ok[/]; see the counts above and the trials' errors in the database"
        )
        return
    _print_best(out, summary)
    _print_top(out, summary, top)
    _print_cost(out, summary)


def _print_best(out: Any, summary: StudySummary) -> None:
    from rich.table import Table

    best = summary.best
    table = Table(title=f"best config (trial {best.trial})", show_header=True)
    table.add_column("knob")
    table.add_column("value")
    for k, v in best.config.items():
        table.add_row(k, str(v))
    out.print(table)
    m, again = best.metrics, best.remeasured_tokens_per_s
    peak = m.get("peak_mem_reserved_bytes")
    out.print(
        f"tokens/s [bold green]{best.tokens_per_s:,.0f}[/]"
        + (f" ± {best.ci:.1%} (95%)" if best.ci is not None else "")
        + (f" (median of {1 + len(again)} runs)" if again else "")
        + f", step {_fmt(m.get('step_time_s'), ' s')}, MFU {_fmt(m.get('mfu'))}, "
        f"peak memory {_fmt(peak / 2**30 if peak else None, ' GiB')}"
    )
    if summary.speedup is not None:
        base = summary.baseline
        out.print(
            f"speedup over the baseline (trial {base.trial}, {base.tokens_per_s:,.0f} tokens/s): "
            f"[bold]{summary.speedup:.2f}x[/]"
        )
    if summary.tie:
        ru = summary.runner_up
        out.print(
            f"[yellow]tie[/]: trial {ru.trial} ({ru.tokens_per_s:,.0f} tokens/s) is within the "
            f"measurement noise of the best; either is fine: {short_config(ru.config)}"
        )


def _print_top(out: Any, summary: StudySummary, top: int) -> None:
    from rich.table import Table

    tops = Table(title=f"top {min(top, len(summary.top_k))} configs")
    for col in ("trial", "tokens/s", "± (95%)", "config"):
        tops.add_column(col)
    for e in summary.top_k[:top]:
        # The interval where the trial has one; the spread for trials measured before intervals.
        width = e.ci if e.ci is not None else e.noise
        tops.add_row(str(e.trial), f"{e.tokens_per_s:,.0f}", f"{width:.1%}", short_config(e.config))
    out.print(tops)
    for e in summary.flagged:
        out.print(f"[yellow]excluded[/] trial {e.trial}: {e.flag}")


def _print_cost(out: Any, summary: StudySummary) -> None:
    from tuner.units import human_duration

    spent = summary.device_seconds
    by_status = ", ".join(f"{k} {human_duration(v)}" for k, v in spent.items() if k != "total")
    out.print(f"search cost: {human_duration(spent.get('total', 0))} of device time ({by_status or 'none'})")
    if summary.payback_hours is not None:
        out.print(
            f"payback: the search pays for itself after {human_duration(summary.payback_hours * 3600)} "
            "of training at the found speed"
        )
