"""Two Ray nodes on loopback (a head and a worker, 1 CPU each): trials spread over both nodes, and a
trial that fits the cluster but no single node is turned away instead of waiting forever."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest_ray import collect, tiny_spec

from tuner.executors.ray_executor import RayExecutor

pytestmark = pytest.mark.slow

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_ports() -> list[str]:
    # Two nodes on one host must not share the agents' default ports.
    return [
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
    ]


def _cluster_pids(temp_dirs: list[str], port: int) -> set[int]:
    """Every process of this test's cluster: those naming its temp dirs or GCS port, and their children.

    Not `ray stop`: that kills every Ray process of this user on the host, other runtimes included.
    """
    mark = re.compile(rb"|".join([re.escape(d.encode()) for d in temp_dirs] + [rb"[\d.]+:%d\b" % port]))
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


def _stop_cluster(temp_dirs: list[str], port: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _cluster_pids(temp_dirs, port):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 2
        while _cluster_pids(temp_dirs, port) and time.monotonic() < deadline:
            time.sleep(0.1)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    import ray
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    if ray.is_initialized():
        ray.shutdown()
    # Token auth, Ray's default, for the nodes and for this driver, which share ~/.ray/auth_token.
    # Ray reads the mode once per process, so switch it here the way a local ray.init does.
    _enable_token_auth()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)

    port = _free_port()
    temp_dirs = [str(tmp_path_factory.mktemp("ray-head")), str(tmp_path_factory.mktemp("ray-node"))]
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats"]
    head = [RAY, "start", "--head", f"--port={port}", "--include-dashboard=false"]
    head += [f"--ray-client-server-port={_free_port()}", f"--temp-dir={temp_dirs[0]}"]
    worker = [RAY, "start", f"--address=127.0.0.1:{port}", f"--temp-dir={temp_dirs[1]}"]
    try:
        # Both at once: the worker node retries until the head's GCS answers.
        starts = []
        for cmd, resource in ((head, "nodeA"), (worker, "nodeB")):
            cmd += [*common, *_node_ports(), f'--resources={{"{resource}": 1}}']
            starts.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for start in starts:
            out, _ = start.communicate(timeout=120)
            assert start.returncode == 0, f"{' '.join(start.args[:3])} failed:\n{out.decode()[-3000:]}"
        ex = RayExecutor(address=f"127.0.0.1:{port}", lease_dir=str(tmp_path_factory.mktemp("leases")))
        yield ex
        ex.close()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _stop_cluster(temp_dirs, port)


def test_trials_run_on_both_nodes_on_distinct_cores(two_nodes, tmp_path):
    ex = two_nodes
    specs = [tiny_spec(tmp_path, "on-one"), tiny_spec(tmp_path, "on-other")]

    assert ex.free_slots(specs[0]) == 2  # one 1-rank trial per node
    for spec in specs:
        ex.submit(spec)
    assert ex.free_slots(specs[0]) == 0
    results = collect(ex, {"on-one", "on-other"})

    assert [r.status for r in results] == ["ok", "ok"], [r.error for r in results]
    assert len({r.extra["ray_node_id"] for r in results}) == 2
    # Both nodes live on this one host: the per-host core lease keeps their ranks apart.
    assert sorted(r.extra["cores"][0] for r in results) == [0, 1]


def test_trial_larger_than_every_node_is_unschedulable(two_nodes, tmp_path):
    spec = tiny_spec(tmp_path, "two-ranks", ranks=2)  # the cluster has 2 CPUs, but 1 per node

    two_nodes.submit(spec)
    [result] = collect(two_nodes, {"two-ranks"}, timeout_s=10)

    assert result.error_kind == "unschedulable"
    assert "needs 2 CPU on one node" in result.error and "largest node has 1 CPU" in result.error
