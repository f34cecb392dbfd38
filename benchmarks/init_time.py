"""Initialising a 1B-parameter llama on one CPU rank: the sharded path every rank runs now
(build on the meta device, `to_empty` on the device, draw each tensor there from its name-keyed
generator) against the host-side full init ranks ran before (build with real storage, which
runs torch's default init, then draw every tensor on the host and copy it in).

    python benchmarks/init_time.py                 # both paths, 1.02B parameters
    python benchmarks/init_time.py --paths sharded # only the new one

Each path runs in its own fresh process (so neither inherits the other's allocations), with
the rank's thread count; the table gives wall seconds, CPU seconds of all its threads (what
the work costs when other processes contend for the cores) and the process's peak RSS growth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODEL = {"family": "llama", "layers": 16, "hidden": 2048, "heads": 16, "kv_heads": 8, "seq_len": 2048,
         "vocab": 64000}  # fmt: skip


def _run(path: str, threads: int) -> dict:
    """In this (fresh) process: time one init path."""
    import resource
    import time

    import torch

    from tuner.models import family_of
    from tuner.recipe import recipe_from_dict
    from tuner.workload.flops import param_count
    from tuner.workload.model import build_meta, materialize

    torch.set_num_threads(threads)
    m = recipe_from_dict({"name": "init", "model": MODEL}).model
    cpu = torch.device("cpu")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, cpu0 = time.perf_counter(), time.process_time()
    if path == "sharded":
        model = build_meta(m, "math")
        materialize(model, m, cpu, seed=0)
    else:
        model = _old_host_init(m, family_of(m), seed=0)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    n = sum(p.numel() for p in model.parameters())
    assert n == param_count(m)
    return {
        "path": path,
        "params": n,
        "seconds": seconds,
        "cpu_s": cpu,
        "peak_rss_gib": peak / 2**30,
        "threads": threads,
    }


def _old_host_init(m, family, seed: int):
    """What `tuner.workload.model.build_model` did before the meta device: a full model with
    real storage (default init included), then a host generator per tensor, copied in."""
    import torch

    from tuner.models.layers import _param_seed, canonical_name

    model = family.build(m, "math")
    rule = family.init_rule(m)
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind, std = rule(canonical_name(name))
            if kind != "normal":
                p.fill_(1.0 if kind == "ones" else 0.0)
                continue
            gen = torch.Generator().manual_seed(_param_seed(seed, name))
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", default=["sharded", "host"], choices=["sharded", "host"])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one path in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_run(args.one, args.threads)))
        return
    rows = []
    for path in args.paths:
        out = subprocess.run(
            [sys.executable, __file__, "--one", path, "--threads", str(args.threads)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows.append(json.loads(out.stdout.splitlines()[-1]))
    print("| init path | parameters | threads | wall s | CPU s (all threads) | peak RSS growth (GiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['path']} | {r['params'] / 1e9:.2f}B | {r['threads']} | {r['seconds']:.1f} | {r['cpu_s']:.1f} | {r['peak_rss_gib']:.1f} |"
        )


if __name__ == "__main__":
    main()
