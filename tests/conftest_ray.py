"""Helpers shared by the executor contract and Ray tests: a tiny real trial, a Ray runtime sized
for a 2-core CI machine, a cluster of two Ray nodes on loopback, and a look at which trial
processes are alive."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tuner.config import Config
from tuner.executors.nodes import free_port
from tuner.recipe import recipe_from_dict
from tuner.result import TrialSpec

RAY_CPUS = 2  # the CI machine's cores; a 2-rank trial fills the runtime
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


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


def _node_ports() -> list[str]:
    # Two nodes on one host must not share the agents' default ports.
    return [
        f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
    ]


def cluster_pids(temp_dirs: list[str], port: int | None = None) -> set[int]:
    """Every process of a loopback cluster's nodes: those naming their temp dirs (or, with `port`,
    the head's GCS port), and their children. Not `ray stop`: that kills every Ray process of this
    user on the host, other runtimes included. One node's alone: its temp dir and no port."""
    marks = [re.escape(d.encode()) for d in temp_dirs] + ([rb"[\d.]+:%d\b" % port] if port else [])
    mark = re.compile(rb"|".join(marks))
    procs: dict[int, tuple[int, bytes]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if fields[0] != "Z":
            procs[int(entry)] = (int(fields[1]), cmdline)
    found = {pid for pid, (_, cmd) in procs.items() if mark.search(cmd)}
    while True:
        children = {pid for pid, (ppid, _) in procs.items() if ppid in found} - found
        if not children:
            return found
        found |= children


def signal_pids(pids, sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _stop_cluster(temp_dirs: list[str], port: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGTERM, signal.SIGKILL):  # SIGCONT: a node a test froze
        signal_pids(cluster_pids(temp_dirs, port), sig)
        deadline = time.monotonic() + 2
        while sig != signal.SIGCONT and cluster_pids(temp_dirs, port) and time.monotonic() < deadline:
            time.sleep(0.1)


@contextlib.contextmanager
def loopback_cluster(
    tmp_path_factory,
    env: dict[str, str] | None = None,
    ips: tuple[str, str] = ("127.0.0.1", "127.0.0.1"),
    worker_prefix: tuple[str, ...] = (),
):
    """Two Ray nodes on loopback, 1 CPU each, a head (resource "nodeA") and a worker ("nodeB"):
    yields (the head's address, [head's temp dir, worker's temp dir]); `env` adds Ray settings.
    `ips`: the head's and the worker's node address; `worker_prefix`: what the worker's `ray start`
    runs under (`ip netns exec NS`, `two_host_cluster`)."""
    import ray
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    if ray.is_initialized():
        ray.shutdown()
    # Token auth, Ray's default, for the nodes and for this driver, which share ~/.ray/auth_token.
    # Ray reads the mode once per process, so switch it here the way a local ray.init does.
    _enable_token_auth()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)

    port = free_port()
    temp_dirs = [str(tmp_path_factory.mktemp("ray-head")), str(tmp_path_factory.mktemp("ray-node"))]
    common = ["--num-cpus=1", "--disable-usage-stats"]
    head = [RAY, "start", "--head", f"--port={port}", "--include-dashboard=false"]
    head += [f"--ray-client-server-port={free_port()}", f"--temp-dir={temp_dirs[0]}"]
    worker = [*worker_prefix, RAY, "start", f"--address={ips[0]}:{port}", f"--temp-dir={temp_dirs[1]}"]
    try:
        # The head first, then the worker node: started together on a loaded machine, the worker
        # gave up before the head's GCS listed the head node. One retry for the worker.
        for cmd, resource, attempts, ip in ((head, "nodeA", 1, ips[0]), (worker, "nodeB", 2, ips[1])):
            cmd += [f"--node-ip-address={ip}", *common, *_node_ports(), f'--resources={{"{resource}": 1}}']
            for _attempt in range(attempts):
                start = subprocess.run(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=180
                )
                if start.returncode == 0:
                    break
            assert start.returncode == 0, f"{' '.join(cmd[:3])} failed:\n{start.stdout.decode()[-3000:]}"
        yield f"{ips[0]}:{port}", temp_dirs
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _stop_cluster(temp_dirs, port)


def can_make_network_namespaces() -> bool:
    """Whether this process may make a network namespace (root, iproute2, a kernel that allows it)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    probe = f"tuner-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


@contextlib.contextmanager
def two_host_cluster(tmp_path_factory, env: dict[str, str] | None = None):
    """Two Ray nodes that are two hosts to the network, what a loopback cluster cannot show: the
    head on this machine's network stack, the worker in a network namespace of its own, joined to
    it by a veth pair (10.213.N.1 and .2). They share files and processes; an address that means
    "this host" (127.0.0.1, which this host's name may resolve to) reaches only the node's own
    stack. Needs `can_make_network_namespaces()`. Yields `loopback_cluster`'s (address, temp dirs)."""
    n = os.getpid() % 250 + 1
    ns, host_if, ns_if = f"tuner-{n}", f"tuner{n}a", f"tuner{n}b"
    ips = (f"10.213.{n}.1", f"10.213.{n}.2")
    setup = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", ns],
        ["ip", "addr", "add", f"{ips[0]}/24", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "-n", ns, "addr", "add", f"{ips[1]}/24", "dev", ns_if],
        ["ip", "-n", ns, "link", "set", ns_if, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
    ]
    teardown = [["ip", "link", "del", host_if], ["ip", "netns", "del", ns]]  # the veth's peer goes too
    for cmd in teardown:  # what a killed run of this pid's number left
        subprocess.run(cmd, capture_output=True)
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True, capture_output=True)
        with loopback_cluster(tmp_path_factory, env, ips, ("ip", "netns", "exec", ns)) as cluster:
            yield cluster
    finally:
        for cmd in teardown:
            subprocess.run(cmd, capture_output=True)
