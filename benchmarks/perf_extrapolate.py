"""The plan beyond the measured device count, checked on this machine: measure a few 1- and
2-rank configs of a recipe, fit the performance model to them, predict 4-rank configs, then
measure those too (4 ranks on fewer cores share them, as the model's oversubscription says) and
report the prediction error. Every trial is a real run (`tuner.executors.local.run_trial`).

    python benchmarks/perf_extrapolate.py recipes/gpt-tiny.yaml --out benchmarks/results/perf-extrapolate.json
    python benchmarks/perf_extrapolate.py recipes/gpt-tiny.yaml --refit benchmarks/results/perf-extrapolate.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from cli_args import recipe_path

from tuner.config import Config
from tuner.devices import describe
from tuner.estimate import estimate
from tuner.executors.local import run_trial
from tuner.perf.observations import Observation, relative_sd
from tuner.perf.predictor import Predictor, prediction_error
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


def _observation(recipe, config: Config, res: dict) -> Observation:
    return Observation(recipe, config, "ok", res["tokens_per_s"], relative_sd(res),
                       res["peak_mem_allocated_bytes"], res["estimated_peak_mem_bytes"])  # fmt: skip


def _measure_all(base, tmp: Path) -> tuple[list[dict], list[dict]]:
    """Every run, (devices, knobs, the trial's result, the load average when it ended) each: the
    fit set and the 4-rank set interleaved, so that a drift in what else the machine runs falls
    on both alike."""
    plan = [("fit", n, k) for n, k in FIT]
    four = [("four", 4, k) for k in PREDICT]
    order = [x for pair in itertools.zip_longest(plan, four) for x in pair if x is not None]
    runs = {"fit": [], "four": []}
    for i, (kind, n, knobs) in enumerate(order):
        result = measure(_recipe(base, n), Config(**knobs), tmp / f"{kind}{i}")
        runs[kind].append({"devices": n, "config": knobs, "result": result, "load_1min": os.getloadavg()[0]})
    return runs["fit"], runs["four"]


def _predict(base, device, fit: list[dict], four: list[dict]) -> list[dict]:
    """Fit to the ok runs of `fit`; predict each of `four` (and the fit runs, in-sample)."""
    observations = [_observation(_recipe(base, r["devices"]), Config(**r["config"]), r["result"])
                    for r in fit if r["result"]["status"] == "ok"]  # fmt: skip
    predictor = Predictor(device).fit(observations)
    rows = []
    for r in [*fit, *four]:
        p = predictor.predict(_recipe(base, r["devices"]), [Config(**r["config"])])
        rows.append({
            "devices": r["devices"], "config": r["config"], "fitted": r in fit,
            "predicted": float(p.tokens_per_s[0]), "interval": [float(p.tokens_low[0]), float(p.tokens_high[0])],
            "measured": r["result"]["tokens_per_s"],
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=recipe_path)
    ap.add_argument("--out", default=None, help="write every measurement and prediction here (JSON)")
    ap.add_argument(
        "--refit",
        default=None,
        metavar="JSON",
        help="re-fit to the runs of an earlier --out, measuring nothing",
    )
    args = ap.parse_args(argv)
    base = load_recipe(args.recipe)
    device = describe("cpu")
    if args.refit:
        earlier = json.loads(Path(args.refit).read_text())
        fit, four, load = earlier["runs_fit"], earlier["runs_four"], earlier["load_average_1min"]
        device = dataclasses.replace(device, count=earlier["cores"])  # the cores the runs had
    else:
        load = [os.getloadavg()[0]]  # the machine may be shared: say how busy it was
        with tempfile.TemporaryDirectory(prefix="perf-extrapolate-") as tmp:
            fit, four = _measure_all(base, Path(tmp))
        load.append(os.getloadavg()[0])
    rows = _predict(base, device, fit, four)
    held = [r for r in rows if not r["fitted"] and r["measured"]]
    errors = [float(prediction_error(r["predicted"], r["measured"])) for r in held]
    in_sample = [
        float(prediction_error(r["predicted"], r["measured"])) for r in rows if r["fitted"] and r["measured"]
    ]
    inside = [r["interval"][0] <= r["measured"] <= r["interval"][1] for r in held]
    summary = {"recipe": base.name, "predictions": rows, "runs_fit": fit, "runs_four": four,
               "median_abs_error": float(np.median(errors)) if errors else None,
               "max_abs_error": max(errors, default=None), "inside_90": sum(inside), "measured": len(inside),
               "median_abs_error_in_sample": float(np.median(in_sample)) if in_sample else None,
               "cores": device.count, "load_average_1min": load}  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k not in ("predictions", "runs_fit", "runs_four")}))
    for r in rows:
        print(f"  {'fit' if r['fitted'] else 'NEW'} {r['devices']} ranks {json.dumps(r['config'])}: predicted "
              f"{r['predicted']:,.0f} (90% {r['interval'][0]:,.0f}-{r['interval'][1]:,.0f}), measured {r['measured'] or 0:,.0f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
