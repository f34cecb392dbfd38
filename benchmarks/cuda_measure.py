"""Measure Llama-3 8B (fewer layers, so one GPU holds it) on an NVIDIA GPU across the CUDA knobs.

Sweeps attention backends (flash, efficient, cudnn, math), precision (bf16 / fp16 autocast, O2,
fp32 with and without TF32 on a kernel that takes fp32), compile modes (none, default,
max-autotune), recompute and the allocator's expandable segments, one knob family
at a time around a strong base config, each as a real trial through the same runner `tuner
measure` uses. Stops starting trials when the time cap is near, so one prepared run fits the
device machine's budget. Prints a Markdown table (paste it into BENCHMARKS.md) and writes a CSV.

    python benchmarks/cuda_measure.py benchmarks/recipes/llama3-8b-4l-1gpu.yaml --max-minutes 7.5

Exits 0 with a note (and measures nothing) when no NVIDIA GPU is visible.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

# The tests load this file with runpy, which does not put its folder on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_args import recipe_path  # noqa: E402

BASE = {
    "micro_batch_size": 1,
    "attention": "flash",
    "amp": "O1",
    "amp_dtype": "bf16",
    "tf32": True,
    "compile": "none",
    "recompute": "none",
    "optimizer_impl": "fused",
}

# (group, overrides on BASE), most informative first: the time cap drops the tail.
SWEEP: list[tuple[str, dict]] = [
    ("attention", {"attention": "flash"}),
    ("attention", {"attention": "cudnn"}),
    ("attention", {"attention": "efficient"}),
    ("attention", {"attention": "math"}),
    ("precision", {"amp": "O2", "amp_dtype": "bf16"}),
    ("precision", {"amp": "O1", "amp_dtype": "fp16"}),
    ("precision", {"amp": "O0", "tf32": True, "attention": "efficient"}),
    ("precision", {"amp": "O0", "tf32": False, "attention": "efficient"}),
    ("precision", {"amp": "O0", "attention": "flash"}),  # must be refused by the rules, not run
    ("recompute", {"recompute": "selective"}),
    ("recompute", {"recompute": "full"}),
    ("memory", {"alloc_conf": "expandable_segments"}),
    ("memory", {"micro_batch_size": 2}),
    ("compile", {"compile": "default"}),
    # reduce-overhead failed on an H200 (BENCHMARKS "CUDA") and the rules refuse it now.
    ("compile", {"compile": "max-autotune"}),
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
    "peak_mem_reserved_bytes",
    "mem_fragmentation_bytes",
    "estimated_peak_mem_bytes",
    "wall_s",
    "error",
]


def _recipe(path: str, layers: int | None):
    from tuner.recipe import load_recipe, recipe_from_dict

    recipe = load_recipe(path)
    if layers is None:
        return recipe
    data = recipe.to_dict()
    data["model"]["layers"] = layers
    data["name"] = f"{recipe.name}-{layers}l"
    return recipe_from_dict(data, source=f"{path} (layers={layers})")


def _table(rows: list[dict]) -> None:
    def fmt(v, scale=1.0, nd=1):
        return "" if v is None else f"{v * scale:.{nd}f}"

    gib = 1 / 2**30
    print(
        "\n| group | knobs | status | step ms | tokens/s | MFU | peak alloc GiB | reserved | fragm. | est. |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['group']} | {r['knobs']} | {r.get('status')} | {fmt(r.get('step_time_s'), 1e3)} | "
            f"{fmt(r.get('tokens_per_s'), 1, 0)} | {fmt(r.get('mfu'), 100)}% | "
            f"{fmt(r.get('peak_mem_allocated_bytes'), gib, 2)} | {fmt(r.get('peak_mem_reserved_bytes'), gib, 2)} | "
            f"{fmt(r.get('mem_fragmentation_bytes'), gib, 2)} | {fmt(r.get('estimated_peak_mem_bytes'), gib, 2)} |"
        )


def _dry_run(recipe, device_name: str) -> int:
    """What the sweep would run on `device_name`: the same configs, through the same rules."""
    from tuner.config import Config, infeasible_reasons
    from tuner.devices import known_device

    info = known_device(device_name, count=recipe.hardware.devices)
    for group, over in SWEEP:
        config = Config.from_params({**BASE, **over, "dp": recipe.hardware.devices})
        reasons = infeasible_reasons(config, recipe, info)
        label = ", ".join(f"{k}={v}" for k, v in over.items())
        print(f"{group}: {label}: {'infeasible: ' + '; '.join(reasons) if reasons else 'runs'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "recipe", type=recipe_path, nargs="?", default="recipes/llama3-8b.yaml", help="recipe YAML"
    )
    ap.add_argument("--layers", type=int, default=4, help="decoder layers to keep (one GPU must hold them)")
    ap.add_argument("--max-minutes", type=float, default=7.5, help="start no trial after this")
    ap.add_argument("--out", default="benchmarks/results/cuda.csv", help="CSV to write")
    ap.add_argument("--only", default=None, help="comma-separated groups to run (default: all)")
    ap.add_argument("--dry-run", metavar="DEVICE", help="no GPU needed: print each config's verdict on a "
                    "catalogued device (e.g. H200) and measure nothing")  # fmt: skip
    args = ap.parse_args(argv)

    import torch

    if args.dry_run:
        return _dry_run(_recipe(args.recipe, args.layers), args.dry_run)
    if not torch.cuda.is_available():
        print("no NVIDIA GPU visible (torch.cuda.is_available() is False): nothing measured")
        return 0

    from tuner.config import Config, infeasible_reasons
    from tuner.devices import describe
    from tuner.estimate import estimate
    from tuner.executors.local import run_trial
    from tuner.result import TrialSpec

    start = time.monotonic()
    recipe = _recipe(args.recipe, args.layers)
    info = describe("cuda")
    groups = set(args.only.split(",")) if args.only else None
    print(f"# {recipe.name} on {info.name} (torch {torch.__version__}, CUDA {torch.version.cuda})\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tuner-cuda-") as tmp:
        for i, (group, over) in enumerate(SWEEP):
            if groups and group not in groups:
                continue
            label = ", ".join(f"{k}={v}" for k, v in over.items())
            if time.monotonic() - start > args.max_minutes * 60:
                rows.append({"group": group, "knobs": label, "status": "not run (time cap)"})
                continue
            config = Config.from_params({**BASE, **over, "dp": recipe.hardware.devices})
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
                timeout_s=min(recipe.measure.timeout_s, 120.0),
                estimated_peak_mem_bytes=estimate(recipe, config, info).peak_mem_bytes,
                tag=str(i),
            )
            res = run_trial(spec)
            rows.append({"group": group, "knobs": label, **res.public(), "wall_s": res.wall_s})
            print(
                f"{label}: {res.status} tokens/s={res.tokens_per_s} mfu={res.mfu} ({res.error or ''})",
                flush=True,
            )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    _table(rows)
    print(f"\nCSV: {out}; {time.monotonic() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
