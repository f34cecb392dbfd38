"""The performance model's priors for low precision, checked on this machine: one config of a recipe
measured at every AMP level the CPU offers (fp32, then O1 and O2 with each autocast dtype), beside
what the priors alone predict for it (no trial fitted). Shows whether the priors know how fast this
CPU's bf16/fp16 matmuls are, native units or not (`DeviceInfo.fast_dtypes`). Real trials
(`tuner.executors.local.run_trial`), in turns, `--rounds` times.

    python benchmarks/amp_priors.py recipes/gpt-tiny.yaml --set micro_batch_size=8 --json benchmarks/results/amp-priors.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from cli_args import recipe_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=recipe_path)
    ap.add_argument(
        "--set", action="append", default=[], metavar="KNOB=VALUE", help="as `tuner measure --set`"
    )
    ap.add_argument("--rounds", type=int, default=1, help="measure every level this many times, in turns")
    ap.add_argument("--json", default=None, help="write the measurements and predictions here")
    args = ap.parse_args(argv)

    from tuner.cli.common import parse_sets
    from tuner.cli.measure import default_config
    from tuner.config import ConfigError
    from tuner.devices import describe, resolve_family
    from tuner.executors.local import prestart_helper, run_trial
    from tuner.perf.predictor import Predictor
    from tuner.recipe import load_recipe
    from tuner.record.status import OK
    from tuner.result import TrialSpec

    recipe = load_recipe(args.recipe)
    device = describe(resolve_family(recipe.hardware.device))
    knobs = parse_sets(args.set)
    levels = [("O0", None)] + [(amp, d) for d in device.amp_dtypes for amp in ("O1", "O2")]
    names = [amp if d is None else f"{amp}-{d}" for amp, d in levels]
    try:
        configs = [
            default_config(recipe.hardware.devices, {**knobs, "amp": amp, **({"amp_dtype": d} if d else {})})
            for amp, d in levels
        ]
    except ConfigError as err:
        ap.error(f"--set: {err}")
    predictor = Predictor(device)
    predicted = predictor.predict(recipe, configs).tokens_per_s
    peaks = {d: round(v / 1e9, 1) for d, v in predictor.priors.peak_flops.items()}
    print(f"{device.name}: native low precision {list(device.fast_dtypes) or 'none'}; one thread's "
          f"F.linear GFLOP/s {peaks}", flush=True)  # fmt: skip
    prestart_helper()
    measured: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    with tempfile.TemporaryDirectory(prefix="amp-priors-") as tmp:
        for r in range(args.rounds):
            for i, config in enumerate(configs):
                spec = TrialSpec(
                    recipe=recipe.to_dict(), config=config.to_dict(), family=device.family,
                    workdir=f"{tmp}/{r}-{i}", timeout_s=recipe.measure.timeout_s, tag=f"amp-{r}-{i}",
                )  # fmt: skip
                res = run_trial(spec)
                if res.status == OK:
                    measured[i].append(res.tokens_per_s)
                print(f"  round {r + 1} {names[i]}: {res.status} {res.tokens_per_s}", flush=True)
    rows = []
    fp32 = statistics.median(measured[0]) if measured[0] else None
    for i, (amp, dtype) in enumerate(levels):
        m = statistics.median(measured[i]) if measured[i] else None
        rows.append({
            "amp": amp, "amp_dtype": dtype, "predicted": round(float(predicted[i]), 1),
            "measured": m and round(m, 1), "runs": measured[i],
            "predicted_over_measured": m and round(float(predicted[i]) / m, 3),
            "measured_over_fp32": m and fp32 and round(m / fp32, 3),
            "predicted_over_fp32": round(float(predicted[i] / predicted[0]), 3),
        })  # fmt: skip
    print("| level | predicted tokens/s | measured | predicted/measured | measured/fp32 | predicted/fp32 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in zip(names, rows, strict=True):
        print(f"| {name} | {row['predicted']:,.0f} | {row['measured'] or 0:,.0f} | {row['predicted_over_measured']} "
              f"| {row['measured_over_fp32']} | {row['predicted_over_fp32']} |")  # fmt: skip
    if args.json:
        out = {"recipe": recipe.name, "knobs": knobs, "device": device.name, "fast_dtypes": list(device.fast_dtypes),
               "peak_gflops_one_thread": peaks, "rows": rows, "load_average_1min": round(os.getloadavg()[0], 1)}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
