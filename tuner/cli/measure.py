"""`tuner measure`: run one config of a recipe as a real trial and show what it measured."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import typer

from tuner.cli.common import (
    LEGACY_TIMEOUT,
    absolute,
    err_console,
    executor_or_exit,
    fail,
    load_recipe_or_exit,
    parse_sets,
    refuse_renamed_timeout,
    warn_unused_sets,
    writable_dir_or_exit,
)
from tuner.record.status import OK

HELP = """Measure ONE training config of RECIPE on this machine's devices (or, with --executor ray, on the Ray cluster's nodes: a recipe over hardware.nodes > 1 runs a rank group on each).

The trial runs as real processes (one per device), exactly like a trial of `tuner tune`. It starts from the plain config (data parallel over hardware.devices, every other knob at its default); --set changes knobs by their canonical names. Parallel degrees you leave out are derived so that dp*tp*pp equals hardware.devices.

\b
Examples:
  tuner measure recipes/gpt-tiny.yaml
  tuner measure recipes/gpt-tiny.yaml --set micro_batch_size=4
  tuner measure recipes/gpt-tiny.yaml -s tp=2 -s recompute=full --json
  tuner measure recipes/gpt-tiny.yaml --profile prof/
  RAY_ADDRESS=head:6379 tuner measure recipes/llama3-8b.yaml --executor ray -s tp=8

Knobs: micro_batch_size, dp, tp, pp, pp_schedule, dp_shard, recompute, recompute_layers, sequence_parallel, offload, attention, bucket_mb, grad_compression, amp, amp_dtype, tf32, compile, optimizer_impl, loader_workers, pin_memory, cpu_affinity, alloc_conf. An unknown name or value lists the valid ones.

--profile DIR writes a Chrome trace per rank and breakdown.json (where a step's time goes, top operators) into DIR and prints them.

Exit status: 0 when the trial ended ok; 1 when it ran and ended otherwise (oom, error, timeout; the result still prints); 2 on bad input (recipe, knob, infeasible config).
"""

DEGREES = ("dp", "tp", "pp")


def register(app: typer.Typer) -> None:
    app.command("measure", help=HELP, no_args_is_help=True)(measure)


def measure(
    recipe_path: str = typer.Argument(..., metavar="RECIPE", help="Recipe file (YAML or JSON)."),
    sets: list[str] = typer.Option(
        [],
        "--set",
        "-s",
        metavar="KNOB=VALUE",
        help="Set a knob, e.g. --set micro_batch_size=4 (repeatable).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (DESIGN.md result keys)."),
    profile: Path | None = typer.Option(
        None, "--profile", metavar="DIR", help="Profile a few extra steps; write trace + breakdown into DIR."
    ),
    timeout_s: float | None = typer.Option(
        None,
        "--timeout-s",
        metavar="S",
        help="Kill the trial after S seconds (default: recipe measure.timeout_s).",
    ),
    legacy_timeout: str | None = LEGACY_TIMEOUT,
    device: str | None = typer.Option(
        None, "--device", metavar="cpu|cuda|npu|auto", help="Device family (default: recipe hardware.device)."
    ),
    workdir: Path | None = typer.Option(
        None,
        "--workdir",
        metavar="DIR",
        help="Where the trial's logs go (default: $TUNER_RUNS_DIR or ./runs, then measure/<name>-<time>).",
    ),
    executor: str = typer.Option(
        "local",
        "--executor",
        metavar="local|ray",
        help="Run it here, or on the Ray cluster's nodes (hardware.nodes > 1 needs ray).",
    ),
) -> None:
    from tuner.config import ConfigError

    refuse_renamed_timeout(legacy_timeout, "--timeout-s", "SECONDS")
    recipe = load_recipe_or_exit(recipe_path)
    if timeout_s is not None and (not math.isfinite(timeout_s) or timeout_s <= 0):  # NaN too
        fail(f"--timeout-s: must be a positive number of seconds, got {timeout_s:g}; e.g. --timeout-s 300")
    profile, workdir = absolute(profile), absolute(workdir)
    if device is not None and device not in ("cpu", "cuda", "npu", "auto"):
        fail(f"--device: unknown device {device!r}; use one of cpu, cuda, npu, auto")
    given = parse_sets(sets)
    try:
        config = default_config(recipe.hardware.devices, given)
    except ConfigError as err:
        fail(f"--set {err}")
    warn_unused_sets(given, config)
    if executor == "ray" and profile is not None:
        fail(
            "--profile: the trace would stay on the node that ran the trial; profile with the local executor"
        )
    if workdir is not None:
        writable_dir_or_exit(workdir, "--workdir")
    else:
        from tuner.settings import runs_dir

        writable_dir_or_exit(runs_dir() / "measure", "TUNER_RUNS_DIR (default ./runs: the trial's logs)")
    if profile is not None:
        writable_dir_or_exit(profile, "--profile")
    with executor_or_exit(executor) as runner:
        spec, est = _trial_spec(recipe, config, device, workdir, timeout_s, profile is not None, runner)
        result = _run_with_progress(spec, config, runner)
    result.extra["config"] = config.active_params()
    result.extra["estimate_gib"] = est.breakdown()
    copied = _copy_profile(Path(spec.workdir), profile) if profile is not None else None
    if as_json:
        typer.echo(json.dumps(_json_document(result, spec), indent=1))
    else:
        _print_result(result, spec, config)
        if copied:
            _print_profile(copied)
    if profile is not None and not copied and result.status == OK:
        err_console.print(f"[yellow]warning:[/] the trial wrote no profile under {spec.workdir}/profile")
    if result.status != OK:  # a script sees the failure in the exit status, as it reads the output
        raise typer.Exit(1)


def _trial_spec(
    recipe,
    config,
    device: str | None,
    workdir: Path | None,
    timeout_s: float | None,
    profile: bool,
    runner=None,
):
    """The trial to run, once the config is known to be feasible where it runs (this machine, or
    the Ray cluster's nodes as `runner` describes them); (spec, memory estimate)."""
    from tuner.config import infeasible_reasons
    from tuner.estimate import budget_bytes, estimate, predicts_oom
    from tuner.fingerprint import described_here
    from tuner.result import TrialSpec
    from tuner.settings import runs_dir
    from tuner.study.naming import name_slug

    requested = device or recipe.hardware.device
    try:
        described = described_here(requested) if runner is None else runner.describe(requested)
    except ValueError as err:
        fail(str(err).replace("hardware.device:", "--device:" if device else "hardware.device:", 1))
    family, info = described.family, described.device
    from tuner.executors.local import multi_node_refusal

    refusal = multi_node_refusal(recipe.hardware.nodes) if runner is None else None
    if refusal:
        fail(refusal.replace("(--executor ray, or TUNER_EXECUTOR=ray for the service)", "(--executor ray)"))
    reasons = infeasible_reasons(config, recipe, info)
    if reasons:
        fail("this config cannot run:\n  - " + "\n  - ".join(reasons))
    est = estimate(recipe, config, info)
    budget = budget_bytes(recipe, info)
    if predicts_oom(est, budget):
        err_console.print(
            f"[yellow]warning:[/] the estimator predicts {est.peak_mem_bytes / 2**30:.2f} GiB per device, "
            f"over the budget of {budget / 2**30:.2f} GiB; running anyway"
        )
    if workdir is None:
        # A directory of its own even when several measurements start in the same second: they
        # would otherwise share one and each report whichever result was written last.
        parent = runs_dir() / "measure"
        parent.mkdir(parents=True, exist_ok=True)
        workdir = Path(
            tempfile.mkdtemp(prefix=f"{name_slug(recipe.name)}-{time.strftime('%Y%m%d-%H%M%S')}-", dir=parent)
        )
    spec = TrialSpec(
        recipe=recipe.to_dict(),
        config=config.to_dict(),
        family=family,
        workdir=str(workdir),
        timeout_s=timeout_s or recipe.measure.timeout_s,
        profile=profile,
        estimated_peak_mem_bytes=est.peak_mem_bytes,
        memory_budget_bytes=budget,
        seed=recipe.search.seed,
        tag="measure",
    )
    return spec, est


def default_config(devices: int, params: dict[str, Any]):
    """The plain config with `params` applied; unset parallel degrees take up the rest of `devices`
    (dp first, then tp, then pp), so `--set tp=2` on 2 devices means dp=1, tp=2."""
    from tuner.config import KNOBS, Config

    given = {k: KNOBS[k].parse(params[k]) for k in DEGREES if k in params}
    degrees = {k: given.get(k, 1) for k in DEGREES}
    product = degrees["dp"] * degrees["tp"] * degrees["pp"]
    free = [k for k in DEGREES if k not in given]
    if free and devices % product == 0:
        degrees[free[0]] = devices // product
    return Config.from_params({**params, **degrees})


def _run_with_progress(spec, config, runner=None):
    """Run the trial in a thread (here, or through `runner` on a cluster) while a spinner shows
    elapsed time and the trial's last log line. Ctrl-C stops the trial's processes before exiting."""
    from tuner.executors.local import run_trial, tail

    box: dict[str, Any] = {}
    stop = threading.Event()

    def run() -> None:
        try:
            box["r"] = run_trial(spec, stop=stop) if runner is None else runner.run(spec)
        except BaseException as err:  # noqa: BLE001 - raised again on the main thread below
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    log = Path(spec.workdir) / "trial.log"
    start = time.monotonic()
    plain = type(config)().to_dict()
    what = " ".join(f"{k}={v}" for k, v in config.active_params().items() if k in DEGREES or v != plain[k])
    thread.start()
    try:
        with err_console.status(f"measuring {what}") as status:
            while thread.is_alive():
                thread.join(0.25)
                last = tail(log, 1).strip()[-100:]
                status.update(f"measuring {what}  [dim]{time.monotonic() - start:.0f}s  {last}[/]")
    except KeyboardInterrupt:
        stop.set()
        if runner is not None:
            runner.cancel()
        thread.join(30 if runner is not None else None)
        fail("interrupted; the trial's processes were stopped", code=130)
    if "error" in box:
        raise box["error"]
    return box["r"]


def _rerun_half_width(result, spec) -> float | None:
    """Relative half-width of the 95% interval another run of this config lands in: its steps'
    interval and the device family's run-to-run noise (`tuner.record.ranking.rerun_interval`)."""
    if result.step_time_ci is None or not result.tokens_per_s:
        return None
    from tuner.record.ranking import rerun_interval, run_noise

    return rerun_interval(result.step_time_ci, run_noise((), spec.family))


def _json_document(result, spec) -> dict[str, Any]:
    doc = result.public()
    doc["extra"] = {
        **result.extra,
        "error_kind": result.error_kind,
        "wall_s": result.wall_s,
        "measured_s": result.measured_s,
        "overhead_s": result.overhead_s,
        "rerun_interval": _rerun_half_width(result, spec),
        "step_times": result.step_times,
        "losses": result.losses,
        "breakdown": result.breakdown,
        "log_path": result.log_path,
        "workdir": spec.workdir,
        "node": result.node,
        "nodes": result.nodes,  # machines the ranks ran on, and each rank's (Ray node ids)
        "rank_nodes": result.rank_nodes,
    }
    return doc


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "step_time_s":
        return f"{value * 1e3:.1f} ms"
    if key in ("measured_s", "wall_s"):
        return f"{value:.2f} s"
    if key in ("step_time_spread", "step_time_ci", "mfu"):
        return f"{value:.1%}"
    if key == "tokens_per_s":
        return f"{value:,.0f} tokens/s"
    if key == "samples_per_s":
        return f"{value:,.1f} samples/s"
    if key == "tflops":
        return f"{value:.3f} TFLOP/s per device"
    if key.endswith("_bytes"):
        return f"{value / 2**30:.3f} GiB"
    if key == "loss":
        return f"{value:.4f}"
    return str(value)


def _print_result(result, spec, config) -> None:
    from rich.console import Console
    from rich.table import Table

    from tuner.record.status import OK

    style = "green" if result.status == OK else "red"
    table = Table(title=f"trial: [{style}]{result.status}[/]", show_header=False, title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")  # the log's path is copied whole, never cut short
    for key, value in result.public().items():
        if key == "error" and value is None:
            continue
        table.add_row(key, _fmt(key, value) if key != "status" else f"[{style}]{value}[/]")
    half = _rerun_half_width(result, spec)
    if half is not None:
        from tuner.record.ranking import throughput_bounds

        low, high = throughput_bounds(result.tokens_per_s, half)
        table.add_row(
            "a re-run", f"{low:,.0f}-{high:,.0f} tokens/s (95%, with the {spec.family} run-to-run noise)"
        )
    if result.wall_s is not None:
        overhead = result.overhead_s
        share = f" ({overhead / result.wall_s:.0%} outside measured steps)" if overhead is not None else ""
        table.add_row("wall time", f"{result.wall_s:.1f} s{share}")
    table.add_row("config", " ".join(f"{k}={v}" for k, v in config.active_params().items()))
    table.add_row("log", str(result.log_path))
    Console().print(table)


def _copy_profile(workdir: Path, dest: Path) -> Path | None:
    src = workdir / "profile"
    if not src.is_dir():
        return None
    dest.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file():
            shutil.copy2(item, dest / item.name)
    return dest


def _print_profile(dest: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    path = dest / "breakdown.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        console.print(f"profile written to {dest} (no breakdown.json)")
        return
    table = Table(
        title=f"where a step's time goes (rank 0, {report.get('steps')} profiled steps)", title_justify="left"
    )
    table.add_column("category")
    table.add_column("ms / step", justify="right")
    table.add_column("share", justify="right")
    fractions = report.get("fractions", {})
    for cat, seconds in report.get("seconds_per_step", {}).items():
        table.add_row(cat, f"{seconds * 1e3:.1f}", f"{fractions.get(cat, 0):.1%}")
    console.print(table)
    ops = Table(title="top operators by self time", title_justify="left")
    ops.add_column("operator")
    ops.add_column("ms / step", justify="right")
    ops.add_column("calls", justify="right")
    for op in report.get("top_operators", [])[:10]:
        ops.add_row(op["name"], f"{op['self_s_per_step'] * 1e3:.2f}", str(op["calls"]))
    console.print(ops)
    traces = sorted(p.name for p in dest.glob("trace-rank*.json"))
    console.print(
        f"Chrome traces (open in chrome://tracing or ui.perfetto.dev): {dest}/{{{','.join(traces)}}}"
    )
