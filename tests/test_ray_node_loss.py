"""A node that dies or freezes under a study, on two Ray nodes on loopback (a fresh cluster per test,
since each test takes its worker node down): a trial queued for the lost node comes back unschedulable
instead of waiting forever, and a trial running on a frozen node is blamed on that node as soon as
Ray declares it dead, not on its healthy peer after its whole timeout."""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path

import pytest
from conftest_ray import cluster_pids, collect, loopback_cluster, signal_pids, tiny_spec, trial_pids, wait_for

from tuner.executors.ray_executor import RayExecutor

pytestmark = pytest.mark.slow

# Ray declares a node dead after this many missed health checks (~15-30 s by default); here ~5-10 s.
FAST_HEALTH_CHECKS = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5",
}


@pytest.fixture
def cluster(tmp_path_factory):
    """(executor, the worker node's processes) on a fresh two-node cluster."""
    with loopback_cluster(tmp_path_factory, FAST_HEALTH_CHECKS) as (address, temp_dirs):
        ex = RayExecutor(
            address=address,
            lease_dir=str(tmp_path_factory.mktemp("leases")),
            env={"TUNER_TEST_STEP_DELAY_S": "0.5"},  # a trial runs until the test ends it
        )
        try:
            yield ex, lambda: cluster_pids(temp_dirs[1:])
        finally:
            ex.close()


def _node_pids(spec, node_rank: int) -> list[int]:
    return trial_pids(dataclasses.replace(spec, workdir=str(Path(spec.workdir) / f"node{node_rank}")))


def test_a_trial_queued_for_a_node_that_died_comes_back_unschedulable(cluster, tmp_path):
    """Submitted in the seconds before Ray declares the killed node dead, a two-node trial's placement
    group can never be placed: it waited forever, whatever its timeout."""
    import ray

    ex, node_b = cluster
    signal_pids(node_b(), signal.SIGKILL)
    spec = tiny_spec(tmp_path, "orphan", ranks=2, nodes=2, timeout_s=600)
    assert ex.free_slots(spec) == 1  # Ray still counts the dead node
    ex.submit(spec)
    assert ex.running() == ["orphan"]
    start = time.monotonic()
    [result] = collect(ex, {"orphan"}, timeout_s=60)

    assert result.error_kind == "unschedulable", result.error
    assert "never got its devices: a node left the cluster while it was queued" in result.error
    assert "the cluster has 1 node(s)" in result.error
    assert time.monotonic() - start < 60 and ex.running() == []
    states = [g["state"] for g in ray.util.placement_group_table().values()]
    assert "PENDING" not in states and "CREATED" not in states, states


def test_a_frozen_node_is_blamed_as_soon_as_ray_declares_it_dead(cluster, tmp_path):
    """SIGSTOP on the worker node while a trial runs a rank there: the trial ran out its timeout plus
    ~20 s, then blamed the healthy node for the timeout."""
    ex, node_b = cluster
    spec = tiny_spec(tmp_path, "frozen", ranks=2, nodes=2, steps=400, timeout_s=300)
    ex.submit(spec)
    early: list = []

    def started() -> bool:
        early.extend(ex.wait(timeout=0.2))
        where = ex.placement("frozen")
        return len(where) == 2 and all(where) and bool(_node_pids(spec, 1)) and bool(trial_pids(spec))

    wait_for(started, 90, "ranks on both nodes")
    assert not early
    head_node = ray_node_id_of_head()
    [(frozen_rank, frozen_node)] = [
        (rank, w["ray_node_id"])
        for rank, w in enumerate(ex.placement("frozen"))
        if w["ray_node_id"] != head_node
    ]
    frozen = node_b()
    signal_pids(frozen, signal.SIGSTOP)
    start = time.monotonic()
    try:
        [result] = collect(ex, {"frozen"}, timeout_s=80)
    finally:
        signal_pids(frozen, signal.SIGKILL)

    assert time.monotonic() - start < 80  # Ray's health checks, not the trial's 300 s timeout
    assert result.status == "error" and result.error_kind == "worker_died", result.error
    assert result.error.startswith(f"node {frozen_rank} of 2: node died: Ray lost node "), result.error
    assert f"({frozen_node[:12]}) while the trial ran there" in result.error
    assert result.node and result.node == result.extra["placement"][frozen_rank]["ray_node_ip"]
    wait_for(lambda: not ex.running(), 5, "the trial to be forgotten")


def ray_node_id_of_head() -> str:
    import ray

    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("nodeA"))


def test_a_node_lost_before_its_share_of_a_trial_started_is_blamed_as_soon_as_ray_declares_it(
    cluster, tmp_path, monkeypatch
):
    """Node 0's part runs (its ranks wait at the rendezvous) when the node holding node 1's bundle
    dies, before node 1's task started there: that task waited forever for its rescheduled bundle,
    node 0's ranks ran out the trial's timeout, and the trial blamed node 0 for a timeout."""
    from ray.util.placement_group import placement_group as make

    from tuner.executors import ray_executor

    def pinned(resource: str, per_node: int, nnodes: int):  # node 0 on the head, node 1 on the worker
        return make(
            [{resource: float(per_node), n: 0.01} for n in ("nodeA", "nodeB")], strategy="STRICT_SPREAD"
        )

    monkeypatch.setattr(ray_executor, "placement_group", pinned)
    ex, node_b = cluster
    spec = tiny_spec(tmp_path, "half", ranks=2, nodes=2, timeout_s=60)
    ex.submit(spec)
    # The driver starts node 1's task once it reads node 0's start, in `wait`: not before the kill.
    wait_for(lambda: trial_pids(spec), 90, "node 0's ranks")
    signal_pids(node_b(), signal.SIGKILL)
    start = time.monotonic()
    [result] = collect(ex, {"half"}, timeout_s=90)

    assert result.error_kind == "worker_died", result.error
    assert result.error.startswith("node 1 of 2: node died: Ray lost node that held node 1's devices")
    assert time.monotonic() - start < 40  # Ray's health checks (~10 s here), not the trial's 60 s
    wait_for(lambda: not trial_pids(spec) and not ex.running(), 15, "node 0's ranks to be gone")
