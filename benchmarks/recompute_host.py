"""What activation checkpointing costs the host, in layer passes.

Builds a model so small that its kernels cost next to nothing (4 layers, hidden 16, 8 tokens),
so a training step's time is host work: Python, the dispatcher, autograd. Times steps with no,
selective and full recompute, interleaved round by round on one thread, and reports what one
recomputed layer adds in units of a plain layer pass (a step without recompute is 2 passes per
layer plus 2 for the embedding and head: the performance model's `units_micro`).

    python benchmarks/recompute_host.py
    python benchmarks/recompute_host.py --families gpt llama --rounds 60 --json benchmarks/results/recompute-host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MODES = ("none", "selective", "full")


def measure(family: str, rounds: int, steps: int = 10) -> dict:
    import torch

    from tuner.recipe import recipe_from_dict
    from tuner.workload.apply import apply_recompute
    from tuner.workload.model import build_model

    torch.set_num_threads(1)
    spec = {"family": family, "layers": 4, "hidden": 16, "heads": 2, "seq_len": 8, "vocab": 64}
    if family == "llama":
        spec.update(kv_heads=1, ffn=64)
    recipe = recipe_from_dict({"name": f"host-{family}", "model": spec})
    models = {}
    for mode in MODES:
        model = build_model(recipe.model, "math", 0, torch.device("cpu"))
        if mode != "none":
            apply_recompute(model, mode)
        models[mode] = model
    tokens = torch.randint(0, 64, (1, 8))

    def step(model) -> float:
        t0 = time.perf_counter()
        model.loss(model(tokens), tokens).backward()
        return time.perf_counter() - t0

    for model in models.values():  # warm-up: allocator, autograd caches
        for _ in range(50):
            step(model)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, model in models.items():
            times[mode].append(sum(step(model) for _ in range(steps)) / steps)
    median = {mode: statistics.median(v) for mode, v in times.items()}
    layers = spec["layers"]
    unit = median["none"] / (2 * layers + 2)
    return {
        "family": family,
        "rounds": rounds,
        "step_ms": {mode: round(v * 1e3, 3) for mode, v in median.items()},
        # What one recomputed layer adds, in plain layer passes.
        "units_per_recomputed_layer": {
            mode: round((median[mode] - median["none"]) / unit / layers, 2) for mode in ("selective", "full")
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    ap.add_argument("--rounds", type=int, default=40, help="interleaved rounds of 10 steps per mode")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    results = []
    for family in args.families:
        r = measure(family, args.rounds)
        results.append(r)
        print(
            f"{family}: step {r['step_ms']['none']:.2f} / {r['step_ms']['selective']:.2f} / "
            f"{r['step_ms']['full']:.2f} ms (none / selective / full); one recomputed layer adds "
            f"{r['units_per_recomputed_layer']['selective']:.2f} (selective) and "
            f"{r['units_per_recomputed_layer']['full']:.2f} (full) layer passes",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
