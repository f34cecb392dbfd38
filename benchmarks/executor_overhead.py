"""What running trials through Ray costs and buys, against the local executor.

1. Overhead per trial (`result.wall_s - result.measured_s`: launch, imports, model build, warm-up,
   teardown, and for Ray also scheduling) of the same recipe, one trial at a time, alternating
   between the executors; and the part of Ray's that is Ray's own (scheduling, result transport).
2. Speedup from concurrent trials: the same 1-rank trials on a local Ray runtime, one at a time
   versus as many at once as the runtime's CPUs allow (each pinned to its own core).

    python benchmarks/executor_overhead.py recipes/gpt-tiny.yaml --repeats 3 --trials 4

Other work on the machine inflates every number; compare the two columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from cli_args import recipe_path

from tuner.config import Config
from tuner.devices import resolve_family
from tuner.executors.base import Executor
from tuner.recipe import Recipe, load_recipe
from tuner.result import TrialResult, TrialSpec


def make_spec(recipe: Recipe, family: str, workdir: Path, tag: str, ranks: int) -> TrialSpec:
    recipe = recipe.model_copy(update={"hardware": recipe.hardware.model_copy(update={"devices": ranks})})
    return TrialSpec(
        recipe=recipe.to_dict(),
        config=Config(dp=ranks).to_dict(),
        family=family,
        workdir=str(workdir / tag),
        timeout_s=recipe.measure.timeout_s,
        tag=tag,
    )


def run_all(executor: Executor, specs: list[TrialSpec], concurrent: bool) -> tuple[list[TrialResult], float]:
    """Run `specs` (all at once as slots allow, or one by one); return the results and the makespan."""
    queue, results = list(specs), []
    t0 = time.monotonic()
    while queue or executor.running():
        while queue and executor.free_slots(queue[0]) > 0 and (concurrent or not executor.running()):
            executor.submit(queue.pop(0))
        results += executor.wait(timeout=1.0)
    makespan = time.monotonic() - t0
    failed = [r for r in results if r.status != "ok"]
    if failed:
        raise SystemExit(f"trial {failed[0].tag} failed ({failed[0].status}): {failed[0].error}")
    return results, makespan


def overheads(results: list[TrialResult]) -> dict[str, float]:
    values = [r.overhead_s for r in results]
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", type=recipe_path, help="recipe file, e.g. recipes/gpt-tiny.yaml")
    parser.add_argument("--repeats", type=int, default=3, help="trials per executor for the overhead")
    parser.add_argument("--trials", type=int, default=4, help="1-rank trials for the concurrency speedup")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray runtime")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args()

    import ray

    from tuner.executors.local import LocalExecutor
    from tuner.executors.ray_executor import RayExecutor

    recipe = load_recipe(args.recipe)
    family = resolve_family(recipe.hardware.device)
    ranks = recipe.hardware.devices
    work = Path(tempfile.mkdtemp(prefix="executor-overhead-"))
    out: dict[str, object] = {"recipe": args.recipe, "family": family, "ranks": ranks, "ray_cpus": args.cpus}

    ray.init(
        address="local",
        num_cpus=args.cpus,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
    )
    with LocalExecutor() as local_ex, RayExecutor() as ex:
        # Alternate the executors so that both see the same background load.
        local, ray_results = [], []
        for i in range(args.repeats):
            local += run_all(
                local_ex, [make_spec(recipe, family, work, f"local-{i}", ranks)], concurrent=False
            )[0]
            ray_results += run_all(
                ex, [make_spec(recipe, family, work, f"ray-{i}", ranks)], concurrent=False
            )[0]
        out["local_overhead"] = overheads(local)
        out["ray_overhead"] = overheads(ray_results)
        # Of that, what Ray itself adds: submit to result on the driver, minus run_trial's own wall.
        out["ray_scheduling_s"] = statistics.median(r.wall_s - r.extra["node_wall_s"] for r in ray_results)
        one = [make_spec(recipe, family, work, f"seq-{i}", 1) for i in range(args.trials)]
        _, sequential_s = run_all(ex, one, concurrent=False)
        many = [make_spec(recipe, family, work, f"par-{i}", 1) for i in range(args.trials)]
        _, concurrent_s = run_all(ex, many, concurrent=True)
    ray.shutdown()
    out.update(
        sequential_s=sequential_s,
        concurrent_s=concurrent_s,
        speedup=sequential_s / concurrent_s,
        trials=args.trials,
    )

    if args.json:
        print(json.dumps(out, indent=1))
        return
    lo, ro = out["local_overhead"], out["ray_overhead"]
    print(f"recipe {args.recipe} on {family}: {args.repeats} trials of {ranks} ranks per executor")
    print("| executor | overhead per trial, median (min-max) |")
    print("| --- | --- |")
    print(f"| local | {lo['median_s']:.2f} s ({lo['min_s']:.2f}-{lo['max_s']:.2f}) |")
    print(f"| ray | {ro['median_s']:.2f} s ({ro['min_s']:.2f}-{ro['max_s']:.2f}) |")
    print(
        f"of Ray's overhead, scheduling and result transport (driver wall - node wall): {out['ray_scheduling_s']:.2f} s"
    )
    print(
        f"{args.trials} 1-rank trials on a {args.cpus}-CPU Ray runtime: one at a time {sequential_s:.1f} s, "
        f"concurrently {concurrent_s:.1f} s, speedup {sequential_s / concurrent_s:.2f}x"
    )


if __name__ == "__main__":
    main()
