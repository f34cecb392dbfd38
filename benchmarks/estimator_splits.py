"""The memory estimator against real trials, by parallel split, for every model family.

Runs each recipe's every split of 2 ranks (dp ddp, dp fsdp, tp, tp with sequence parallel, pp)
with a few knob variants through the local executor, and reports the estimator's error
(estimated - measured peak, % of measured) per split: median |error| and the worst.

    python benchmarks/estimator_splits.py recipes/gpt-tiny.yaml --json gpt.json
    python benchmarks/estimator_splits.py recipes/llama-tiny.yaml --variants mbs4 mbs2-full0.5 mbs8-selective-flash
    python benchmarks/estimator_splits.py --rescore gpt.json   # the current estimator, no trials

The measured peak is each trial's `peak_mem_allocated_bytes` (max over ranks): on CPU, resident-set
growth in the rank's held-memory step, where freed memory leaves the process at once
(`tuner.memory.held_memory_window`), so other load on the machine does not change it; only the
wall time grows. `--host-memory default` (the default) measures as a study does; `exact` runs the
whole trial with TUNER_HOST_MEMORY=exact (`tuner.memory.exact_host_memory`), the timed steps too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

SPLITS = {
    "dp2-ddp": {"dp": 2},
    "dp2-fsdp": {"dp": 2, "dp_shard": "fsdp"},
    "tp2": {"tp": 2},
    "tp2-sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
}
VARIANTS = {
    "mbs4": {"micro_batch_size": 4},
    "mbs2-O1-full0.5": {"micro_batch_size": 2, "amp": "O1", "recompute": "full", "recompute_layers": 0.5},
    "mbs8-O2-selective-flash": {
        "micro_batch_size": 8,
        "amp": "O2",
        "recompute": "selective",
        "attention": "flash",
    },
    # fp32 counterparts, for models whose bf16 trials outlast the timeout on a loaded CPU
    "mbs2-full0.5": {"micro_batch_size": 2, "recompute": "full", "recompute_layers": 0.5},
    "mbs8-selective-flash": {"micro_batch_size": 8, "recompute": "selective", "attention": "flash"},
}
DEFAULT_VARIANTS = ("mbs4", "mbs2-O1-full0.5", "mbs8-O2-selective-flash")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="*")
    ap.add_argument("--json", help="write every trial's numbers here")
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--host-memory", choices=("exact", "default"), default="default")
    ap.add_argument("--rescore", help="re-estimate the trials stored in this --json file; run nothing")
    args = ap.parse_args()
    if args.rescore:
        rescore(Path(args.rescore))
        return
    os.environ["TUNER_HOST_MEMORY"] = args.host_memory  # the ranks inherit it
    print(f"host memory: {args.host_memory}", flush=True)

    from tuner.config import Config
    from tuner.devices import describe
    from tuner.estimate import estimate
    from tuner.executors.local import run_trial
    from tuner.recipe import load_recipe
    from tuner.result import TrialSpec

    info = describe("cpu")
    rows: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="tuner-est-"))
    for path in args.recipes:
        recipe = load_recipe(path)
        recipe = recipe.model_copy(
            update={"measure": recipe.measure.model_copy(update={"warmup_steps": 1, "steps": 2})}
        )
        for split, knobs in SPLITS.items():
            for variant in args.variants:
                extra = VARIANTS[variant]
                config = Config.from_params(knobs | extra)
                workdir = tmp / f"{recipe.name}-{split}-{variant}"
                spec = TrialSpec(
                    recipe=recipe.to_dict(), config=config.to_dict(), family="cpu", workdir=str(workdir)
                )
                result = run_trial(spec)
                est = estimate(recipe, config, info).peak_mem_bytes
                if result.status != "ok":
                    print(f"{recipe.name} {split} {variant}: {result.status} {result.error}", flush=True)
                    continue
                got, reserved = result.peak_mem_allocated_bytes, result.peak_mem_reserved_bytes
                err = 100 * (est - got) / got
                rows.append({"recipe": recipe.name, "path": path, "split": split, "variant": variant,
                             "host_memory": args.host_memory, "measured": got, "reserved": reserved,
                             "estimated": est, "error_pct": err})  # fmt: skip
                print(f"{recipe.name} {split} {variant}: allocated {got / 2**20:.0f} MiB "
                      f"(reserved {reserved / 2**20:.0f}), estimated {est / 2**20:.0f} MiB, {err:+.1f}%", flush=True)  # fmt: skip
                if args.json:  # after every trial: a long run stopped early keeps what it measured
                    Path(args.json).write_text(json.dumps(rows, indent=1))
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    """Median |error| and the worst error per recipe and split, then per recipe."""
    print("\n| recipe | split | trials | median abs error | worst error |\n|---|---|---:|---:|---:|")
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r["recipe"], r["split"]), []).append(r["error_pct"])
    for r in rows:
        groups.setdefault((r["recipe"], "**all**"), []).append(r["error_pct"])
    for (name, split), errs in sorted(groups.items(), key=lambda kv: (kv[0][1] == "**all**", kv[0][0])):
        print(f"| {name} | {split} | {len(errs)} | {statistics.median(abs(e) for e in errs):.1f}% | "
              f"{max(errs, key=abs):+.1f}% |")  # fmt: skip


def rescore(path: Path) -> None:
    """The stored trials' measured peaks against what the estimator predicts now."""
    from tuner.config import Config
    from tuner.devices import describe
    from tuner.estimate import estimate
    from tuner.recipe import load_recipe

    info = describe("cpu")
    rows = json.loads(path.read_text())
    for r in rows:
        recipe = load_recipe(r["path"])
        config = Config.from_params(SPLITS[r["split"]] | VARIANTS[r["variant"]])
        r["estimated"] = estimate(recipe, config, info).peak_mem_bytes
        r["error_pct"] = 100 * (r["estimated"] - r["measured"]) / r["measured"]
        print(f"{r['recipe']} {r['split']} {r['variant']}: measured {r['measured'] / 2**20:.0f} MiB, "
              f"estimated {r['estimated'] / 2**20:.0f} MiB, {r['error_pct']:+.1f}%")  # fmt: skip
    print(f"host memory: {rows[0].get('host_memory', 'default')}" if rows else "no trials")
    print_table(rows)


if __name__ == "__main__":
    main()
