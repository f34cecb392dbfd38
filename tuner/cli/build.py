"""`tuner build`: compile a study's best (or any) trial into an archive of fused kernels, compile
cache, profile and launch script, and show what compiling it bought."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer

from tuner.cli.common import (
    LEGACY_TIMEOUT,
    absolute,
    err_console,
    executor_or_exit,
    fail,
    load_recipe_or_exit,
    refuse_renamed_timeout,
    storage_or_exit,
    writable_dir_or_exit,
)

HELP = """Build the fused kernels of RECIPE's best trial (or --trial N) from its study.

The config is compiled with torch.compile (Inductor) in processes of its own, like a trial. The build archive builds/<study>/<trial>-<sha256 prefix>.tar.gz (a rebuild keeps its own file) holds config.json (knobs, recipe, winning metrics), launch.sh (the torchrun command that reproduces the measured run), kernels/ (generated Triton or C++ per rank, with index.json naming the fused operators), compile-cache.bin (load it with torch.compiler.load_cache_artifacts to skip compiling), profile/ (Chrome trace, step-time breakdown) and manifest.json (versions, device, sha256 of every file). The build is registered in the database's builds table.

\b
Examples:
  tuner build recipes/gpt-tiny.yaml
  tuner build recipes/gpt-tiny.yaml --trial 17 --out /srv/builds
  tuner build recipes/gpt-tiny.yaml --json
  RAY_ADDRESS=head:6379 tuner build recipes/llama3-8b.yaml --executor ray

Exit status: 0 when the archive was written; 1 when the build failed (compiler crash, timeout); 2 on bad input (recipe, no study yet, no such trial).
"""


def register(app: typer.Typer) -> None:
    app.command("build", help=HELP, no_args_is_help=True)(build)


def build(
    recipe_path: str = typer.Argument(..., metavar="RECIPE", help="Recipe file (YAML or JSON)."),
    trial: int | None = typer.Option(
        None, "--trial", metavar="N", help="Trial number to build (default: the study's best)."
    ),
    storage: str | None = typer.Option(
        None,
        "--storage",
        metavar="URL",
        help="Study database (default: TUNER_DATABASE_URL or sqlite:///tuner.db).",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        metavar="DIR",
        help="Artifact store directory (default: TUNER_ARTIFACT_DIR or ./builds).",
    ),
    timeout_s: float = typer.Option(
        900, "--timeout-s", metavar="S", help="Give up on the build after S seconds."
    ),
    legacy_timeout: str | None = LEGACY_TIMEOUT,
    executor: str = typer.Option(
        "local",
        "--executor",
        metavar="local|ray",
        help="Build here, or on a node of the Ray cluster the study ran on (the archive comes back here).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the build record as JSON."),
) -> None:
    from tuner.artifacts import ArtifactError, ArtifactStore
    from tuner.build import BuildError, NoStudyError, NoTrialError, build_trial

    refuse_renamed_timeout(legacy_timeout, "--timeout-s", "SECONDS")
    recipe = load_recipe_or_exit(recipe_path)
    if not math.isfinite(timeout_s) or timeout_s <= 0:  # NaN passes `<= 0` alone
        fail(f"--timeout-s: must be a positive number of seconds, got {timeout_s:g}; e.g. --timeout-s 900")
    if trial is not None and trial < 0:
        fail(f"--trial: must be a trial number >= 0, got {trial}")
    store = ArtifactStore(absolute(out))
    writable_dir_or_exit(store.root, "--out" if out is not None else "TUNER_ARTIFACT_DIR (default ./builds)")
    url = storage_or_exit(storage, create=False)  # a build reads the study; it makes no database
    try:
        with executor_or_exit(executor) as runner, _Progress() as progress:
            record = build_trial(
                recipe,
                trial_number=trial,
                storage_url=url,
                store=store,
                timeout_s=timeout_s,
                progress=progress,
                executor=runner,
            )
    except (NoStudyError, NoTrialError) as err:
        fail(str(err))
    except ValueError as err:  # device not present, unusable --storage URL
        fail(str(err))
    except (BuildError, ArtifactError) as err:
        fail(str(err), code=1)
    except OSError as err:  # the disk filled, a file the build copies went missing
        fail(f"build failed: {err}; the study is unchanged, run the build again once that is fixed", code=1)
    if as_json:
        typer.echo(json.dumps(record.to_dict(), indent=1))
    else:
        _print_record(record)


class _Progress:
    """A rich progress bar on stderr (so --json output stays clean), fed by build_trial's stages."""

    def __enter__(self) -> _Progress:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
            console=err_console, transient=True,
        )  # fmt: skip
        self._bar.__enter__()
        self._task = self._bar.add_task("starting the build", total=5)
        return self

    def __call__(self, step: int, total: int, message: str) -> None:
        self._bar.update(self._task, completed=step, total=total, description=message)

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(*exc)


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.1f}{unit}" if unit == "s" else f"{value:,.0f}{unit}"


def _cpu(seconds: float | None) -> str:
    return f"{_fmt(seconds, 's')} CPU tracing + codegen"


def _print_record(record) -> None:
    from rich.console import Console
    from rich.table import Table

    from tuner.config import Config

    table = Table(title=f"build of trial {record.trial_number} ({record.study_name})", show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # paths and checksums are copied whole, never cut short
    # The parallel split and every knob away from its default: what makes this config this one.
    plain = Config().to_dict()

    def shown(knobs: dict) -> str:
        return " ".join(f"{k}={v}" for k, v in knobs.items() if k in ("dp", "tp", "pp") or plain.get(k) != v)

    eager, compiled = record.eager_tokens_per_s, record.compiled_tokens_per_s
    speed = f"{compiled / eager:.2f}x" if eager and compiled else "-"
    launched = record.launch_config or record.config
    rows = [("config compiled", shown(record.config))]
    if launched != record.config:  # an eager winner: compiled to compare, launched as measured
        rows.append(
            (
                "launch.sh runs",
                f"{shown(launched)} (as measured; set compile in spec.json to use the kernels)",
            )
        )
    for name, value in [
        *rows,
        ("eager tokens/s", _fmt(eager)),
        ("compiled tokens/s", _fmt(compiled)),
        ("compiled / eager", speed),
        ("compile cold", f"{_fmt(record.compile_cold_s, 's')} wall, {_cpu(record.compile_cold_cpu_s)}"),
        (
            "compile warm (cache)",
            f"{_fmt(record.compile_warm_s, 's')} wall, {_cpu(record.compile_warm_cpu_s)}",
        ),
        ("fused kernels", str(record.kernels)),
        ("archive", record.path),
        ("sha256", record.sha256),
    ]:
        table.add_row(name, value)
    console = Console()
    console.print(table)
    for line in record.summary:
        console.print(f"  {line}", highlight=False)
