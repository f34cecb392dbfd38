"""A real `tuner tune` of a recipe, measured: what it found and what each trial cost.

Runs `tuner.study.run_study` (the code behind `tuner tune`) on this machine's devices with a fresh
database, then reads the study back and reports:
- speedup of the best config over the baseline (both re-measured by the study);
- trials and wall time until the eventual best config was first measured; study wall time;
- overhead per trial: wall time outside the measured steps (launch, imports, model build, warm-up,
  teardown), median and as a share of the trial's wall time, per executor;
- the estimator's error: predicted vs measured peak memory per trial, median and worst, in % of
  the measured peak.

    python benchmarks/live_tune.py recipes/gpt-tiny.yaml --trials 16 --executor local
    python benchmarks/live_tune.py recipes/gpt-tiny.yaml --trials 16 --executor ray --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import optuna
from cli_args import recipe_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=recipe_path)
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--remeasure", type=int, default=3, help="top configs re-measured before the winner")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from tuner.executors import make_executor
    from tuner.recipe import load_recipe
    from tuner.study import run_study

    recipe = load_recipe(args.recipe)
    tmp = tempfile.mkdtemp(prefix="tuner-live-")
    url = f"sqlite:///{tmp}/live.db"
    done = []

    def progress(event: dict) -> None:
        if event["event"] == "trial_finished":
            r = event["result"]
            done.append(event)
            print(
                f"  trial {event['trial']:>3} {r.get('status', '?'):>7} {r.get('tokens_per_s') or 0:>9.0f} tok/s "
                f"(best {event['best_tokens_per_s'] or 0:.0f})",
                file=sys.stderr,
                flush=True,
            )

    t0 = time.time()
    with make_executor(args.executor) as executor:
        summary = run_study(
            recipe,
            storage_url=url,
            executor=executor,
            trials=args.trials,
            seed=args.seed,
            remeasure_top=args.remeasure,
            workdir=tmp,
            progress=progress,
        )
    wall = time.time() - t0

    study = optuna.load_study(study_name=summary.study_name, storage=url)
    ran = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("wall_s") is not None]
    ran.sort(key=lambda t: t.datetime_complete)
    best_no = summary.best.trial if summary.best else None
    reach = next((i for i, t in enumerate(ran, 1) if t.number == best_no), None)
    reach_s = (ran[reach - 1].datetime_complete.timestamp() - t0) if reach else None
    overhead = [
        t.user_attrs["wall_s"] - t.user_attrs["measured_s"] for t in ran if t.user_attrs.get("measured_s")
    ]
    share = [
        (t.user_attrs["wall_s"] - t.user_attrs["measured_s"]) / t.user_attrs["wall_s"]
        for t in ran
        if t.user_attrs.get("measured_s")
    ]
    est_err = [
        100
        * (t.user_attrs["estimated_peak_mem_bytes"] - t.user_attrs["peak_mem_allocated_bytes"])
        / t.user_attrs["peak_mem_allocated_bytes"]
        for t in ran
        if t.user_attrs.get("estimated_peak_mem_bytes") and t.user_attrs.get("peak_mem_allocated_bytes")
    ]
    by_split: dict[str, list[float]] = {}
    for t in ran:
        est, got = t.user_attrs.get("estimated_peak_mem_bytes"), t.user_attrs.get("peak_mem_allocated_bytes")
        if est and got:
            p = t.params
            label = f"{p.get('parallel')}{'-' + p['dp_shard'] if 'dp_shard' in p else ''}"
            label += "-sp" if p.get("sequence_parallel") else ""
            by_split.setdefault(label, []).append(100 * (est - got) / got)
    out = {
        "recipe": recipe.name,
        "executor": args.executor,
        "trials": len(study.trials),
        "device_runs": len(ran),
        "pruned": sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials),
        "best_tokens_per_s": summary.best.tokens_per_s if summary.best else None,
        "baseline_tokens_per_s": summary.baseline.tokens_per_s if summary.baseline else None,
        "speedup": summary.speedup,
        "tie": bool(summary.tie),
        "device_runs_to_best": reach,
        "seconds_to_best": round(reach_s, 1) if reach_s else None,
        "study_wall_s": round(wall, 1),
        "overhead_s_median": round(statistics.median(overhead), 2) if overhead else None,
        "overhead_share_median": round(statistics.median(share), 3) if share else None,
        "estimator_error_pct_median": round(statistics.median(abs(e) for e in est_err), 1)
        if est_err
        else None,
        "estimator_error_pct_worst": round(max(est_err, key=abs), 1) if est_err else None,
        "estimator_error_pct_by_split": {
            k: {
                "n": len(v),
                "median_abs": round(statistics.median(abs(e) for e in v), 1),
                "worst": round(max(v, key=abs), 1),
            }
            for k, v in sorted(by_split.items())
        },  # fmt: skip
        "best_config": summary.best.config if summary.best else None,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    for k, v in out.items():
        print(f"{k:>28}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
