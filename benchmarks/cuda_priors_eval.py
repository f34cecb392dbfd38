"""The performance model's CUDA priors, before any trial, against what an H200 measured.

Reads the configs measured on an H200 (benchmarks/results/cuda-h200-dec04-measured.csv: knobs
over the base config of benchmarks/cuda_measure.py, and tokens/s), predicts each from the device
priors alone (`tuner.perf.predictor.Predictor` with no observations, on the catalogue's H200) and
prints each error, the median absolute error and the rank correlation. No GPU needed.

    python benchmarks/cuda_priors_eval.py
    python benchmarks/cuda_priors_eval.py --efficiency 0.45 --half-tokens 1024   # other priors
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_measure import BASE, _recipe  # noqa: E402
from perf_model_eval import spearman  # noqa: E402

ROOT = Path(__file__).resolve().parent
MEASURED = ROOT / "results" / "cuda-h200-dec04-measured.csv"
RECIPE = ROOT / "recipes" / "llama3-8b-4l-1gpu.yaml"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--efficiency", type=float, help="the CUDA efficiency prior to try instead")
    ap.add_argument("--half-tokens", type=float, help="the CUDA half-efficiency tokens prior to try")
    args = ap.parse_args(argv)

    from tuner.config import Config
    from tuner.devices import known_device
    from tuner.perf import priors
    from tuner.perf.predictor import Predictor

    if args.efficiency or args.half_tokens:
        eff, half, *rest = priors._PRIORS["cuda"]
        priors._PRIORS["cuda"] = (args.efficiency or eff, args.half_tokens or half, *rest)
    rows = list(csv.DictReader(MEASURED.open()))
    recipe = _recipe(str(RECIPE), None)
    device = known_device("H200", count=1)
    configs = [Config.from_params({**BASE, **json.loads(r["knobs"]), "dp": 1}) for r in rows]
    measured = np.array([float(r["tokens_per_s"]) for r in rows])
    predicted = Predictor(device).predict(recipe, configs).tokens_per_s
    errors = predicted / measured - 1
    eff, half = priors._PRIORS["cuda"][:2]
    print(f"CUDA priors: efficiency {eff}, half-efficiency tokens {half:g}; {recipe.name} on H200\n")
    print("| knobs over the base | measured tokens/s | predicted | error |")
    print("|---|---:|---:|---:|")
    for r, m, p, e in zip(rows, measured, predicted, errors, strict=True):
        print(f"| {r['knobs']} | {m:,.0f} | {p:,.0f} | {e:+.1%} |")
    rank = spearman(measured, predicted)
    print(f"\nmedian |error| {np.median(np.abs(errors)):.1%}, Spearman {rank:.3f} over {len(rows)} configs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
