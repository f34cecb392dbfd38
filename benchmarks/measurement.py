"""Fast, trustworthy measurement (issue 16), measured: per-trial overhead with the warm start and
without, the study's device time before and after adaptive measurement, how often a first
measurement's interval covers its re-measurements, and the spread of one config measured 5 times.

    python benchmarks/measurement.py studies recipes/gpt-tiny.yaml --trials 12 --json out.json
    python benchmarks/measurement.py studies recipes/gpt-tiny.yaml --trials 12 --conditions local-warm --remeasure-top 6 --rounds 3
    python benchmarks/measurement.py studies recipes/gpt-tiny.yaml --trials 12 --conditions ray-before ray-warm --same-configs
    python benchmarks/measurement.py repeat recipes/gpt-tiny.yaml --times 5
    python benchmarks/measurement.py repeat recipes/gpt-tiny.yaml --times 5 --set cpu_affinity=per_rank
    python benchmarks/measurement.py pair recipes/gpt-tiny.yaml --repeats 2

`studies` runs, one after the other in one process (so all see the same machine):
- before: the measurement as it was (cold start, 2 warm-up + 5 measured steps, one re-measurement
  round), local executor;
- local-warm: adaptive measurement and the warm start, local executor, re-measurement as `tuner
  tune` does it (the top 3 once, then the ones tied with the best once more);
- ray-warm: the same on a local Ray runtime (no re-measurement);
- ray-before: the measurement as it was, on Ray (the cold start's overhead on Ray);
- local-cold / ray-cold: adaptive measurement, cold start (not in the default set: `before` and
  `ray-before` give the cold start's overhead with the same 2 warm-up steps in less time).
Each condition compiles cold, into an Inductor cache of its own. Each condition's search takes
its own path (what it measured steers its sampler), so two may run different configs: a few
compiled ones cost seconds each. `--same-configs` makes every later
condition run the first condition's device runs first, in the same order.
Other work on the machine inflates every number: compare the rows of one run, and note the load
average printed with each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from cli_args import recipe_path

CONDITIONS = {
    # name: (executor, warm start, adaptive measurement, top configs re-measured)
    "before": ("local", False, False, 3),
    "local-warm": ("local", True, True, 3),
    "local-cold": ("local", False, True, 0),
    "ray-warm": ("ray", True, True, 0),
    "ray-cold": ("ray", False, True, 0),
    "ray-before": ("ray", False, False, 0),
}
DEFAULT = ("before", "local-warm", "ray-warm", "ray-before")


def coverage(study, interval: str = "rerun") -> tuple[int, int]:
    """(covered, pairs): re-measurements inside the first measurement's 95% interval, as the
    ranking computes it, with the run-to-run noise of each config estimated from the study's OTHER
    re-measured configs and the family prior (so no pair is judged by an interval it helped set).
    `interval`: "rerun" (`rerun_interval`: where another run lands, the issue's check), "true"
    (`throughput_interval`: the config's true throughput, which a second noisy run falls outside
    more often by construction) or "steps" (the steps' interval alone, as before the run-to-run
    term)."""
    from tuner.record import keys
    from tuner.record.ranking import rerun_interval, run_noise, throughput_bounds, throughput_interval

    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    family = (study.user_attrs.get(keys.FINGERPRINT) or {}).get("family")
    groups = {
        number: [trials[number].user_attrs.get(keys.TOKENS_PER_S), *values]
        for number, values in keys.per_trial(study.user_attrs, keys.REMEASURED_PREFIX).items()
    }
    covered = pairs = 0
    for number, (tps, *values) in groups.items():
        ci = trials[number].user_attrs.get(keys.STEP_TIME_CI)
        if not tps or ci is None:
            continue
        if interval != "steps":
            noise = run_noise([g for n, g in groups.items() if n != number and g[0]], family)
            ci = (rerun_interval if interval == "rerun" else throughput_interval)(ci, noise)
        low, high = throughput_bounds(tps, ci)
        for v in values:
            pairs += 1
            covered += low <= v <= high
    return covered, pairs


def start_cpu_s(workdir: str) -> float | None:
    """Median CPU seconds all ranks of a trial used until rank 0 had built its training (the start
    cost the warm start removes; unlike wall time it hardly depends on the machine's load)."""
    from pathlib import Path

    values = []
    for path in Path(workdir).rglob("exits.json"):
        cpu = json.loads(path.read_text()).get("cpu_at_rank0_ready_s")
        if cpu is not None:
            values.append(cpu)
    return statistics.median(values) if values else None


def run_condition(
    recipe,
    name: str,
    trials: int,
    seed: int,
    top: int | None = None,
    rounds: int | None = None,
    enqueue: tuple = (),
) -> dict[str, Any]:
    """One study under condition `name`; `top` and `rounds` replace its re-measured configs and
    re-measurement rounds (more pairs for the coverage figure); `enqueue` configs run first."""
    import optuna

    import tuner.study.remeasure as remeasure
    from tuner.cli.tune import _preflight
    from tuner.executors import make_executor
    from tuner.record import keys
    from tuner.space import config_from_params
    from tuner.study import run_study

    kind, warm_on, adaptive, default_top = CONDITIONS[name]
    top = default_top if top is None else top
    if not adaptive:
        fixed = {"warmup_steps": 2, "steps": 5, "target_ci": None}
        recipe = recipe.model_copy(update={"measure": recipe.measure.model_copy(update=fixed)})
    remeasure.ROUNDS = rounds or (2 if adaptive else 1)
    tmp = tempfile.mkdtemp(prefix=f"tuner-measure-{name}-")
    # Each condition compiles into a cache of its own: with the shared default one, every
    # condition after the first loaded the graphs the first one compiled (4-7 s each here).
    env = {"TUNER_WARM_START": "1" if warm_on else "0", "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"}
    url = f"sqlite:///{tmp}/study.db"
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    with make_executor(kind, env=env) as executor:
        # What `tuner tune` does between starting its executor and the study (its warm helpers
        # import torch meanwhile), so that the first trial waits for them as it would there.
        _preflight(recipe, recipe.search.sampler)
        summary = run_study(
            recipe,
            storage_url=url,
            executor=executor,
            trials=trials,
            seed=seed,
            remeasure_top=top,
            workdir=tmp,
            enqueue=enqueue,
        )
    wall = time.monotonic() - t0
    study = optuna.load_study(study_name=summary.study_name, storage=url)
    ran_trials = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(keys.WALL_S)]
    ran = [t.user_attrs for t in ran_trials]
    ok = [a for a in ran if a.get(keys.MEASURED_S)]
    overhead = [a[keys.WALL_S] - a[keys.MEASURED_S] for a in ok]
    device_s = sum(a.get(keys.DEVICE_SECONDS) or 0.0 for a in ran)
    device_s += study.user_attrs.get(keys.REMEASURE_DEVICE_SECONDS, 0.0)
    covered, pairs = coverage(study)
    covered_true, _ = coverage(study, "true")
    covered_steps_only, _ = coverage(study, "steps")
    cis = [a[keys.STEP_TIME_CI] for a in ok if a.get(keys.STEP_TIME_CI) is not None]
    return {
        "condition": name,
        "device_runs": len(ran),
        "ok": len(ok),
        "overhead_s_median": statistics.median(overhead) if overhead else None,
        "overhead_share_median": statistics.median(
            o / a[keys.WALL_S] for o, a in zip(overhead, ok, strict=True)
        )
        if ok
        else None,
        "wall_s_median": statistics.median(a[keys.WALL_S] for a in ok) if ok else None,
        "measured_s_median": statistics.median(a[keys.MEASURED_S] for a in ok) if ok else None,
        "step_time_ci_median": statistics.median(cis) if cis else None,
        "start_cpu_s_median": start_cpu_s(tmp),
        "device_s_total": device_s,
        "remeasure_device_s": study.user_attrs.get(keys.REMEASURE_DEVICE_SECONDS, 0.0),
        "remeasure_runs": sum(
            len(v) for v in keys.per_trial(study.user_attrs, keys.REMEASURED_PREFIX).values()
        ),
        "study_wall_s": wall,
        "covered": covered,
        "covered_true_interval": covered_true,
        "covered_steps_only": covered_steps_only,
        "remeasurements": pairs,
        "best_tokens_per_s": summary.best.tokens_per_s if summary.best else None,
        "tie": bool(summary.tie),
        "load_avg_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "configs": [config_from_params(t.params).to_dict() for t in ran_trials],
    }


def studies(args) -> list[dict[str, Any]]:
    from tuner.config import Config
    from tuner.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    rows = []
    same: tuple = ()
    for name in args.conditions:
        if CONDITIONS[name][0] == "ray":
            import ray

            if not ray.is_initialized():
                ray.init(
                    address="local", num_cpus=args.ray_cpus, include_dashboard=False, logging_level="ERROR"
                )
        print(f"== {name}", file=sys.stderr, flush=True)
        rows.append(
            run_condition(recipe, name, args.trials, args.seed, args.remeasure_top, args.rounds, same)
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.same_configs and not same:  # the first condition's device runs, in their order
            same = tuple(Config.from_params(c) for c in rows[-1]["configs"])
    return rows


def repeat(args) -> dict[str, Any]:
    """`tuner measure RECIPE --json`, `--times` times in a row: the spread of one config's throughput."""
    values, cis = [], []
    for _ in range(args.times):
        out = subprocess.run(
            [sys.executable, "-m", "tuner.cli.main", "measure", args.recipe, "--json"]
            + [arg for knob in args.set for arg in ("--set", knob)],
            capture_output=True,
            text=True,
            check=True,
        )
        doc = json.loads(out.stdout)
        values.append(doc["tokens_per_s"])
        cis.append(doc["step_time_ci"])
        print(
            f"  {doc['tokens_per_s']:,.0f} tokens/s (ci {doc['step_time_ci']})", file=sys.stderr, flush=True
        )
    return {"set": args.set, "tokens_per_s": values, "step_time_ci": cis, "max_over_min": max(values) / min(values),
            "load_avg_1min": round(os.getloadavg()[0], 1)}  # fmt: skip


def plain_spec(recipe, workdir: str, tag: str, **fields: Any):
    """A trial of the recipe's plain config (data parallel over its devices), as `tuner measure`
    starts it; `fields`: more `TrialSpec` fields (a target interval, ...)."""
    from tuner.config import Config
    from tuner.devices import resolve_family
    from tuner.result import TrialSpec

    return TrialSpec(
        recipe=recipe.to_dict(),
        config=Config(dp=recipe.hardware.devices).to_dict(),
        family=resolve_family(recipe.hardware.device),
        workdir=workdir,
        timeout_s=recipe.measure.timeout_s,
        tag=tag,
        **fields,
    )


def pair(args) -> list[dict[str, Any]]:
    """The recipe's plain config, warm and cold start alternately (`--repeats` times each) through
    the local runner: where a trial's overhead goes with and without the helper."""
    from tuner.executors.local import prestart_helper, run_trial
    from tuner.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    prestart_helper()
    tmp = tempfile.mkdtemp(prefix="tuner-measure-pair-")
    rows = []
    for i in range(args.repeats):
        for warm_on in ("1", "0"):
            spec = plain_spec(recipe, f"{tmp}/{i}-{warm_on}", f"{i}-{warm_on}")
            r = run_trial(spec, env={"TUNER_WARM_START": warm_on})
            timeline = r.extra.get("timeline", {})
            rows.append(
                {
                    "start": r.extra.get("start"),
                    "status": r.status,
                    "overhead_s": r.overhead_s,
                    "wall_s": r.wall_s,
                    "rank0_ready_s": timeline.get("rank0_ready_s"),
                    "cpu_at_rank0_ready_s": timeline.get("cpu_at_rank0_ready_s"),
                    "warmup_s": r.extra.get("warmup_s"),
                    "load_avg_1min": round(os.getloadavg()[0], 1),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("studies", help="12-trial studies under each condition")
    s.add_argument("recipe", type=recipe_path)
    s.add_argument("--trials", type=int, default=12)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ray-cpus", type=int, default=2)
    s.add_argument("--remeasure-top", type=int, help="configs re-measured (default: the condition's, 3 or 0)")
    s.add_argument("--rounds", type=int, help="re-measurement rounds (default: 2 adaptive, 1 before)")
    s.add_argument("--conditions", nargs="+", default=list(DEFAULT), choices=list(CONDITIONS))
    s.add_argument("--json", help="also write the rows to this file")
    s.add_argument(
        "--same-configs",
        action="store_true",
        help="later conditions run the first one's configs first, in its order: device time "
        "compared on the same trials rather than on each search's own path",
    )
    r = sub.add_parser("repeat", help="one config measured several times with `tuner measure`")
    r.add_argument("recipe", type=recipe_path)
    r.add_argument("--times", type=int, default=5)
    r.add_argument(
        "--set", action="append", default=[], metavar="KNOB=VALUE", help="as `tuner measure --set`"
    )
    w = sub.add_parser("pair", help="the plain config, warm and cold start alternately")
    w.add_argument("recipe", type=recipe_path)
    w.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    result = {"studies": studies, "repeat": repeat, "pair": pair}[args.what](args)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
