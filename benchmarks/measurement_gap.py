"""Does a trial started right after another measure slower than one started after a pause? The
study's re-measurements run back to back (about 0.1 s apart), its trials about 1 s apart (the
sampler's turn). The recipe's plain config, in alternating blocks of `--runs` trials: back to back,
then each after `--gap` seconds idle, through the local runner with the warm start.

    python benchmarks/measurement_gap.py recipes/gpt-tiny.yaml --blocks 4 --runs 3 --gap 1.5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/measurement.py

from cli_args import recipe_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=recipe_path)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="trials per block")
    ap.add_argument("--gap", type=float, default=1.5, help="idle seconds before each trial of a paused block")
    ap.add_argument("--target-ci", type=float, default=0.05)
    args = ap.parse_args(argv)

    from measurement import plain_spec

    from tuner.executors.local import prestart_helper, run_trial
    from tuner.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    prestart_helper()  # the first trial waits until it has imported torch
    tmp = tempfile.mkdtemp(prefix="tuner-measure-gap-")
    out: dict[str, list[float]] = {"back_to_back": [], "after_gap": []}
    i = 0
    for _ in range(args.blocks):
        for mode in out:
            for _ in range(args.runs):
                if mode == "after_gap":
                    time.sleep(args.gap)
                r = run_trial(plain_spec(recipe, f"{tmp}/{i}", f"gap-{i}", target_ci=args.target_ci))
                i += 1
                out[mode].append(r.tokens_per_s)
                print(
                    f"  {mode}: {r.tokens_per_s:,.0f} tokens/s (ci {r.step_time_ci})",
                    file=sys.stderr,
                    flush=True,
                )
    every = [v for values in out.values() for v in values]
    summary = {mode: {"median": statistics.median(v), "runs": len(v)} for mode, v in out.items()}
    print(json.dumps({**summary, "max_over_min": max(every) / min(every), "tokens_per_s": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
