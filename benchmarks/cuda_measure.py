"""Measure a GPT recipe on an NVIDIA GPU across the CUDA-only knobs.

Sweeps attention backends (flash, efficient, cudnn, math), precision (bf16 / fp16 autocast, fp32
with and without TF32), compile modes (none, default, max-autotune, reduce-overhead) and recompute,
one knob family at a time around a strong base config, each as a real trial through the same
runner `tuner measure` uses. Prints a Markdown table (paste it into BENCHMARKS.md) and writes a CSV.

    python benchmarks/cuda_measure.py recipes/gpt-small.yaml --out benchmarks/results/cuda.csv

Exits 0 with a note (and measures nothing) when no NVIDIA GPU is visible.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

BASE = {
    "micro_batch_size": 8,
    "attention": "flash",
    "amp": "O1",
    "amp_dtype": "bf16",
    "tf32": True,
    "compile": "none",
    "recompute": "none",
}

# (group, overrides on BASE)
SWEEP: list[tuple[str, dict]] = [
    ("attention", {"attention": "flash"}),
    ("attention", {"attention": "efficient"}),
    ("attention", {"attention": "cudnn"}),
    ("attention", {"attention": "math"}),
    ("precision", {"amp": "O1", "amp_dtype": "bf16"}),
    ("precision", {"amp": "O1", "amp_dtype": "fp16"}),
    ("precision", {"amp": "O2", "amp_dtype": "bf16"}),
    ("precision", {"amp": "O0", "tf32": True}),
    ("precision", {"amp": "O0", "tf32": False}),
    ("compile", {"compile": "default"}),
    ("compile", {"compile": "max-autotune"}),
    ("compile", {"compile": "reduce-overhead"}),
    ("recompute", {"recompute": "selective"}),
    ("recompute", {"recompute": "full"}),
    ("micro_batch_size", {"micro_batch_size": 16}),
    ("micro_batch_size", {"micro_batch_size": 32}),
]

COLUMNS = [
    "group",
    "knobs",
    "status",
    "step_time_s",
    "tokens_per_s",
    "tflops",
    "mfu",
    "peak_mem_allocated_bytes",
    "estimated_peak_mem_bytes",
    "error",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", help="recipe YAML, e.g. recipes/gpt-small.yaml")
    ap.add_argument("--out", default="benchmarks/results/cuda.csv", help="CSV to write")
    ap.add_argument("--only", default=None, help="comma-separated groups to run (default: all)")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no NVIDIA GPU visible (torch.cuda.is_available() is False): nothing measured")
        return 0

    from tuner.config import Config, infeasible_reasons
    from tuner.devices import describe
    from tuner.estimate import estimate
    from tuner.executors.local import run_trial
    from tuner.recipe import load_recipe
    from tuner.result import TrialSpec

    recipe = load_recipe(args.recipe)
    info = describe("cuda")
    groups = set(args.only.split(",")) if args.only else None
    print(f"# {recipe.name} on {info.name} (torch {torch.__version__}, CUDA {torch.version.cuda})\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tuner-cuda-") as tmp:
        for i, (group, over) in enumerate(SWEEP):
            if groups and group not in groups:
                continue
            params = {**BASE, **over, "dp": recipe.hardware.devices}
            config = Config.from_params(params)
            label = ", ".join(f"{k}={v}" for k, v in over.items())
            reasons = infeasible_reasons(config, recipe, info)
            if reasons:
                rows.append(
                    {"group": group, "knobs": label, "status": "infeasible", "error": "; ".join(reasons)}
                )
                print(f"{label}: infeasible: {'; '.join(reasons)}", flush=True)
                continue
            spec = TrialSpec(
                recipe=recipe.to_dict(),
                config=config.to_dict(),
                family="cuda",
                workdir=str(Path(tmp) / f"t{i}"),
                timeout_s=recipe.measure.timeout_s,
                estimated_peak_mem_bytes=estimate(recipe, config, info).peak_mem_bytes,
                tag=str(i),
            )
            res = run_trial(spec)
            row = {"group": group, "knobs": label, **res.public()}
            rows.append(row)
            print(f"{label}: {res.status} tokens/s={res.tokens_per_s} mfu={res.mfu}", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    print("\n| group | knobs | status | step ms | tokens/s | TFLOP/s | MFU | peak GiB (est.) |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:

        def fmt(v, scale=1.0, nd=1):
            return "" if v is None else f"{v * scale:.{nd}f}"

        peak = fmt(r.get("peak_mem_allocated_bytes"), 1 / 2**30, 2)
        est = fmt(r.get("estimated_peak_mem_bytes"), 1 / 2**30, 2)
        print(
            f"| {r['group']} | {r['knobs']} | {r.get('status')} | {fmt(r.get('step_time_s'), 1e3)} | "
            f"{fmt(r.get('tokens_per_s'), 1, 0)} | {fmt(r.get('tflops'))} | {fmt(r.get('mfu'), 100)}% | "
            f"{peak} ({est}) |"
        )
    print(f"\nCSV: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
