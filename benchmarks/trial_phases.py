"""Where a trial's time outside its measured steps goes (issue 16's overhead), phase by phase.

Runs a few configs of a recipe through `tuner.executors.local.run_trial` (the warm helper, as
`tuner measure` and the local executor do) and splits each trial's wall time into: until rank 0
printed its first line (the training built), the warm-up steps, the measured steps, and from the
last measured step until the last rank exited (the held-memory step when it is not a warm-up
step, the reports, teardown), plus the launcher's reaping. `--compile default` runs the same
configs compiled (the first round compiles whatever the Inductor cache lacks; later rounds show a
cached compiled trial's cost).

    python benchmarks/trial_phases.py recipes/gpt-tiny.yaml --repeats 2
    python benchmarks/trial_phases.py recipes/gpt-tiny.yaml --compile default --repeats 3

To compare code versions on the same machine, alternate trees with PYTHONPATH, from a directory
outside both (a tree's helper before commit 708c524 imported the working directory's `tuner`):

    cd /tmp && PYTHONPATH=/path/to/tree python /path/to/tree/benchmarks/trial_phases.py \\
        /path/to/tree/recipes/gpt-tiny.yaml --json

The first trial of a run starts the warm helper, so its start is not warm.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from cli_args import recipe_path

from tuner.config import KNOBS, Config
from tuner.devices import describe
from tuner.estimate import budget_bytes, estimate
from tuner.executors.local import run_trial
from tuner.recipe import load_recipe
from tuner.result import TrialSpec

CONFIGS = (
    {"dp": 2, "micro_batch_size": 4},
    {"dp": 2, "micro_batch_size": 8, "amp": "O1"},
    {"pp": 2, "micro_batch_size": 2},
    {"tp": 2, "micro_batch_size": 8},
)


def phases(recipe, config: Config, workdir: str) -> dict:
    device = describe("cpu")
    spec = TrialSpec(
        recipe=recipe.to_dict(),
        config=config.to_dict(),
        family="cpu",
        workdir=workdir,
        timeout_s=recipe.measure.timeout_s,
        estimated_peak_mem_bytes=int(estimate(recipe, config, device).peak_mem_bytes),
        memory_budget_bytes=budget_bytes(recipe, device),
    )
    t0 = time.time()
    r = run_trial(spec)
    exits = json.loads((Path(workdir) / "exits.json").read_text())
    ready = exits["first_output"].get("0", t0) - t0
    last_exit = max(e["t"] for e in exits["exits"]) - t0
    warmup = r.extra.get("warmup_s") or 0.0
    return {
        "config": config.active_params(),
        "status": r.status,
        "wall_s": r.wall_s,
        "measured_s": r.measured_s,
        "overhead_s": r.wall_s - r.measured_s,
        "ready_s": ready,
        "warmup_s": warmup,
        "warmup_steps": r.extra.get("warmup_steps"),
        "after_measured_s": last_exit - ready - warmup - r.measured_s,
        "reap_s": r.wall_s - last_exit,
        "step_time_s": r.step_time_s,
        "held_memory_step": r.extra.get("held_memory_step"),
        "peak_mem_allocated_bytes": r.peak_mem_allocated_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=recipe_path)
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the configs")
    ap.add_argument("--json", action="store_true", help="one JSON object per trial")
    ap.add_argument(
        "--compile",
        default="none",
        choices=KNOBS["compile"].choices,
        help="torch.compile mode of every config",
    )
    args = ap.parse_args(argv)
    recipe = load_recipe(args.recipe)
    tmp = tempfile.mkdtemp(prefix="tuner-phases-")
    for rep in range(args.repeats):
        for i, params in enumerate(CONFIGS):
            row = phases(recipe, Config(**params, compile=args.compile), f"{tmp}/r{rep}-c{i}")
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            print(
                f"{json.dumps(row['config'])}: overhead {row['overhead_s']:.2f} s of {row['wall_s']:.2f} | "
                f"ready {row['ready_s']:.2f}, warm-up {row['warmup_s']:.2f} ({row['warmup_steps']} steps), "
                f"after the measured steps {row['after_measured_s']:.2f}, reap {row['reap_s']:.2f} | "
                f"step {row['step_time_s']:.3f} s, held memory read in step {row['held_memory_step']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
