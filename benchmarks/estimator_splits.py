"""The memory estimator against real trials, by parallel split, for every model family.

Runs each recipe's every split of 2 ranks (dp ddp, dp fsdp, tp, tp with sequence parallel, pp)
with a few knob variants through the local executor, and reports the estimator's error
(estimated - measured peak, % of measured) per split: median |error| and the worst.

    python benchmarks/estimator_splits.py recipes/gpt-tiny.yaml recipes/llama-tiny.yaml

Peaks are resident-set growth per rank on CPU (max over ranks), so other load on the machine
does not change them; only the wall time grows.
"""

from __future__ import annotations

import argparse
import json
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
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--json", help="write every trial's numbers here")
    args = ap.parse_args()

    from tuner.config import Config
    from tuner.devices import describe
    from tuner.estimate import estimate
    from tuner.executors.local import run_trial
    from tuner.recipe import load_recipe
    from tuner.result import TrialSpec

    info = describe("cpu")
    rows, table = [], []
    tmp = Path(tempfile.mkdtemp(prefix="tuner-est-"))
    for path in args.recipes:
        recipe = load_recipe(path)
        recipe = recipe.model_copy(
            update={"measure": recipe.measure.model_copy(update={"warmup_steps": 1, "steps": 2})}
        )
        for split, knobs in SPLITS.items():
            errors = []
            for variant, extra in VARIANTS.items():
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
                got = result.peak_mem_reserved_bytes
                err = 100 * (est - got) / got
                errors.append(err)
                rows.append({"recipe": recipe.name, "split": split, "variant": variant, "measured": got,
                             "estimated": est, "error_pct": err})  # fmt: skip
                print(f"{recipe.name} {split} {variant}: measured {got / 2**20:.0f} MiB, "
                      f"estimated {est / 2**20:.0f} MiB, {err:+.1f}%", flush=True)  # fmt: skip
            if errors:
                worst = max(errors, key=abs)
                table.append(
                    (recipe.name, split, len(errors), statistics.median(abs(e) for e in errors), worst)
                )
    print("\n| recipe | split | trials | median abs error | worst error |\n|---|---|---:|---:|---:|")
    for name, split, n, med, worst in table:
        print(f"| {name} | {split} | {n} | {med:.1f}% | {worst:+.1f}% |")
    for name in dict.fromkeys(r["recipe"] for r in rows):
        errs = [r["error_pct"] for r in rows if r["recipe"] == name]
        print(f"| {name} | all | {len(errs)} | {statistics.median(abs(e) for e in errs):.1f}% | "
              f"{max(errs, key=abs):+.1f}% |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
