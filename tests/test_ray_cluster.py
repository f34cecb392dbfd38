"""Two Ray nodes on loopback (a head and a worker, 1 CPU each): trials spread over both nodes; a
trial of two nodes runs one rank on each, through one placement group; a node's death ends its whole
trial and leaves no process; a single-node trial bigger than every node is turned away at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest_ray import collect, loopback_cluster, tiny_spec, trial_pids, wait_for

from tuner.artifacts import ArtifactStore
from tuner.executors.ray_executor import RayExecutor
from tuner.record import keys

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    import ray

    with loopback_cluster(tmp_path_factory) as (address, _):
        ex = RayExecutor(address=address, lease_dir=str(tmp_path_factory.mktemp("leases")))
        ex.address = address
        try:
            yield ex
        finally:
            ex.close()
            if ray.is_initialized():
                ray.shutdown()


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


def test_a_single_node_trial_larger_than_every_node_is_unschedulable(two_nodes, tmp_path):
    spec = tiny_spec(tmp_path, "two-ranks", ranks=2)  # the cluster has 2 CPUs, but 1 per node

    two_nodes.submit(spec)
    [result] = collect(two_nodes, {"two-ranks"}, timeout_s=10)

    assert result.error_kind == "unschedulable"
    assert "needs 2 CPU on one node" in result.error and "largest node has 1 CPU" in result.error
    assert "2 node(s), 2 CPU in all" in result.error and "hardware.nodes" in result.error


def test_a_trial_needing_more_nodes_than_the_cluster_has_names_the_cluster(two_nodes, tmp_path):
    spec = tiny_spec(tmp_path, "three-nodes", ranks=3, nodes=3)

    two_nodes.submit(spec)
    [result] = collect(two_nodes, {"three-nodes"}, timeout_s=10)

    assert result.error_kind == "unschedulable"
    assert "needs 3 nodes with 1 CPU each" in result.error and "the cluster has 2 node(s)" in result.error


def test_a_two_node_trial_runs_a_rank_on_each_node_and_matches_one_node(two_nodes, tmp_path):
    from tuner.executors.local import run_trial

    spec = tiny_spec(tmp_path, "spread", ranks=2, nodes=2, steps=3)
    assert two_nodes.free_slots(spec) == 1
    two_nodes.submit(spec)
    assert two_nodes.free_slots(spec) == 0  # the whole placement group is ours
    [result] = collect(two_nodes, {"spread"})
    single = run_trial(tiny_spec(tmp_path, "one-host", ranks=2, steps=3))

    assert result.status == "ok", result.error
    assert result.nodes == 2 and len(set(result.rank_nodes)) == 2
    assert [p["node_rank"] for p in result.extra["placement"]] == [0, 1]
    assert single.status == "ok" and single.nodes == 1
    assert result.losses == pytest.approx(single.losses, abs=1e-5)
    assert not trial_pids(spec) and not _node_pids(spec, 1)


def _node_pids(spec, node_rank: int) -> list[int]:
    import dataclasses

    return trial_pids(dataclasses.replace(spec, workdir=str(Path(spec.workdir) / f"node{node_rank}")))


def test_killing_one_nodes_worker_ends_the_whole_trial_and_the_study_goes_on(two_nodes, tmp_path):
    slow = RayExecutor(env={"TUNER_TEST_STEP_DELAY_S": "0.5"}, lease_dir=two_nodes._lease_dir)
    spec = tiny_spec(tmp_path, "doomed", ranks=2, nodes=2, steps=200, timeout_s=300)
    slow.submit(spec)
    early: list = []  # the driver learns where parts run (and starts node 1) only while it waits

    def started() -> bool:
        early.extend(slow.wait(timeout=0.2))
        where = slow.placement("doomed")
        return len(where) == 2 and all(where) and bool(_node_pids(spec, 1)) and bool(trial_pids(spec))

    wait_for(started, 90, "ranks on both nodes")
    assert not early
    os.kill(slow.placement("doomed")[1]["worker_pid"], signal.SIGKILL)
    start = time.monotonic()
    [result] = collect(slow, {"doomed"}, timeout_s=60)

    assert result.status == "error" and result.error_kind == "worker_died", result.error
    assert result.error.startswith("node 1 of 2:")
    assert time.monotonic() - start < 30
    left = (trial_pids(spec), _node_pids(spec, 1), [r.extra.get("placement") for r in [result]], result.error)
    wait_for(
        lambda: not trial_pids(spec) and not _node_pids(spec, 1), 15, f"no rank left on either node {left}"
    )
    [after] = collect(_submitted(two_nodes, tiny_spec(tmp_path, "next", ranks=2, nodes=2)), {"next"})
    assert after.status == "ok" and after.nodes == 2


def _submitted(executor, spec):
    wait_for(lambda: executor.free_slots(spec) >= 1, 30, "the cluster to be free again")
    executor.submit(spec)
    return executor


def test_tuner_tune_on_the_cluster_runs_every_trial_over_both_nodes_then_show_and_build_find_it(
    two_nodes, tmp_path
):
    """`tuner tune --executor ray` runs each trial over both nodes; `tuner show` and `tuner build`
    with `--executor ray` find the study by the nodes' own fingerprint, and the build runs on a node."""
    import optuna

    recipe = tmp_path / "two-nodes.yaml"
    recipe.write_text(
        "name: two-nodes\n"
        "model: {layers: 1, hidden: 32, heads: 2, seq_len: 32, vocab: 256}\n"
        "train: {global_batch_size: 4}\n"
        "hardware: {device: cpu, devices: 2, nodes: 2}\n"
        "measure: {warmup_steps: 1, steps: 2}\n"
        "search: {overrides: {compile: [none], micro_batch_size: [1, 2]}}\n"
    )
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    env = {
        **os.environ,
        "RAY_ADDRESS": two_nodes_address(two_nodes),
        "TUNER_RUNS_DIR": str(tmp_path / "runs"),
    }
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "tuner"), "tune", str(recipe), "--trials", "3",
         "--executor", "ray", "--storage", db],
        env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [name] = optuna.get_all_study_names(db)
    done = [t for t in optuna.load_study(study_name=name, storage=db).trials if t.state.name == "COMPLETE"]
    assert done, out.stdout[-2000:]
    for t in done:
        assert t.user_attrs["nodes"] == 2 and len(set(t.user_attrs["rank_nodes"])) == 2
    # The study is keyed by the nodes' devices (one core each), not this machine's: `tuner show`
    # finds it where it asks the nodes, and this machine's own study of the recipe does not exist.
    show = [
        os.path.join(os.path.dirname(sys.executable), "tuner"),
        "show",
        str(recipe),
        "--storage",
        db,
        "--json",
    ]
    ray_show = subprocess.run(
        [*show, "--executor", "ray"], env=env, capture_output=True, text=True, timeout=300
    )
    assert ray_show.returncode == 0, ray_show.stderr[-2000:]
    assert json.loads(ray_show.stdout)["study_name"] == name
    here = subprocess.run(show, env=env, capture_output=True, text=True, timeout=300)
    assert here.returncode == 2 and "no study" in here.stderr

    # Its winner builds on a node (the driver may lack the device) and the archive comes back to
    # this machine's store, described by the nodes' fingerprint.
    build = [os.path.join(os.path.dirname(sys.executable), "tuner"), "build", str(recipe), "--storage", db]
    built = subprocess.run(
        [*build, "--executor", "ray", "--out", str(tmp_path / "builds"), "--json"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    record = json.loads(built.stdout)
    assert Path(record["path"]).is_file() and Path(record["path"]).is_relative_to(tmp_path / "builds")
    assert any(line.startswith("built on ") for line in record["summary"]) and record["build_id"]
    manifest = ArtifactStore(tmp_path / "builds").verify(record["path"], record["sha256"])
    study = optuna.load_study(study_name=name, storage=db)
    assert manifest["fingerprint"] == study.user_attrs[keys.FINGERPRINT] and manifest["device"]["count"] == 1


def test_the_nodes_describe_their_own_devices_not_the_drivers_machine(two_nodes):
    """A study on Ray takes its devices from the nodes that run its trials: each node counts what Ray
    lets trials use there (`--num-cpus=1` here, on a host with more cores) and measures its own
    priors, and a device no node has is refused naming the field. (The driver could be a head node
    without GPUs: it never describes its own.)"""
    from tuner.devices import describe

    described = two_nodes.describe("auto")
    assert described.family == "cpu" and described.device.where == "each Ray node"
    assert described.device.count == 1 and described.fingerprint["device_count"] == 1
    assert describe("cpu").count == len(os.sched_getaffinity(0)) >= 2  # the host: more than a node
    priors = two_nodes.device_priors(described.device)
    assert priors is not None and priors.cores == 1 and priors.peak("fp32", 1) > 0
    with pytest.raises(
        ValueError, match="hardware.device: cuda requested but not available on any node of the Ray"
    ):
        two_nodes.describe("cuda")


def test_tuner_tune_refuses_a_recipe_the_nodes_cannot_hold_before_any_trial(two_nodes, tmp_path):
    """Two devices per node on nodes of one core each: refused up front with the field, the share and
    what each node has. Checked against the driver's machine, it passed (this host has two cores)
    and every trial then came back unschedulable."""
    recipe = tmp_path / "too-big.yaml"
    recipe.write_text(
        "name: too-big\n"
        "model: {layers: 1, hidden: 32, heads: 2, seq_len: 32, vocab: 256}\n"
        "train: {global_batch_size: 8}\n"
        "hardware: {device: cpu, devices: 4, nodes: 2}\n"
    )
    db = tmp_path / "tune.db"
    env = {
        **os.environ,
        "RAY_ADDRESS": two_nodes_address(two_nodes),
        "TUNER_RUNS_DIR": str(tmp_path / "runs"),
    }
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "tuner"), "tune", str(recipe), "--executor", "ray",
         "--storage", f"sqlite:///{db}"],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    said = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2, said[-3000:]
    assert "hardware.devices is 4 over 2 nodes, 2 per node, but each Ray node has 1 cpu devices" in said
    assert "Traceback" not in said and not (tmp_path / "runs").exists()


def test_tuner_plan_plans_for_the_nodes_devices(two_nodes, tmp_path):
    """`tuner plan --executor ray` from a machine that is not a node: the plan counts what a node
    holds (one core here, two on this host), so two devices on one node is beyond it and the plan
    says it extrapolates; planned for this machine, it is not."""
    recipe = tmp_path / "plan.yaml"
    recipe.write_text(
        "name: plan\n"
        "model: {layers: 1, hidden: 32, heads: 2, seq_len: 32, vocab: 256}\n"
        "train: {global_batch_size: 4}\n"
        "hardware: {device: cpu, devices: 2}\n"
    )
    env = {**os.environ, "RAY_ADDRESS": two_nodes_address(two_nodes)}
    tuner = os.path.join(os.path.dirname(sys.executable), "tuner")
    plans = {}
    for executor in ("ray", "local"):
        out = subprocess.run(
            [tuner, "plan", str(recipe), "--executor", executor, "--json", "--storage", f"sqlite:///{tmp_path}/p.db"],
            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        plans[executor] = json.loads(out.stdout)
    assert (plans["ray"]["machine_devices"], plans["ray"]["extrapolated"]) == (1, True)
    assert (plans["local"]["machine_devices"], plans["local"]["extrapolated"]) == (
        len(os.sched_getaffinity(0)),
        False,
    )
    assert plans["ray"]["rows"] and plans["ray"]["rows"][0]["tokens_per_s"] > 0


def test_tuner_measure_runs_one_config_over_both_nodes(two_nodes, tmp_path):
    """`tuner measure --executor ray` measures a recipe over `hardware.nodes` = 2 (which the local
    executor refuses, naming the fix): one rank on each node, measured like a study's trial."""
    recipe = tmp_path / "two-nodes.yaml"
    recipe.write_text(
        "name: measure-two-nodes\n"
        "model: {layers: 1, hidden: 32, heads: 2, seq_len: 32, vocab: 256}\n"
        "train: {global_batch_size: 4}\n"
        "hardware: {device: cpu, devices: 2, nodes: 2}\n"
        "measure: {warmup_steps: 1, steps: 2}\n"
    )
    env = {
        **os.environ,
        "RAY_ADDRESS": two_nodes_address(two_nodes),
        "TUNER_RUNS_DIR": str(tmp_path / "runs"),
    }
    measure = [os.path.join(os.path.dirname(sys.executable), "tuner"), "measure", str(recipe), "--json"]
    local = subprocess.run(measure, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert local.returncode == 2 and "--executor ray" in local.stderr, local.stderr[-2000:]
    out = subprocess.run(
        [*measure, "--executor", "ray"], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["status"] == "ok" and result["tokens_per_s"] > 0
    assert result["extra"]["nodes"] == 2 and len(set(result["extra"]["rank_nodes"])) == 2


def two_nodes_address(executor) -> str:
    return executor.address
