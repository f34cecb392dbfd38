"""The plan beyond the measured device count, checked on this machine: measure a few 1- and
2-rank configs of a recipe, fit the performance model to them, predict 4-rank configs, then
measure those too (4 ranks on fewer cores share them, as the model's oversubscription says) and
report the prediction error. Every trial is a real run (`tuner.executors.local.run_trial`).

    python benchmarks/perf_extrapolate.py recipes/gpt-tiny.yaml --out benchmarks/results/perf-extrapolate.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from tuner.config import Config
from tuner.devices import describe
from tuner.estimate import estimate
from tuner.executors.local import run_trial
from tuner.perf.observations import Observation
from tuner.perf.predictor import Predictor
from tuner.recipe import load_recipe
from tuner.result import TrialSpec

# (devices, knobs) measured for the fit, then the 4-rank configs predicted and measured.
FIT = [
    (1, {"micro_batch_size": 2}), (1, {"micro_batch_size": 8}), (1, {"micro_batch_size": 8, "amp": "O1"}),
    (1, {"micro_batch_size": 4, "recompute": "full"}),
    (2, {"dp": 2, "micro_batch_size": 2}), (2, {"dp": 2, "micro_batch_size": 8}),
    (2, {"dp": 2, "micro_batch_size": 4, "amp": "O1"}), (2, {"tp": 2, "micro_batch_size": 4}),
    (2, {"pp": 2, "micro_batch_size": 4}),
]  # fmt: skip
PREDICT = [
    {"dp": 4, "micro_batch_size": 2}, {"dp": 4, "micro_batch_size": 4}, {"dp": 4, "micro_batch_size": 4, "amp": "O1"},
    {"dp": 2, "tp": 2, "micro_batch_size": 4}, {"dp": 2, "pp": 2, "micro_batch_size": 4},
    {"tp": 4, "micro_batch_size": 4},
]  # fmt: skip


def _recipe(base, devices: int):
    hardware = base.hardware.model_copy(update={"devices": devices, "device": "cpu"})
    return base.model_copy(update={"hardware": hardware})


def measure(recipe, config: Config, workdir: Path) -> dict:
    spec = TrialSpec(
        recipe=recipe.to_dict(), config=config.to_dict(), family="cpu", workdir=str(workdir),
        timeout_s=recipe.measure.timeout_s,
        estimated_peak_mem_bytes=int(estimate(recipe, config, describe("cpu")).peak_mem_bytes), tag=workdir.name,
    )  # fmt: skip
    res = run_trial(spec)
    print(
        f"  {config.world_size} ranks {json.dumps(config.active_params())}: {res.status} {res.tokens_per_s}",
        flush=True,
    )
    return res.to_dict()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--out", default=None, help="write every measurement and prediction here (JSON)")
    args = ap.parse_args(argv)
    base = load_recipe(args.recipe)
    device = describe("cpu")
    observations, fit_rows = [], []
    with tempfile.TemporaryDirectory(prefix="perf-extrapolate-") as tmp:
        for i, (n, knobs) in enumerate(FIT):
            recipe, config = _recipe(base, n), Config(**knobs)
            res = measure(recipe, config, Path(tmp) / f"fit{i}")
            fit_rows.append({"devices": n, "config": knobs, "tokens_per_s": res["tokens_per_s"]})
            if res["status"] == "ok":
                observations.append(Observation(recipe, config, "ok", res["tokens_per_s"],
                                                0.25 * (res["step_time_spread"] or 0),
                                                res["peak_mem_allocated_bytes"], res["estimated_peak_mem_bytes"]))  # fmt: skip
        predictor = Predictor(device).fit(observations)
        recipe4 = _recipe(base, 4)
        configs = [Config(**k) for k in PREDICT]
        p = predictor.predict(recipe4, configs)
        rows = []
        for i, config in enumerate(configs):
            res = measure(recipe4, config, Path(tmp) / f"four{i}")
            rows.append({
                "config": PREDICT[i], "predicted": float(p.tokens_per_s[i]),
                "interval": [float(p.tokens_low[i]), float(p.tokens_high[i])], "measured": res["tokens_per_s"],
            })  # fmt: skip
    errors = [abs(r["predicted"] / r["measured"] - 1) for r in rows if r["measured"]]
    inside = [r["interval"][0] <= r["measured"] <= r["interval"][1] for r in rows if r["measured"]]
    summary = {"recipe": base.name, "fit": fit_rows, "four_ranks": rows,
               "median_abs_error": float(np.median(errors)) if errors else None,
               "max_abs_error": max(errors, default=None), "inside_90": sum(inside), "measured": len(inside),
               "cores": device.count}  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k not in ("fit", "four_ranks")}))
    for r in rows:
        print(f"  4 ranks {json.dumps(r['config'])}: predicted {r['predicted']:,.0f} "
              f"(90% {r['interval'][0]:,.0f}-{r['interval'][1]:,.0f}), measured {r['measured'] or 0:,.0f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
