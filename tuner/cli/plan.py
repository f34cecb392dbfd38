"""`tuner plan`: rank every feasible config of a recipe by predicted throughput, spending no
device time (the performance model, fitted to what the database measured on this machine)."""

from __future__ import annotations

import json

import typer

from tuner.cli.common import (
    described_or_exit,
    executor_name_or_exit,
    fail,
    load_recipe_or_exit,
    storage_or_exit,
)

PLAN_HELP = """Rank every feasible config of RECIPE by predicted tokens/s, without running any.

The prediction is the performance model (compute, communication, pipeline bubble, recompute, host overhead; memory from the estimator) fitted to the trials of this model measured on this machine's fingerprint in the database, starting from the device table's priors (the priors alone when there are none). Each row has a 90% interval and the chance it fits the memory budget (P(fit)). Rows are in the order of what a run is expected to deliver: predicted tokens/s, scaled down where P(fit) is under 0.5; within 1% of each other, the config that changes fewer knobs comes first. With --devices beyond this machine, the plan extrapolates and says so. With --device NAME it plans for a catalogued device this machine is not (H100 on a laptop, before any GPU is booked), from that device's datasheet priors alone. With --executor ray the nodes of the Ray cluster ($RAY_ADDRESS) describe their own devices and priors, and the plan fits what studies measured on them: plan from a head node without GPUs.

\b
Examples:
  tuner plan recipes/gpt-tiny.yaml
  tuner plan recipes/gpt-tiny.yaml --top 5 --json
  tuner plan recipes/gpt-tiny.yaml --devices 4 --storage sqlite:///tuner.db
  tuner plan recipes/llama3-8b.yaml --device H100 --devices 8
  RAY_ADDRESS=head:6379 tuner plan recipes/llama3-8b.yaml --executor ray

Exit status: 0 with a plan, 2 on bad input.
"""


def register(app: typer.Typer) -> None:
    app.command("plan", help=PLAN_HELP, no_args_is_help=True)(plan)


def _print(result) -> None:
    from tuner.cli.tune import short_config

    note = "a PREDICTION beyond what was measured; " if result.extrapolated else ""
    typer.echo(
        f"{result.recipe} on {result.devices} devices: {result.considered} feasible configs ranked; "
        f"{note}{result.basis}"
    )
    if result.why_none:
        typer.echo(f"nothing to rank: {result.why_none}")
    for r in result.rows:
        low, high = r.tokens_per_s_interval
        measured = "" if r.measured_tokens_per_s is None else f"  measured {r.measured_tokens_per_s:,.0f}"
        typer.echo(
            f"{r.rank:>3}. {r.tokens_per_s:>10,.0f} tokens/s (90%: {low:,.0f}-{high:,.0f})  "
            f"step {r.step_time_s:.4f} s  est. peak {r.estimated_peak_mem_bytes / 2**20:,.0f} MiB  "
            f"P(fit) {r.p_fit:.2f}{measured}\n     {short_config(r.config)}"
        )


def plan(
    recipe_path: str = typer.Argument(..., metavar="RECIPE", help="Recipe file (YAML or JSON)."),
    devices: int | None = typer.Option(
        None, "--devices", metavar="N", help="Plan for N devices (default: hardware.devices)."
    ),
    top: int = typer.Option(10, "--top", metavar="K", help="List the K best configs."),
    storage: str | None = typer.Option(
        None,
        "--storage",
        metavar="URL",
        help="Database with measured trials (default: $TUNER_DATABASE_URL or sqlite:///tuner.db).",
    ),
    device: str | None = typer.Option(
        None,
        "--device",
        metavar="NAME",
        help="Plan for a catalogued device instead of this machine's: V100, A100, H100, H200, 910B.",
    ),
    executor: str = typer.Option(
        "local",
        "--executor",
        metavar="local|ray",
        help="Whose devices: this machine's, or those of the Ray cluster's nodes (as `tuner tune --executor`).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
) -> None:
    recipe = load_recipe_or_exit(recipe_path)
    url = storage_or_exit(storage, create=False)  # a plan reads trials; it stores none
    from tuner.perf.plan import make_plan

    executor_name_or_exit(executor)
    if executor == "ray" and device is not None:
        fail("--device: a catalogued device or (--executor ray) the cluster's own, not both; drop one")
    where = {}
    if executor == "ray":
        described, priors = described_or_exit(recipe, executor)
        where = {"device": described.device, "priors": priors, "fingerprint": described.fingerprint}
    try:
        result = make_plan(recipe, devices=devices, top=top, storage_url=url, catalogued=device, **where)
    except ValueError as err:  # a PlanError, or a device family this machine lacks: both name the field
        fail(str(err))
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        _print(result)
