"""The local trial runner: how a trial ended (ok, oom, error, timeout) and that nothing survives it.

Two layers: a stand-in rank (a few lines of Python, no torch) checks the launcher's supervision and
classification quickly; the real workload (tiny GPT, 2 gloo ranks) checks it end to end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest_ray import parent_pid, trial_pids, wait_for

from tuner.executors import local
from tuner.executors.local import LocalExecutor, run_trial, session_pids
from tuner.result import TrialSpec

pytestmark = pytest.mark.slow

TINY_RECIPE = {
    "name": "exec-test",
    "model": {"family": "gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256},
    "train": {"global_batch_size": 8},
    "hardware": {"device": "cpu", "devices": 2},
    "measure": {"warmup_steps": 1, "steps": 2},
}

# Behaves like tuner.workload from the outside: rank 0 writes result.json, a failing rank writes
# its error json and exits 1, and healthy ranks wait forever for the failed peer (like a collective).
STANDIN = textwrap.dedent(
    """
    import json, os, sys, time, signal
    spec = json.load(open(sys.argv[1]))
    wd, rank = spec["workdir"], int(os.environ["RANK"])
    fault = os.environ.get("TUNER_TEST_FAULT", "")
    print("rank", rank, "of", os.environ["WORLD_SIZE"], "port", os.environ["MASTER_PORT"])
    if fault == "port":  # the first attempt finds its rendezvous port taken
        fault = ""
        if rank == 0 and not os.path.exists(f"{wd}/clashed"):
            open(f"{wd}/clashed", "w").close()
            print("RuntimeError: The server socket has failed to listen: address already in use")
            sys.exit(1)
    if fault and rank == int(os.environ.get("TUNER_TEST_FAULT_RANK", "0")):
        if fault == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "hang":
            time.sleep(3600)
        if fault == "exit3":
            print("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"); sys.exit(3)
        status = "oom" if fault.startswith("alloc") else "error"
        json.dump({"status": status, "error_kind": "RuntimeError", "error": "boom from rank %d" % rank,
                   "traceback": "Traceback ..."}, open(f"{wd}/rank{rank}.error.json", "w"))
        sys.exit(1)
    if fault:
        time.sleep(3600)
    if rank == 0:
        json.dump({"status": "ok", "step_time_s": 0.01, "peak_mem_reserved_bytes": 1000,
                   "measured_s": 0.02}, open(f"{wd}/result.json", "w"))
    """
)


@pytest.fixture
def standin(tmp_path, monkeypatch):
    (tmp_path / "standin_rank.py").write_text(STANDIN)
    monkeypatch.setattr(local, "RANK_MODULE", "standin_rank")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def make_spec(tmp_path: Path, tag: str = "t", timeout_s: float = 60, **config) -> TrialSpec:
    return TrialSpec(
        recipe=TINY_RECIPE,
        config={"dp": 2, **config},
        family="cpu",
        workdir=str(tmp_path / f"trial-{tag}"),
        timeout_s=timeout_s,
        tag=tag,
    )


def trial_session(workdir: str | Path) -> int:
    """The trial's session id, as its launcher recorded it."""
    return json.loads((Path(workdir) / "exits.json").read_text())["session"]


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_standin_ok_fills_result(standin, start):
    res = run_trial(make_spec(standin, "ok"), env={"TUNER_WARM_START": "1" if start == "warm" else "0"})
    assert res.status == "ok", res.error
    assert res.extra["start"] == start
    assert res.tag == "ok" and res.node and res.wall_s > 0
    assert "[rank1] rank 1 of 2" in res.log_tail
    assert Path(res.log_path).name == "trial.log"
    assert json.loads((Path(res.log_path).parent / "spec.json").read_text())["tag"] == "ok"


def test_standin_budget_exceeded_is_oom(standin):
    spec = make_spec(standin, "budget")
    spec.memory_budget_bytes = 500  # the stand-in reports a 1000-byte peak
    res = run_trial(spec)
    assert res.status == "oom" and res.error_kind == "budget"
    assert "exceeds the memory budget" in res.error


@pytest.mark.parametrize(
    ("fault", "status", "text"),
    [
        ("raise", "error", "rank 1: boom from rank 1"),
        ("alloc:64", "oom", "rank 1: boom from rank 1"),
        ("segfault", "error", "rank 1 was killed by SIGSEGV"),
        ("exit3", "oom", "CUDA out of memory"),
    ],
)
def test_standin_failure_kills_waiting_peer(standin, fault, status, text):
    t0 = time.monotonic()
    res = run_trial(
        make_spec(standin, fault.replace(":", "")),
        env={"TUNER_TEST_FAULT": fault, "TUNER_TEST_FAULT_RANK": "1"},
    )
    assert res.status == status
    assert text in res.error
    # rank 0 waits forever; the group is killed after the failure grace, not at the 60 s timeout.
    assert time.monotonic() - t0 < local.FAIL_GRACE_S + local.TERM_GRACE_S + 5


def test_waiting_for_the_helper_to_be_ready_is_not_the_trials_timeout(standin, monkeypatch):
    """The first trial waits for its helper (torch imported, Inductor prepared: 34 s once on a
    loaded 2-core host); a trial's timeout counts from its own launch, not from that wait."""
    from tuner.executors import warm

    ready = warm.WarmHelper.wait_ready

    def slow(self, timeout=warm.READY_TIMEOUT_S):
        time.sleep(4)
        ready(self, timeout)

    monkeypatch.setattr(warm.WarmHelper, "wait_ready", slow)
    res = run_trial(make_spec(standin, "patient", timeout_s=3.5), env={"TUNER_WARM_START": "1"})
    assert (res.status, res.extra["start"]) == ("ok", "warm"), res.error


def test_killing_the_warm_helper_between_trials_costs_no_trial(standin):
    from tuner.executors import warm

    first = run_trial(make_spec(standin, "before"))
    helper = warm.shared_helper(local.trial_env())
    assert first.status == "ok" and first.extra["start"] == "warm"
    os.kill(helper.pid, 9)
    helper.proc.wait()
    second = run_trial(make_spec(standin, "after"))
    assert second.status == "ok", second.error
    assert second.extra["start"] == "warm"  # a new helper, not a cold start
    assert warm.shared_helper(local.trial_env()).pid != helper.pid


def test_warm_ranks_are_fresh_processes_of_the_trials_own_session(standin):
    from tuner.executors import warm

    script = standin / "standin_rank.py"
    script.write_text("import os\nprint('ids', os.getpid(), os.getsid(0))\n" + STANDIN)
    results = [run_trial(make_spec(standin, f"fresh-{i}")) for i in range(2)]
    helper = warm.shared_helper(local.trial_env())
    ids = [
        tuple(map(int, line.split("ids ")[1].split()))
        for r in results
        for line in r.log_tail.splitlines()
        if "ids " in line
    ]
    assert len(ids) == 4 and len({pid for pid, _ in ids}) == 4  # no rank process is reused
    for r in results:
        assert {sid for pid, sid in ids if f"ids {pid} " in r.log_tail} == {r.extra["session"]}
        assert r.extra["session"] != os.getsid(helper.pid) and session_pids(r.extra["session"]) == []


# A process that runs one trial through a helper another process keeps, as a Ray worker does.
CLIENT = """
import json, sys
from tuner.executors import local
from tuner.result import TrialSpec
local.RANK_MODULE = "standin_rank"
local.run_trial(TrialSpec.from_dict(json.loads(sys.argv[1])), helper_socket=sys.argv[2])
"""


def test_a_node_helper_ends_the_trial_of_a_client_that_died_and_serves_the_next(standin, monkeypatch):
    """A node's helper (a Ray node's `WarmHost` keeps one) forks the trials of other processes.
    When one of them dies mid-trial (a killed Ray worker), nobody supervises that trial any more:
    the helper ends its session rather than let it hold the cores, and goes on serving."""
    from tuner.executors import warm

    helper = warm.WarmHelper(local.trial_env(), socket_path=str(standin / "node" / "helper.sock"))
    try:
        helper.wait_ready()
        spec = make_spec(standin, "orphan", timeout_s=600)
        monkeypatch.setenv("TUNER_TEST_FAULT", "hang")  # every rank sleeps: only a kill ends it
        client = subprocess.Popen(
            [sys.executable, "-c", CLIENT, json.dumps(spec.to_dict()), helper.socket_path]
        )
        pids = wait_for(
            lambda: len(trial_pids(spec)) == 3 and trial_pids(spec), 60, "the launcher and 2 ranks"
        )
        assert helper.pid in {
            parent_pid(pid) for pid in pids
        }  # the launcher is the helper's, not the client's
        os.kill(client.pid, signal.SIGKILL)
        client.wait()
        wait_for(lambda: not trial_pids(spec), 15, "the orphaned trial's processes to end")
        assert helper.alive()

        monkeypatch.delenv("TUNER_TEST_FAULT")
        after = run_trial(make_spec(standin, "after"), helper_socket=helper.socket_path)
        assert after.status == "ok", after.error
        assert after.extra["start"] == "warm"
    finally:
        helper.close()
    assert not (standin / "node" / "helper.sock").exists()


def test_a_client_gone_before_the_ranks_start_leaves_no_trial_running(standin, monkeypatch):
    """A client that dies right after the helper forked its launcher (before the launcher started
    its ranks, or called setsid): its session held nothing yet, so ending it ended nothing, and the
    launcher went on to run the trial with nobody watching its timeout."""
    from tuner.executors import local as executor_local
    from tuner.executors import warm

    helper = warm.WarmHelper(local.trial_env(), socket_path=str(standin / "node" / "helper.sock"))
    try:
        helper.wait_ready()
        spec = make_spec(standin, "gone-early", timeout_s=600)
        monkeypatch.setenv("TUNER_TEST_FAULT", "hang")
        Path(spec.workdir).mkdir(parents=True, exist_ok=True)
        (Path(spec.workdir) / "spec.json").write_text(json.dumps(spec.to_dict()))
        env = executor_local.trial_env()
        argv = [str(Path(spec.workdir) / "spec.json"), "2", "standin_rank"]
        launched = helper.launch(argv, env, spec.workdir, str(Path(spec.workdir) / "launcher.log"))
        launched._conn.close()  # the client is gone at once
        time.sleep(5)  # long enough for a surviving launcher to have started its ranks
        assert not trial_pids(spec), "the trial runs on with nobody supervising it"
        assert helper.alive()
    finally:
        helper.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_driver_killed_leaves_no_helper_and_no_socket_folder(sig):
    """A Ray worker or a driver killed with SIGTERM or SIGKILL never runs its `atexit` cleanup: the
    helper notices its parent gone, ends, and removes the folder it was made for."""
    driver = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom tuner.executors import local, warm\nlocal.prestart_helper()\n"
         "print(warm._shared._dir, warm._shared.pid, flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env=local.trial_env(),
    )  # fmt: skip
    folder, helper_pid = driver.stdout.readline().split()
    assert Path(folder).is_dir()
    driver.send_signal(sig)
    driver.wait(timeout=30)
    wait_for(lambda: not Path(folder).exists(), 30, "the helper's folder to go")
    wait_for(
        lambda: (
            not Path(f"/proc/{helper_pid}").exists()
            or "Z" in Path(f"/proc/{helper_pid}/stat").read_text().split(")")[1][:3]
        ),
        30,
        "the helper to end",
    )


def test_a_node_helper_that_never_answers_costs_one_cold_trial_then_the_process_uses_its_own(
    standin, monkeypatch
):
    from tuner.executors import warm

    monkeypatch.setattr(warm, "READY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(warm, "_unreachable", set())
    gone = str(standin / "no-host" / "helper.sock")  # its host died and took its helper with it
    first = run_trial(make_spec(standin, "first"), helper_socket=gone)
    second = run_trial(make_spec(standin, "second"), helper_socket=gone)
    assert first.status == second.status == "ok"
    assert first.extra["start"].startswith("cold (the warm-start helper did not answer")
    assert second.extra["start"] == "warm"  # this process's own helper, with no second wait


def test_the_helper_prepares_inductor_for_the_first_trial_that_compiles(standin):
    """From the first trial with `compile` on, ranks forked from the helper find Inductor's CPU
    probe done (test programs loaded in child interpreters, about 1.2 s per rank); trials before it
    did not wait for it, and a cold rank still has it to do."""
    from tuner.executors import warm

    warm.shared_helper(local.trial_env()).close()  # a helper of this test's own, prepared for nothing
    script = standin / "standin_rank.py"
    probe = "import threading\nfrom torch._inductor import codecache, cpu_vec_isa\n"
    probe += "from torch._dynamo.backends.registry import _lazy_import\n"
    probe += "print('probed', cpu_vec_isa.valid_vec_isa_list.cache_info().currsize, 'headers', "
    probe += (
        "codecache._precompile_header.cache_info().currsize, 'backends', _lazy_import.cache_info().currsize, "
    )
    probe += "'threads', threading.active_count())\n"
    script.write_text(probe + STANDIN)
    runs = {
        "plain": run_trial(make_spec(standin, "plain")),
        "compiled": run_trial(make_spec(standin, "compiled", compile="default")),
        "after": run_trial(make_spec(standin, "after")),
        "cold": run_trial(make_spec(standin, "cold", compile="default"), env={"TUNER_WARM_START": "0"}),
    }
    assert [r.extra["start"] for r in runs.values()] == ["warm", "warm", "warm", "cold"]
    # Forking stays safe: the probe leaves the helper with one thread, which each rank inherits.
    # And the precompiled header's check (g++ on its includes, about 0.2 s a process) is done: a
    # rank that loads a cached C++ kernel does not repeat it. So are the imports and registrations
    # of a process's first compiled frame (Dynamo's backends: 0.1-0.3 s of its first step).
    expect = {"plain": 0, "compiled": 1, "after": 1, "cold": 0}
    for name, r in runs.items():
        n = expect[name]
        line = f"probed {n} headers {n} backends {n} threads 1"
        assert r.log_tail.count(line) == 2, (name, r.log_tail)


def test_a_helper_that_touched_the_gpu_runtime_forks_nothing_and_its_trials_start_cold(standin, monkeypatch):
    """On an H200 machine a helper's preparation counted the GPUs, and every rank forked after it
    died with "Cannot re-initialize CUDA in forked subprocess". A helper that finds a device
    runtime touched (here it is told so) answers each request with the reason, and the trial runs
    cold instead of failing."""
    from tuner.executors import warm

    monkeypatch.setattr(warm, "_unreachable", set())
    path = str(standin / "touched" / "helper.sock")
    os.makedirs(os.path.dirname(path))
    serve = "import sys\nfrom tuner.executors.warm_server import serve\n"
    serve += "serve(sys.argv[1], (), initialised=lambda: 'CUDA')\n"
    helper = subprocess.Popen([sys.executable, "-c", serve, path], stdin=subprocess.PIPE)
    try:
        res = run_trial(make_spec(standin, "touched"), helper_socket=path)
    finally:
        helper.stdin.close()  # the helper exits when its parent's pipe closes
        helper.wait(timeout=10)
    assert res.status == "ok", res.error
    assert res.extra["start"].startswith("cold (the warm-start helper has initialised CUDA"), res.extra


def test_a_forked_child_tells_whether_the_helper_may_fork_cuda_ranks(monkeypatch):
    """`device_runtime` asks a throwaway child (CPU builds of torch have no such state: None)."""
    import torch

    from tuner.executors.warm_server import device_runtime

    assert device_runtime() is None
    monkeypatch.setattr(torch._C, "_cuda_isInBadFork", lambda: True, raising=False)
    assert device_runtime() == "CUDA"
    monkeypatch.setattr(torch._C, "_cuda_isInBadFork", lambda: False, raising=False)
    assert device_runtime() is None


def test_the_helper_imports_the_callers_tuner_from_any_working_directory(standin, monkeypatch):
    """Run from a directory that holds another `tuner` package (a second checkout), trials still
    start warm: the helper imports the caller's tuner, not the working directory's."""
    from tuner.executors import warm

    other = standin / "checkout"
    (other / "tuner").mkdir(parents=True)
    (other / "tuner" / "__init__.py").write_text("raise ImportError('the working directory tuner')\n")
    monkeypatch.chdir(other)
    warm.shared_helper(local.trial_env()).close()  # the next trial starts a helper from here
    r = run_trial(make_spec(standin, "elsewhere"))
    assert r.status == "ok"
    assert r.extra["start"] == "warm", r.extra["start"]


def test_port_clash_is_retried_once(standin):
    res = run_trial(make_spec(standin, "port"), env={"TUNER_TEST_FAULT": "port"})
    assert res.status == "ok", res.error
    assert res.extra["port_retries"] == 1


def test_standin_timeout_leaves_no_process(standin):
    res = run_trial(make_spec(standin, "hang", timeout_s=2), env={"TUNER_TEST_FAULT": "hang"})
    assert res.status == "timeout" and "timeout of 2s" in res.error
    sid = res.extra["session"]
    assert sid == trial_session(standin / "trial-hang")
    assert session_pids(sid) == []


def test_what_still_works_in_a_cancelled_trials_directory_is_ended(tmp_path):
    # The executors' last word on a cancelled trial: a process of the session its launcher recorded
    # that ignores SIGTERM is waited for, then killed, wherever it works; others are left alone,
    # above all a user's shell and its `tail -f` sitting in the trial's directory (a shell in a
    # terminal leads a session of its own: the SIGKILL went to it when processes were told apart
    # by their working directory and their session's leader).
    from tuner.executors.session import end_processes_in, pids_in

    (tmp_path / "node1").mkdir()
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    # A launcher's stand-in: records its session in a node part's directory, as the launcher does
    # before its first rank, and leaves a stubborn child working elsewhere.
    launcher = (
        "import pathlib, subprocess, sys, time\n"
        "from tuner.executors.session import record_session\n"
        f"record_session(pathlib.Path({str(tmp_path / 'node1')!r}))\n"
        f"child = subprocess.Popen([sys.executable, '-c', {stubborn!r}], cwd='/')\n"
        "print(child.pid, flush=True)\n"
        f"{stubborn}\n"
    )
    trial = subprocess.Popen(
        [sys.executable, "-c", launcher],
        cwd=tmp_path / "node1",
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    shell = subprocess.Popen(["bash", "-c", "tail -f /dev/null & wait"], cwd=tmp_path, start_new_session=True)
    outside = subprocess.Popen([sys.executable, "-c", stubborn], cwd=Path(tmp_path).parent)
    try:
        child = int(trial.stdout.readline())
        ours = sorted([trial.pid, child])
        wait_for(lambda: sorted(pids_in(str(tmp_path))) == ours, 30, "the trial's two processes")
        assert sorted(end_processes_in(str(tmp_path), 0.3)) == ours
        assert trial.wait(timeout=5) == -signal.SIGKILL
        assert pids_in(str(tmp_path)) == [] and shell.poll() is None and outside.poll() is None
    finally:
        for p in (trial, shell):  # their sessions: the stand-in's child, the shell's tail
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(p.pid, signal.SIGKILL)
        outside.kill()
        for p in (trial, shell, outside):
            p.wait()


def test_a_trials_launcher_records_the_session_it_leads(standin):
    """What `pids_in` goes by: each launch of a trial, warm or cold, records the session its
    launcher led, and that session is the one the result reports."""
    from tuner.executors.session import SESSION_FILE, host_identity

    for start in ("warm", "cold"):
        res = run_trial(make_spec(standin, start), env={"TUNER_WARM_START": "1" if start == "warm" else "0"})
        assert res.status == "ok" and res.extra["start"] == start, res.error
        recorded = (standin / f"trial-{start}" / SESSION_FILE).read_text().split()
        assert recorded == [str(trial_session(standin / f"trial-{start}")), host_identity()]


def test_cpus_pin_every_rank(standin):
    cpu = sorted(os.sched_getaffinity(0))[-1]
    script = standin / "standin_rank.py"
    script.write_text("import os, sys, json\nprint('affinity', sorted(os.sched_getaffinity(0)))\n" + STANDIN)
    res = run_trial(make_spec(standin, "pin"), cpus=[cpu])
    assert res.status == "ok", res.error
    assert res.log_tail.count(f"affinity [{cpu}]") == 2


def test_executor_contract_with_standin(standin):
    ex = LocalExecutor()
    spec = make_spec(standin, "a")
    assert ex.free_slots(spec) == 1
    ex.submit(spec)
    assert ex.running() == ["a"]
    assert ex.free_slots(make_spec(standin, "b")) == 0
    with pytest.raises(RuntimeError, match="free_slots"):
        ex.submit(make_spec(standin, "b"))
    results = []
    deadline = time.monotonic() + 30
    while not results and time.monotonic() < deadline:
        results = ex.wait(timeout=1)
    assert [r.tag for r in results] == ["a"] and results[0].status == "ok"
    assert ex.wait(timeout=0.2) == []  # exactly once
    assert ex.running() == []


def test_concurrent_executor_gives_each_trial_its_own_cores(standin):
    script = standin / "standin_rank.py"
    script.write_text("import os\nprint('affinity', sorted(os.sched_getaffinity(0)))\n" + STANDIN)
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    ex = LocalExecutor(concurrent=True, cpus=cores)
    specs = [make_spec(standin, f"one-rank-{i}", dp=1) for i in range(2)]
    assert ex.free_slots(specs[0]) == 2
    ex.submit(specs[0])
    assert ex.free_slots(specs[1]) == 1
    ex.submit(specs[1])
    assert ex.free_slots(make_spec(standin, "third", dp=1)) == 0
    results = []
    deadline = time.monotonic() + 30
    while len(results) < 2 and time.monotonic() < deadline:
        results += ex.wait(timeout=1)
    assert sorted(r.status for r in results) == ["ok", "ok"]
    pinned = sorted(r.log_tail.split("affinity ")[1].splitlines()[0] for r in results)
    assert pinned == [f"[{cores[0]}]", f"[{cores[1]}]"]
    assert ex.free_slots(specs[0]) == 2


def test_executor_cancel_kills_trial(standin):
    ex = LocalExecutor(env={"TUNER_TEST_FAULT": "hang"})
    spec = make_spec(standin, "c", timeout_s=60)
    ex.submit(spec)
    deadline = time.monotonic() + 10
    while "rank 1 of 2" not in local.tail(Path(spec.workdir) / "trial.log", 5):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    t0 = time.monotonic()
    ex.cancel()
    assert time.monotonic() - t0 < local.TERM_GRACE_S + 3
    assert ex.running() == [] and ex.wait(timeout=0.2) == []
    assert session_pids(trial_session(spec.workdir)) == []


# ---- the real workload: tiny GPT, 2 gloo ranks ------------------------------------------------------

REAL_FAULTS = {
    "ok": ({}, None),
    "raise": ({"TUNER_TEST_FAULT": "raise", "TUNER_TEST_FAULT_RANK": "1"}, None),
    "alloc": ({"TUNER_TEST_FAULT": "alloc:768"}, 512 * 2**20),
    "segfault": ({"TUNER_TEST_FAULT": "segfault"}, None),
    "hang": ({"TUNER_TEST_FAULT": "hang"}, None),
}
# Long enough to reach the hang (rank 1 then blocks in a gloo collective) on 2 idle cores; on a
# badly overloaded machine the deadline may strike earlier, which must leave nothing behind too.
HANG_TIMEOUT_S = 25


@pytest.fixture(scope="module")
def real_trials(tmp_path_factory):
    """All five trials at once (they are mostly waiting), each through run_trial in this process."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("real")

    def one(name: str):
        env, budget = REAL_FAULTS[name]
        spec = make_spec(root, name, timeout_s=HANG_TIMEOUT_S if name == "hang" else 120)
        spec.memory_budget_bytes = budget
        return run_trial(spec, env=env)

    with ThreadPoolExecutor(len(REAL_FAULTS)) as pool:
        return dict(zip(REAL_FAULTS, pool.map(one, REAL_FAULTS), strict=True))


@pytest.mark.parametrize("name", list(REAL_FAULTS))
def test_real_trials_start_warm(real_trials, name):
    assert real_trials[name].extra["start"] == "warm"


def test_real_ok_trial_reports_the_design_keys(real_trials):
    res = real_trials["ok"]
    assert res.status == "ok", res.error
    assert res.step_time_s > 0 and res.tokens_per_s > 0 and res.peak_mem_reserved_bytes > 0
    # The losses of training steps warmup_steps .. warmup_steps + steps - 1: the same in every trial.
    assert len(res.losses) == 2 and all(v == v for v in res.losses)
    assert len(res.step_times) >= 2
    assert res.step_time_ci is None or res.step_time_ci >= 0
    assert res.wall_s > res.measured_s > 0
    assert "[rank0] ok: step" in res.log_tail


def test_real_raise_is_an_error_with_the_exception_text(real_trials):
    res = real_trials["raise"]
    assert res.status == "error"
    assert res.error.startswith("rank 1: TUNER_TEST_FAULT=raise: injected failure")
    assert res.error_kind == "RuntimeError"


def test_real_alloc_over_budget_is_oom(real_trials):
    res = real_trials["alloc"]
    assert res.status == "oom", res.error
    assert res.error_kind == "budget" and "memory budget" in res.error


def test_real_segfault_names_the_signal(real_trials):
    res = real_trials["segfault"]
    assert res.status == "error"
    assert "rank 0 was killed by SIGSEGV" in res.error
    assert "Fatal Python error: Segmentation fault" in Path(res.log_path).read_text()


def test_real_hang_times_out_and_leaves_no_process(real_trials):
    res = real_trials["hang"]
    assert res.status == "timeout" and f"timeout of {HANG_TIMEOUT_S}s" in res.error
    assert session_pids(res.extra["session"]) == []
    assert HANG_TIMEOUT_S <= res.wall_s < HANG_TIMEOUT_S + local.TERM_GRACE_S + 5


def test_a_rank_that_only_lost_its_peer_is_not_named_the_cause(tmp_path):
    """Seen in CI: rank 1 raised, and rank 0, whose gloo connection rank 1 closed, exited first
    (both within 1 ms). The trial's error is rank 1's, whatever the exit order."""
    from tuner.executors.outcome import classify

    lost = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:40000"
    records = {0: ("DistBackendError", lost), 1: ("RuntimeError", "TUNER_TEST_FAULT=raise: injected failure")}
    for first in (0, 1):
        work = tmp_path / f"first{first}"
        work.mkdir()
        exits = [{"rank": r, "returncode": 1, "t": float(i)} for i, r in enumerate((first, 1 - first))]
        (work / "exits.json").write_text(json.dumps({"exits": exits}))
        for rank, (kind, text) in records.items():
            record = {"status": "error", "error_kind": kind, "error": text}
            (work / f"rank{rank}.error.json").write_text(json.dumps(record))
        spec = TrialSpec(recipe={}, config={}, family="cpu", workdir=str(work))
        res = classify(spec, work, 1, "exited")
        assert res.error.startswith("rank 1: TUNER_TEST_FAULT=raise"), (first, res.error)
        assert res.error_kind == "RuntimeError"


def test_a_rank_that_failed_before_the_deadline_is_the_cause_of_a_timeout(tmp_path):
    """Rank 0 ran out of memory 8.5 s into a 10 s timeout; rank 1 hung in a collective until the
    deadline killed it. The trial is an oom (the floor learns from it), not a timeout; a record of
    only a lost peer leaves it a timeout."""
    from tuner.executors.outcome import classify

    spec = TrialSpec(recipe={}, config={}, family="cpu", workdir=str(tmp_path), timeout_s=10)
    oom = {
        "status": "oom",
        "error_kind": "OutOfMemoryError",
        "error": "DefaultCPUAllocator: can't allocate memory",
    }
    (tmp_path / "rank0.error.json").write_text(json.dumps(oom))
    res = classify(spec, tmp_path, None, "timeout")
    assert (res.status, res.error) == ("oom", "rank 0: DefaultCPUAllocator: can't allocate memory")
    lost = {"status": "error", "error_kind": "DistBackendError", "error": "Connection closed by peer"}
    (tmp_path / "rank0.error.json").write_text(json.dumps(lost))
    assert classify(spec, tmp_path, None, "timeout").status == "timeout"


def test_a_launcher_flooded_with_sigterm_still_ends_its_ranks_and_records_them(tmp_path):
    """The launcher's SIGTERM handler takes no lock: one handler interrupting another (SIGTERMs from
    its dead caller and from a cancel at once) once left a launcher blocked for good on the lock a
    `threading.Event` takes, its rank a zombie. That race is too narrow to hit on demand (this
    storm did not hit it with the Event either); the test holds what a user sees: however many
    SIGTERMs land, the launcher ends its rank, records it and exits."""
    # The rank says it started: the launcher installs its handler before it starts any rank.
    (tmp_path / "sleeper.py").write_text(
        "import pathlib, time\npathlib.Path('started').touch()\ntime.sleep(60)\n"
    )
    (tmp_path / "spec.json").write_text("{}")
    cmd = [sys.executable, "-m", "tuner.executors.launcher", str(tmp_path / "spec.json"), "1", "sleeper"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    for _ in range(3):
        (tmp_path / "exits.json").unlink(missing_ok=True)
        (tmp_path / "started").unlink(missing_ok=True)
        launcher = subprocess.Popen(cmd, env=env, cwd=tmp_path)
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(2000):
            with contextlib.suppress(ProcessLookupError):
                os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
        exits = json.loads((tmp_path / "exits.json").read_text())["exits"]
        assert [e["rank"] for e in exits] == [0] and exits[0]["returncode"] == -signal.SIGTERM
