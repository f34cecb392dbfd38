"""The cost of the cross-node path: the same 2-rank config measured on one host (local runner) and
as a 2-node trial on a Ray cluster (one rank per node, one placement group), alternated A B A B so
drift of the machine's load falls on both.

    ray start --head --port 6380 --num-cpus 1 --node-ip-address 127.0.0.1 --temp-dir /tmp/ray-a
    ray start --address 127.0.0.1:6380 --num-cpus 1 --node-ip-address 127.0.0.1 --temp-dir /tmp/ray-b \\
        --dashboard-agent-listen-port 52366 --metrics-export-port 52367 --runtime-env-agent-port 52368
    python benchmarks/multinode.py --address 127.0.0.1:6380 --repeats 3

Prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", required=True, help="a Ray cluster of at least 2 nodes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)

    from conftest_ray import tiny_spec

    from tuner.executors.local import run_trial
    from tuner.executors.ray_executor import RayExecutor

    ex = RayExecutor(address=args.address)
    rows: dict[str, list] = {
        "1 node (local runner, 2 ranks)": [],
        "2 nodes (Ray placement group, 1 rank each)": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            one = run_trial(tiny_spec(Path(tmp), f"one{i}", ranks=2, steps=args.steps), cpus=[0, 1])
            rows["1 node (local runner, 2 ranks)"].append(one)
            spec = tiny_spec(Path(tmp), f"two{i}", ranks=2, nodes=2, steps=args.steps)
            while ex.free_slots(spec) < 1:
                time.sleep(0.5)
            two = ex.run(spec)
            rows["2 nodes (Ray placement group, 1 rank each)"].append(two)
            print(
                f"round {i}: one host {one.tokens_per_s}, two nodes {two.tokens_per_s} ({two.error or 'ok'})"
            )
    ex.close()
    print("\n| path | tokens/s (median) | step ms (median) | wall s per trial | nodes |")
    print("|---|---:|---:|---:|---:|")
    for name, results in rows.items():
        ok = [r for r in results if r.status == "ok"]
        if not ok:
            print(f"| {name} | failed | | | |")
            continue
        tok = statistics.median(r.tokens_per_s for r in ok)
        step = statistics.median(r.step_time_s for r in ok) * 1e3
        wall = statistics.median(r.wall_s for r in ok)
        print(f"| {name} | {tok:,.0f} | {step:.2f} | {wall:.1f} | {ok[0].nodes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
