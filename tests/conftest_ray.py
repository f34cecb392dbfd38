"""Helpers shared by the executor contract and Ray tests: a tiny real trial, a Ray runtime sized
for a 2-core CI machine, and a look at which trial processes are alive."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from tuner.config import Config
from tuner.recipe import recipe_from_dict
from tuner.result import TrialSpec

RAY_CPUS = 2  # the CI machine's cores; a 2-rank trial fills the runtime


def tiny_spec(
    workdir: Path, tag: str, *, ranks: int = 1, steps: int = 2, timeout_s: float = 120, nodes: int = 1
) -> TrialSpec:
    """A trial of the real workload small enough to take seconds: 1 layer, 32 wide, data parallel
    (over `nodes` machines when more than one)."""
    recipe = recipe_from_dict(
        {
            "name": "executor-test",
            "model": {"family": "gpt", "layers": 1, "hidden": 32, "heads": 2, "seq_len": 32, "vocab": 256},
            "train": {"global_batch_size": 2 * ranks},
            "hardware": {"device": "cpu", "devices": ranks, "nodes": nodes},
            "measure": {"warmup_steps": 1, "steps": steps},
        }
    )
    return TrialSpec(
        recipe=recipe.to_dict(),
        config=Config(dp=ranks).to_dict(),
        family="cpu",
        workdir=str(workdir / tag),
        timeout_s=timeout_s,
        tag=tag,
    )


def start_ray_runtime(num_gpus: int = 0):
    """A local Ray runtime of RAY_CPUS CPUs; `num_gpus` declares GPUs Ray hands out (none need exist)."""
    import ray

    ray.init(
        address="local",
        num_cpus=RAY_CPUS,
        num_gpus=num_gpus,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    return ray


def trial_pids(spec: TrialSpec) -> list[int]:
    """Live processes of this trial: its launcher and ranks all run in the trial's directory (and,
    started cold, name its spec file; forked from the warm helper they carry the helper's command line)."""
    workdir = os.path.abspath(spec.workdir)
    needle = os.path.join(workdir, "spec.json").encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if (needle in cmdline or cwd == workdir) and state != "Z":
            pids.append(int(entry))
    return pids


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


def collect(executor, tags: set[str], timeout_s: float = 120) -> list:
    """Every result `wait` hands back until all `tags` came in (duplicates kept, to be asserted on)."""
    results: list = []
    deadline = time.monotonic() + timeout_s
    while not tags <= {r.tag for r in results}:
        assert time.monotonic() < deadline, f"results for {tags - {r.tag for r in results}} never came"
        results += executor.wait(timeout=1.0)
    return results
