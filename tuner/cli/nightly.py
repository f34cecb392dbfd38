"""`tuner nightly`: re-tune a folder of registered recipes, warm-started from last night's best,
and fail loudly (exit 1) when the best throughput regressed."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import typer

from tuner.cli.common import (
    absolute,
    err_console,
    executor_name_or_exit,
    fail,
    storage_or_exit,
    writable_dir_or_exit,
)

EPILOG = (
    "Exit codes: 0 all recipes fine; 1 a recipe regressed by more than --fail-on-regression, or failed; "
    "2 bad input.\n\n"
    "Crontab (02:00 every night; cron mails the log only when the run fails):\n\n"
    "MAILTO=perf-team@example.com\n\n"
    "TUNER_DATABASE_URL=postgresql+psycopg://tuner:PASSWORD@dbhost:5432/tuner\n\n"
    "0 2 * * * cd /srv/tuner && .venv/bin/tuner nightly recipes/nightly/ --local --report reports/ "
    "> reports/last.log 2>&1 || cat reports/last.log"
)


NIGHTLY_HELP = """Re-tune every recipe in a folder with a small budget, warm-started from the previous night's best configs, and compare the new best tokens/s with the previous night's (same hardware and software fingerprint when there is one; a changed fingerprint is reported and compared anyway).

With --local, last night's best config is tonight's first trial, in a study of its own per night, so a slower machine or a slower torch shows up as a lower best. With --api each night is a job of its own (`<recipe>@nightly-<date>`) warm-started by the service from its similar studies. Writes a Markdown and a JSON report, and one history row per recipe per night (the dashboard's history page).

Re-running a night measures again, in a study (or job, `...-run2`) of its own, compares with the latest earlier night and replaces the night's results; the earlier run's study is kept. A run killed before it recorded its results continues its study when run again.

\b
Examples:
  tuner nightly recipes/nightly/ --local
  tuner nightly recipes/nightly/ --local --night 2026-11-28 --report reports/
  tuner nightly recipes/nightly/gpt-tiny.yaml --local --trials 4 --fail-on-regression 10%
  tuner nightly recipes/nightly/ --api http://tuner:8000 --token T
  tuner nightly recipes/nightly/ --local --daily-at 02:00
"""


def register(app: typer.Typer) -> None:
    app.command("nightly", help=NIGHTLY_HELP, epilog=EPILOG)(nightly)


def _absolute(path: Path) -> Path:
    """--report, made absolute once as it is read: nothing later depends on the working directory
    (a `--daily-at` pass runs for months; a report must not move if something changes the cwd)."""
    return absolute(path)


def _check_api_url(api: str) -> None:
    """--api is the service's base URL: http(s), a host; what else was taken failed every recipe
    of the pass, each as a run failure (exit 1), not as the bad option it is (exit 2)."""
    from urllib.parse import urlsplit

    parts = urlsplit(api)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        fail(
            f"--api: {api!r} is not the service's URL; give http(s)://HOST[:PORT], e.g. --api http://tuner:8000"
        )


def nightly(
    recipes: Path = typer.Argument(
        ..., help="Folder of recipe files (*.yaml, *.yml, *.json) to re-tune, or one recipe file."
    ),
    local: bool = typer.Option(False, "--local", help="Tune on this machine (the default without --api)."),
    api: str | None = typer.Option(
        None, "--api", metavar="URL", help="Submit each recipe to the tuning service at URL instead."
    ),
    token: str | None = typer.Option(
        None, "--token", envvar="TUNER_API_TOKEN", help="API token for --api (from `tuner token create`)."
    ),
    trials: int = typer.Option(
        8,
        "--trials",
        min=1,
        help="Trials per recipe tonight (at most the recipe's search.trials); the warm-start configs run first.",
    ),
    fail_on_regression: str = typer.Option(
        "5%",
        "--fail-on-regression",
        metavar="PCT",
        help="Exit 1 when a recipe's best tokens/s dropped by more than this (or than the two nights' measurement noise, where wider): '5%' or '0.05'.",
    ),
    report: Path = typer.Option(
        Path("nightly-reports"),
        "--report",
        metavar="DIR",
        callback=_absolute,
        help="Where nightly-<date>.md and .json go (relative to the current folder).",
    ),
    night: str | None = typer.Option(
        None,
        "--night",
        metavar="YYYY-MM-DD",
        help="Record this run under that night (default: today). Re-running a night measures again "
        "in a study of its own and replaces its results; an earlier date stands in for a previous "
        "night (tests, back-fills).",
    ),
    top_k: int = typer.Option(
        3, "--top-k", min=1, help="With --local: how many of the previous night's best configs run first."
    ),
    remeasure: int = typer.Option(
        1,
        "--remeasure",
        min=0,
        help="With --local: measure tonight's top N configs once more before judging.",
    ),
    executor: str = typer.Option("local", "--executor", help="With --local: run trials as local or ray."),
    storage: str | None = typer.Option(
        None,
        "--storage",
        metavar="URL",
        help="Database for the nightly history (and, with --local, the studies). "
        "Default: $TUNER_DATABASE_URL, else sqlite:///tuner.db.",
    ),
    daily_at: str | None = typer.Option(
        None,
        "--daily-at",
        metavar="HH:MM",
        help="Stay running and start a pass every day at this local time (the compose `nightly` service).",
    ),
):
    """`tuner nightly` (its help is NIGHTLY_HELP)."""
    from tuner import nightly as nl
    from tuner.db import DatabaseError

    if local and api:
        fail("--local and --api exclude each other: tune here (--local) or through the service (--api URL)")
    if api and not token:
        fail("--api needs --token (or $TUNER_API_TOKEN); create one with `tuner token create --name nightly`")
    if api:
        _check_api_url(api)
    executor_name_or_exit(executor)
    _report_apart_or_exit(report, recipes)
    writable_dir_or_exit(report, "--report")  # before the night's tuning, not after it
    if storage is not None:
        from tuner.settings import absolute_database_url

        storage = absolute_database_url(storage)  # once, here: a --daily-at pass runs for months
    try:
        threshold = nl.parse_threshold(fail_on_regression)
        tonight = nl.parse_night(night)
        if daily_at is not None:
            nl.seconds_until(daily_at, dt.datetime.now())
        found = nl.find_recipes(recipes, _client_hint(api))
    except nl.NightlyError as err:
        fail(str(err))

    def one_pass(for_night: dt.date) -> int:
        # The database answers before the first recipe tunes; a fault names --storage or
        # TUNER_DATABASE_URL, whichever gave the URL, as `tuner tune` does.
        storage_or_exit(storage)
        try:
            _ensure_schema(storage)
            return _run_pass(
                found, for_night, threshold, report, api=api, token=token, trials=trials,
                top_k=top_k, executor=executor, storage=storage, remeasure=remeasure,
            )  # fmt: skip
        except DatabaseError as err:
            fail(str(err))

    if daily_at is None:
        raise typer.Exit(one_pass(tonight))
    while True:  # the compose `nightly` service: a cron without cron
        now = dt.datetime.now()
        start = nl.next_start(daily_at, now)
        wait = nl.seconds_until(daily_at, now)
        hours, minutes = divmod(round(wait / 60), 60)
        err_console.print(f"next nightly pass at {daily_at} (in {hours} h {minutes} min)")
        time.sleep(max(0.0, wait))
        try:
            found = nl.find_recipes(recipes, _client_hint(api))  # recipes may be edited between nights
            # The night is the one scheduled, not the date on waking: a sleep that ends a second
            # early before midnight, or an hour off on a daylight-saving night, must neither skip
            # a night nor run one twice.
            code = one_pass(start.date())
        except nl.NightlyError as err:
            err_console.print(f"[bold red]error:[/] {err}", highlight=False)
            code = 2
        except typer.Exit as ex:
            code = ex.exit_code
        err_console.print(f"nightly pass finished with exit code {code}")


def _client_hint(api: str | None) -> str | None:
    """With --api the service checks each recipe as it checks any client's (a search space by name
    only: a file here is not one there); checked before the first recipe, not as a failed night."""
    return f"; GET {api.rstrip('/')}/v1/search-spaces lists the service's spaces" if api else None


def _report_apart_or_exit(report: Path, recipes: Path) -> None:
    """--report must not be the recipe folder: the night's nightly-<date>.json would be read as a
    recipe by the next night, which then stopped (exit 2) before tuning anything, every night."""
    if recipes.is_dir() and report.resolve() == recipes.resolve():
        fail(
            f"--report {report}: is the recipe folder, and the next night would read its "
            "nightly-<date>.json as a recipe; give another folder, e.g. --report nightly-reports"
        )


def _ensure_schema(storage: str | None) -> None:
    """A local SQLite file gets its tables on first use; a shared server is migrated on purpose
    (`tuner db upgrade`, the compose `migrate` service), never as a side effect of a cron job."""
    from tuner.db import database_url
    from tuner.migrations import upgrade

    url = storage or database_url()
    if url.startswith("sqlite"):
        upgrade(url)


def _run_pass(
    found, night, threshold, report_dir, *, api, token, trials, top_k, executor, storage, remeasure
) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tuner import nightly as nl

    outcomes = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # One executor for the whole pass (one Ray connection, one warm helper), which also says what
    # each recipe's devices are where it runs, so the warm start is last night's on those devices.
    shared = None if api else _pass_executor(executor)
    try:
        with Progress(*columns, console=err_console) as progress:
            overall = progress.add_task(f"nightly {night}", total=len(found))
            for path, recipe in found:
                budget = min(trials, recipe.search.trials)  # never more than the recipe's own search
                task = progress.add_task(f"  {recipe.name}: trials", total=budget)

                def on_trial(done: int, total: int | None = None, _task=task, _budget=budget) -> None:
                    progress.update(_task, completed=done, total=total or _budget)

                if api:
                    tune = nl.api_tuner(
                        api, token, night=night, trials=budget, storage_url=storage, progress=on_trial
                    )
                    expected = None
                else:
                    tune = nl.local_tuner(
                        night=night,
                        trials=budget,
                        executor=shared or executor,
                        storage_url=storage,
                        progress=on_trial,
                        remeasure_top=remeasure,
                    )
                    expected = _fingerprint_hash(recipe, shared)
                outcome = nl.run_recipe(
                    recipe, str(path), night=night, threshold=threshold, tune=tune,
                    expected_fingerprint_hash=expected, db_url=storage, top_k=top_k,
                )  # fmt: skip
                outcomes.append(outcome)
                progress.update(task, description=f"  {recipe.name}: {_line(outcome)}", completed=budget)
                progress.advance(overall)
    finally:
        if shared is not None:
            shared.close()
    md, js = nl.write_report(outcomes, report_dir, night, threshold)
    code = nl.exit_code(outcomes)
    for o in outcomes:
        err_console.print(f"{o.recipe}: {_line(o)}", highlight=False)
    err_console.print(f"report: {md} and {js}; exit code {code}", highlight=False)
    return code


def _pass_executor(name: str):
    """The pass's executor, or None when it cannot start (each recipe then tries on its own and
    reports why it could not, as one failed recipe, not a failed pass)."""
    from tuner.executors import make_executor

    try:
        return make_executor(name)
    except Exception:  # noqa: BLE001 - e.g. no Ray cluster at RAY_ADDRESS; said per recipe
        return None


def _fingerprint_hash(recipe, executor) -> str | None:
    """The fingerprint of the devices `recipe` runs on with `executor` (this machine without one)."""
    from tuner.fingerprint import described_here, fingerprint_hash

    device = recipe.hardware.device
    try:
        described = executor.describe(device) if executor is not None else described_here(device)
        return fingerprint_hash(described.fingerprint)
    except Exception:  # noqa: BLE001 - e.g. device: cuda on a CPU host; tuning reports it as failed
        return None


def _line(o) -> str:
    from tuner.nightly import FAILED, REGRESSED

    if o.verdict == FAILED:
        return f"FAILED ({o.error or 'no trial succeeded'})"
    best = f"{o.best_tokens_per_s:,.0f} tokens/s"
    if o.change_pct is None:
        return f"first run, best {best}"
    verdict = o.verdict.upper() if o.verdict == REGRESSED else o.verdict
    fp = ", fingerprint changed" if o.fingerprint_changed else ""
    return f"{verdict}, best {best} ({o.change_pct:+.1f}%{fp})"
