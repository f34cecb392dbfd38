"""The Ray executor beyond the shared contract: per-host core leases, trials no node can hold, and a
worker killed in the middle of a trial."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest_ray import RAY_CPUS, collect, parent_pid, start_ray_runtime, tiny_spec, trial_pids, wait_for

from tuner.executors.nodes import free_port
from tuner.executors.ray_executor import CoreLease, RayExecutor
from tuner.recipe import recipe_from_dict

TINY_STUDY = {
    "model": {"family": "gpt", "layers": 1, "hidden": 32, "heads": 2, "seq_len": 32, "vocab": 256},
    "train": {"global_batch_size": 2},
    "hardware": {"device": "cpu", "devices": 1},
    "measure": {"warmup_steps": 1, "steps": 2},
    "search": {"space": "cpu", "overrides": {"micro_batch_size": [1, 2], "compile": ["none"]}},
}


def test_core_leases_never_share_a_core(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    leases = [CoreLease.try_take(1, str(tmp_path)) for _ in cores]

    assert sorted(c for lease in leases for c in lease.cores) == cores
    assert CoreLease.try_take(1, str(tmp_path)) is None  # every core is taken
    leases[0].release()
    again = CoreLease.try_take(1, str(tmp_path))
    assert again.cores == leases[0].cores


def test_core_lease_of_a_killed_holder_is_free_again(tmp_path):
    count = len(os.sched_getaffinity(0))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from tuner.executors.ray_executor import CoreLease; "
            f"lease = CoreLease.try_take({count}, {str(tmp_path)!r}); print(lease.cores, flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() != "None"
        assert CoreLease.try_take(1, str(tmp_path)) is None
    finally:
        holder.kill()
        holder.wait()
    assert CoreLease.try_take(count, str(tmp_path)) is not None


def test_cluster_address_nothing_answers_at_is_a_clear_error():
    import ray

    assert not ray.is_initialized()  # runs before this module's runtime starts
    port = free_port()  # closed again: nothing listens there

    with pytest.raises(ConnectionError, match=f"address=127.0.0.1:{port}: no Ray cluster answers there"):
        RayExecutor(address=f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    ray = start_ray_runtime(num_gpus=1)  # a declared GPU: Ray's bookkeeping works without the device
    ex = RayExecutor(lease_dir=str(tmp_path_factory.mktemp("leases")))
    yield ex
    ex.close()
    ray.shutdown()


@pytest.mark.slow
def test_trial_bigger_than_any_node_comes_back_unschedulable(executor, tmp_path):
    too_many = tiny_spec(tmp_path, "too-many-cores", ranks=RAY_CPUS + 1)
    two_gpus = dataclasses.replace(tiny_spec(tmp_path, "two-gpus", ranks=2), family="cuda")

    for spec in (too_many, two_gpus):
        assert executor.free_slots(spec) >= 1  # a study must not wait forever for it
        executor.submit(spec)
    results = {r.tag: r for r in collect(executor, {"too-many-cores", "two-gpus"}, timeout_s=10)}

    assert results["too-many-cores"].status == "error"
    assert results["too-many-cores"].error_kind == "unschedulable"
    assert f"needs {RAY_CPUS + 1} CPU on one node" in results["too-many-cores"].error
    assert f"largest node has {RAY_CPUS} CPU" in results["too-many-cores"].error
    assert "needs 2 GPU on one node" in results["two-gpus"].error
    assert "largest node has 1 GPU" in results["two-gpus"].error
    assert executor.running() == []


@pytest.mark.slow
def test_gpu_trial_reserves_its_gpu_and_is_told_which(executor, tmp_path):
    gpu_trial = dataclasses.replace(tiny_spec(tmp_path, "gpu"), family="cuda")

    assert executor.free_slots(gpu_trial) == 1
    executor.submit(gpu_trial)
    assert executor.free_slots(gpu_trial) == 0  # the one GPU is taken, even before the task starts
    assert executor.free_slots(tiny_spec(tmp_path, "cpu")) == RAY_CPUS  # a GPU trial holds no core
    [result] = collect(executor, {"gpu"})

    # This machine has no CUDA, so the trial fails in its ranks, but on the GPU Ray reserved for it.
    assert result.status == "error"
    assert result.extra["accelerator_ids"] == {"GPU": ["0"]}
    assert result.extra["cores"] is None  # no core lease: the GPU is what it owns
    assert result.error.startswith("rank 0")  # the failure is the trial's own, reported as a result


@pytest.mark.slow
def test_killed_worker_fails_its_trial_and_the_next_trial_runs(executor, tmp_path):
    long = tiny_spec(tmp_path, "long", steps=10_000)  # minutes: it only ends by the kill
    executor.submit(long)
    with pytest.raises(ValueError, match="already running"):
        executor.submit(long)

    wait_for(lambda: len(trial_pids(long)) == 2, 90, "the long trial's launcher and rank")
    time.sleep(0.5)  # Ray's resource view now counts the trial; we have not read its start yet
    assert executor.free_slots(tiny_spec(tmp_path, "next")) == RAY_CPUS - 1  # counted once, not twice

    def started():
        executor.wait(timeout=0.1)  # reads the task's "started on node ..." message
        return executor.where("long")

    where = wait_for(started, 30, "the long trial's start message")
    # The launcher was forked by the node's helper (its WarmHost's), not by a helper of the worker.
    pids = trial_pids(long)
    [helper] = {parent_pid(pid) for pid in pids} - set(pids)
    assert b"tuner.executors.warm" in Path(f"/proc/{helper}/cmdline").read_bytes()
    assert parent_pid(helper) != where["worker_pid"]
    os.kill(where["worker_pid"], signal.SIGKILL)
    died = collect(executor, {"long"}, timeout_s=30)

    assert [r.tag for r in died] == ["long"]
    assert died[0].status == "error"
    assert died[0].error_kind == "worker_died"
    assert "WorkerCrashedError" in died[0].error
    # The node's helper ends the trial of a client that died, so the cores are really free.
    wait_for(lambda: not trial_pids(long), 15, "the dead worker's trial processes to exit")
    assert os.path.exists(f"/proc/{helper}")  # and it outlived the worker

    t0 = time.monotonic()
    after = executor.run(tiny_spec(tmp_path, "after"))
    assert after.status == "ok", after.error
    assert after.extra["start"] == "warm"  # forked from the same node helper, in a new worker
    assert after.extra["ray_node_id"] == where["ray_node_id"]
    assert after.extra["ray_node_ip"] and after.node
    assert len(after.extra["cores"]) == 1
    assert os.path.exists(after.log_path) and "ok: step" in after.log_tail
    assert after.wall_s <= time.monotonic() - t0
    assert executor.wait(timeout=0.5) == []  # the dead trial is not reported a second time


@pytest.fixture
def gpu_held_elsewhere(executor):
    """Another job holds the runtime's one GPU (a task of its own) for the test's length."""
    import ray

    def _hold(seconds: float) -> None:  # nested: Ray ships it by value, the test module is not importable
        time.sleep(seconds)

    holder = ray.remote(num_gpus=1, num_cpus=0, max_retries=0)(_hold).remote(120)
    wait_for(lambda: ray.available_resources().get("GPU", 0) == 0, 30, "the other job to hold the GPU")
    yield
    ray.cancel(holder, force=True)
    wait_for(lambda: ray.available_resources().get("GPU", 0) == 1, 30, "the GPU to be free again")


@pytest.mark.slow
def test_a_trial_that_never_gets_its_devices_fails_after_its_timeout(
    executor, gpu_held_elsewhere, tmp_path, monkeypatch
):
    """Another job took the GPU between the driver's look (`free_slots`, made stale here) and the
    trial's start: the trial sat in Ray's queue forever, since its timeout counts from its start."""
    from tuner.executors import ray_gang

    monkeypatch.setattr(ray_gang, "QUEUE_FLOOR_S", 1.0)
    monkeypatch.setattr(executor, "free_slots", lambda spec: 1)
    executor.submit(dataclasses.replace(tiny_spec(tmp_path, "starved", timeout_s=3), family="cuda"))
    [result] = collect(executor, {"starved"}, timeout_s=30)

    assert result.error_kind == "unschedulable", result.error
    assert "never got its devices: Ray had not started it" in result.error and "timeout_s" in result.error
    assert 3 <= result.wall_s < 15 and executor.running() == []


@pytest.mark.slow
def test_a_call_on_devices_that_never_get_free_fails_and_one_no_node_has_fails_at_once(
    executor, gpu_held_elsewhere, monkeypatch
):
    """`tuner build --executor ray` waited forever for a node's devices."""
    from tuner.executors import ray_devices

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="no live Ray node can run this call: the trial needs 2 GPU"):
        executor.call_on_devices(os.path.basename, ("a/b",), "cuda", 2)
    assert time.monotonic() - start < 5
    monkeypatch.setattr(ray_devices, "CALL_QUEUE_S", 2.0)
    with pytest.raises(TimeoutError, match="no Ray node started it within 2 s: its devices"):
        executor.call_on_devices(os.path.basename, ("a/b",), "cuda", 1)
    assert time.monotonic() - start < 15


@pytest.mark.slow
def test_cancelling_a_queued_trial_kills_nothing_an_earlier_run_recorded_in_its_folder(
    executor, gpu_held_elsewhere, tmp_path, monkeypatch
):
    """`tuner measure --workdir DIR` run again: DIR keeps the earlier run's session file, whose
    number a new session of this host (a login shell, another trial's launcher) may lead by now.
    Cancelling the new run while Ray still queued it waited 10 s, then SIGKILLed that session."""
    from tuner.executors.session import SESSION_FILE, host_identity

    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        spec = dataclasses.replace(tiny_spec(tmp_path, "again"), family="cuda")
        Path(spec.workdir).mkdir(parents=True)
        (Path(spec.workdir) / SESSION_FILE).write_text(f"{bystander.pid} {host_identity()}\n")
        monkeypatch.setattr(executor, "free_slots", lambda spec: 1)  # the GPU is another job's
        executor.submit(spec)
        assert executor.wait(timeout=1.0) == [] and executor.running() == ["again"]  # queued
        executor.cancel()

        assert bystander.poll() is None and executor.running() == []
    finally:
        bystander.kill()
        bystander.wait()


def test_a_cancel_from_another_thread_while_the_driver_waits_stops_the_trial(executor, tmp_path):
    """The service's heartbeat cancels from its own thread while the study's thread sits in
    `wait`: cancel cleared the running trials that `wait` was iterating and reading."""
    import threading

    long = tiny_spec(tmp_path, "long", steps=10_000)
    executor.submit(long)
    wait_for(lambda: len(trial_pids(long)) == 2, 90, "the long trial's launcher and rank")
    errors: list[BaseException] = []

    def waits() -> None:
        try:
            while executor.running():
                executor.wait(timeout=0.2)
        except BaseException as err:  # noqa: BLE001 - what the test reports
            errors.append(err)

    driver = threading.Thread(target=waits)
    driver.start()
    time.sleep(1.0)
    executor.cancel()
    driver.join(30)
    assert not driver.is_alive() and errors == [] and executor.running() == []
    wait_for(lambda: not trial_pids(long), 15, "the cancelled trial's processes to exit")


def node_helpers() -> dict[int, bytes]:
    """The node helpers alive on this host (pid: command line): they listen in the node directory.
    Matched with its separator: a local helper's own directory (`mkdtemp(prefix="tuner-warm-")`)
    begins with the node directory's name in 1 of 37 draws (`tuner-warm-0abc...` for uid 0), and
    a local helper alive in the test process then counted as a second node helper."""
    from tuner.executors.warm import node_socket_path

    where = os.path.dirname(node_socket_path("x")).encode() + b"/"
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"tuner.executors.warm" in cmdline and where in cmdline:
            found[int(entry)] = cmdline
    return found


@pytest.mark.slow
def test_a_node_helper_that_died_is_started_again_and_no_trial_runs_cold(executor, tmp_path):
    first = executor.run(tiny_spec(tmp_path, "first"))
    assert first.status == "ok" and first.extra["start"] == "warm"
    [(pid, cmdline)] = node_helpers().items()  # one node, one helper for this executor
    os.kill(pid, signal.SIGKILL)

    second = executor.run(tiny_spec(tmp_path, "second"))  # its task waits for the helper's restart

    assert second.status == "ok", second.error
    assert second.extra["start"] == "warm"
    [(new_pid, new_cmdline)] = node_helpers().items()
    assert new_pid != pid and new_cmdline == cmdline  # started again at the same path


@pytest.mark.slow
def test_a_tiny_study_completes_through_ray(executor, tmp_path):
    from tuner.study import run_study

    recipe = recipe_from_dict({**TINY_STUDY, "name": "ray-study"})
    summary = run_study(
        recipe,
        storage_url=f"sqlite:///{tmp_path / 'study.db'}",
        executor=executor,
        trials=2,
        remeasure_top=0,
        workdir=tmp_path,
    )

    assert summary.n_trials == 2
    assert summary.counts.get("ok") == 2, summary.counts
    assert summary.best.tokens_per_s > 0
    assert executor.running() == []


def test_nodes_of_different_kinds_are_refused_and_alike_ones_count_the_largest():
    """The logic over the nodes' answers (the answers themselves come from real nodes in
    `test_ray_cluster.py`): a study is keyed by one kind of machine, so nodes whose fingerprints
    differ apart from the device count are refused naming both kinds; alike nodes of different
    sizes stand for the largest, and messages say so."""
    from tuner.devices import describe
    from tuner.executors.ray_devices import _one_kind
    from tuner.fingerprint import fingerprint

    def node(name: str, count: int, priors: str):
        info = dataclasses.replace(describe("cpu"), name=name, count=count)
        return info, fingerprint("cpu", info), priors

    described, priors = _one_kind("cpu", [node("EPYC", 4, "small"), node("EPYC", 8, "large")])
    assert (described.device.count, described.fingerprint["device_count"], priors) == (8, 8, "large")
    assert described.device.where == "the Ray cluster's largest cpu node"
    assert _one_kind("cpu", [node("EPYC", 4, "a"), node("EPYC", 4, "b")])[0].device.where == "each Ray node"
    with pytest.raises(
        ValueError, match=r"hardware.device: the Ray cluster's cpu nodes are not alike"
    ) as err:
        _one_kind("cpu", [node("EPYC", 4, "a"), node("Xeon", 4, "b"), node("EPYC", 8, "c")])
    assert "2 x EPYC" in str(err.value) and "1 x Xeon" in str(err.value)
