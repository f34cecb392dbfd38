"""Runs trials on this machine: `run_trial` runs one trial's ranks in a process session of their own
(through `tuner.executors.launcher`) and classifies how it ended; `LocalExecutor` keeps several in
flight without sharing a device. `run_trial` is also what the Ray executor calls on a remote node.

The caller owns the deadline and kills the whole session. Skipping torchrun's elastic agent saves
one torch import per trial; the ranks see torchrun's environment all the same. By default the
launcher is forked from this process's warm helper (`tuner.executors.warm`: torch already
imported); without one (TUNER_WARM_START=0, or a helper that cannot start) it starts cold.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tuner.executors import warm
from tuner.executors.base import Executor
from tuner.executors.launcher import FAIL_GRACE_S  # noqa: F401 - the grace a failing trial gets, for callers
from tuner.executors.nodes import NodePart
from tuner.executors.outcome import LOG_TAIL_LINES, classify, read_json, tail
from tuner.executors.session import TERM_GRACE_S, kill_session, session_pids  # noqa: F401
from tuner.record.status import ERROR
from tuner.result import TrialResult, TrialSpec

PORT_RETRIES = 1
# What each rank runs (`python -m <module> SPEC.json`); tests swap in a stand-in rank.
RANK_MODULE = "tuner.workload"


def run_trial(
    spec: TrialSpec,
    *,
    env: dict[str, str] | None = None,
    cpus: list[int] | None = None,
    stop: threading.Event | None = None,
    module: str | None = None,
    node: NodePart | None = None,
    helper_socket: str | None = None,
) -> TrialResult:
    """Run one trial to completion and classify it; never raises because the trial failed.

    `env` adds environment variables for the ranks; `cpus` pins every rank to those cores;
    setting `stop` ends the trial early (status error, error_kind "cancelled"); `module` is what
    each rank runs instead of RANK_MODULE (the build runs `tuner.workload.build_rank`). With
    `node`, only that node's ranks of a multi-node trial run here; a node other than 0 reports no
    metrics (rank 0 measures), only whether its ranks ended well. `helper_socket`: the warm helper
    another process of this node keeps (a Ray node's `WarmHost`) instead of this process's own.
    """
    # The launcher runs in the trial's directory and the ranks read paths from the spec: a relative
    # workdir would mean another place to each of them.
    spec = dataclasses.replace(spec, workdir=str(Path(spec.workdir).absolute()))
    workdir = Path(spec.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec.to_dict(), indent=1))
    cmd = [sys.executable, "-m", "tuner.executors.launcher", str(spec_path), str(_world_size(spec))]
    cmd.append(module or RANK_MODULE)
    if cpus:
        cmd += ["--cpus", ",".join(str(c) for c in cpus)]
    if node is not None:
        cmd += ["--node", node.to_arg()]
    child_env = trial_env(env)

    start = time.monotonic()
    measures = node is None or node.node_rank == 0
    # A multi-node trial's port is chosen by node 0's Ray task, known to every node: no retry here.
    retries = PORT_RETRIES if node is None else 0
    # A build's rank (`module`) times its compiler from a fresh interpreter: always cold.
    helper: warm.WarmHelper | warm.NodeHelper | None = None
    if module is None and warm.enabled(child_env):
        helper = warm.helper_for(child_env, helper_socket)
    for attempt in range(1 + retries):
        result = _run_once(spec, cmd, child_env, stop, helper, measures)
        # The rendezvous port is free when the launcher picks it but only bound seconds later,
        # once rank 0 has imported torch; another process may take it in between.
        clash = "address already in use" in f"{result.error} {result.log_tail}".lower()
        if not (result.status == ERROR and clash) or attempt == retries:
            break
    if attempt:
        result.extra["port_retries"] = attempt
    return _finish(spec, result, start)


def trial_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a trial's processes: this one's, `env` on top, and this `tuner` importable."""
    from tuner.settings import cache_dir

    child_env = {**os.environ, **(env or {})}
    # The ranks run in the trial's directory: a relative TUNER_CACHE_DIR would be a new one there.
    cache = cache_dir(child_env)
    if cache is not None:
        child_env["TUNER_CACHE_DIR"] = str(cache)
    # The ranks must import this same `tuner`, wherever the caller found it.
    package_root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, child_env.get("PYTHONPATH")) if p)
    return child_env


def prestart_helper(env: dict[str, str] | None = None) -> None:
    """Start this process's warm helper now (it imports torch in the background), so that the
    first trial finds it ready."""
    child_env = trial_env(env)
    if warm.enabled(child_env):
        warm.shared_helper(child_env)


def _run_once(
    spec: TrialSpec,
    cmd: list[str],
    env: dict[str, str],
    stop: threading.Event | None,
    helper: warm.WarmHelper | warm.NodeHelper | None,
    measures: bool = True,
) -> TrialResult:
    """One launch of the trial, timed out `spec.timeout_s` after its launcher started: waiting for
    the helper to be ready (torch imported, Inductor prepared) is not the trial's time."""
    workdir = Path(spec.workdir)
    for stale in [workdir / "result.json", workdir / "exits.json", *workdir.glob("rank*.error.json")]:
        stale.unlink(missing_ok=True)
    log_path = workdir / "trial.log"
    started_at = time.time()
    launcher, how = None, "cold"
    (workdir / "launcher.log").write_bytes(b"")
    # The log of this launch only: the retry test and the failure's message read its tail, and an
    # earlier attempt's "address already in use" (or a reused --workdir's old error) is not this one's.
    log_path.write_bytes(b"")
    if helper is not None:
        try:
            # cmd is [python, -m, tuner.executors.launcher, ARGS...]: the helper runs the same.
            # Inductor is prepared in the helper for CPU trials only: its savings are the CPU
            # compiler's, and on a CUDA build of torch it leaves the helper unable to fork ranks
            # that use CUDA (`warm_server.device_runtime`).
            compiles = spec.family == "cpu" and spec.config.get("compile", "none") != "none"
            launcher = helper.launch(cmd[3:], env, str(workdir), str(workdir / "launcher.log"), compiles)
            how = "warm"
        except warm.Unavailable as err:
            how = f"cold ({err})"
    if launcher is None:
        try:
            launcher = _start_cold(cmd, env, workdir)
        except OSError as err:
            return TrialResult(
                status=ERROR, error_kind="launch", error=f"cannot start the trial launcher: {err}"
            )
    ended = _supervise(launcher, time.monotonic() + spec.timeout_s, stop)
    result = classify(spec, workdir, launcher.returncode, ended, expect_result=measures)
    result.extra["session"] = launcher.pid  # the trial's session id (its launcher leads it)
    result.extra["start"] = how
    timeline = _timeline(workdir, started_at)
    if timeline:
        result.extra["timeline"] = timeline
    result.log_path = str(log_path)
    result.log_tail = tail(log_path, LOG_TAIL_LINES)
    return result


def _start_cold(cmd: list[str], env: dict[str, str], workdir: Path) -> subprocess.Popen:
    with open(workdir / "launcher.log", "wb") as launcher_log:
        return subprocess.Popen(
            cmd,
            cwd=workdir,
            env={**env, "TUNER_LAUNCHER_PARENT": str(os.getpid())},  # see launcher._launch
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=launcher_log,
            start_new_session=True,
        )


def _timeline(workdir: Path, started_at: float) -> dict[str, float]:
    """Seconds from launch to rank 0's first output line (it prints once its training is built:
    imports, process group and model) and to the last rank's exit, and the CPU seconds all ranks
    had used at those points. Where per-trial overhead goes."""
    exits = read_json(workdir / "exits.json") or {}
    out = {}
    first = exits.get("first_output", {}).get("0")
    if first:
        out["rank0_ready_s"] = round(first - started_at, 3)
    if exits.get("exits"):
        out["last_exit_s"] = round(max(e["t"] for e in exits["exits"]) - started_at, 3)
    for key in ("cpu_at_rank0_ready_s", "cpu_total_s"):
        if exits.get(key) is not None:
            out[key] = round(exits[key], 3)
    return out


def _world_size(spec: TrialSpec) -> int:
    c = spec.config
    return int(c.get("dp", 1)) * int(c.get("tp", 1)) * int(c.get("pp", 1))


def multi_node_refusal(nodes: int) -> str | None:
    """Why a recipe of `nodes` machines cannot run on this machine's runner; None when it can."""
    if nodes <= 1:
        return None
    return (
        f"hardware.nodes is {nodes}: a trial over several machines needs the Ray executor "
        "(--executor ray, or TUNER_EXECUTOR=ray for the service); set hardware.nodes to 1 to run here"
    )


def _multi_node(spec: TrialSpec) -> str | None:
    return multi_node_refusal(int(spec.recipe.get("hardware", {}).get("nodes", 1) or 1))


def _finish(spec: TrialSpec, result: TrialResult, start: float) -> TrialResult:
    result.wall_s = time.monotonic() - start
    result.node = socket.gethostname()
    if not result.rank_nodes:  # one host ran every rank (a multi-node trial's driver overwrites it)
        result.rank_nodes = [result.node] * _world_size(spec)
        result.nodes = 1
    result.tag = spec.tag
    if result.estimated_peak_mem_bytes is None:
        result.estimated_peak_mem_bytes = spec.estimated_peak_mem_bytes
    return result


def _supervise(
    launcher: subprocess.Popen | warm.WarmProcess, deadline: float, stop: threading.Event | None
) -> str:
    """Wait for the launcher; on deadline or `stop`, kill its whole session. Returns how it ended."""
    while True:
        try:
            launcher.wait(timeout=0.1)
            ended = "exited"
            break
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() >= deadline:
            ended = "timeout"
            break
        if stop is not None and stop.is_set():
            ended = "cancelled"
            break
    kill_session(launcher.pid, launcher)
    return ended


class LocalExecutor(Executor):
    """Trials on this machine, each `run_trial` in a background thread so `submit` returns at once.

    By default one trial at a time per device family: a measurement needs its devices to itself.
    With `concurrent=True` trials share the family's devices without overlapping: each gets its own
    cores (cpu, pinned through `cpus`) or accelerators (`CUDA_VISIBLE_DEVICES` /
    `ASCEND_RT_VISIBLE_DEVICES`), which is faster for a search but lets trials disturb each
    other's memory bandwidth. `cpus` limits the cores this executor uses at all.
    """

    name = "local"
    _VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}

    def __init__(
        self, *, env: dict[str, str] | None = None, cpus: list[int] | None = None, concurrent: bool = False
    ):
        self._env = env
        self._cpus = cpus
        self._concurrent = concurrent
        self._lock = threading.Lock()
        self._running: dict[str, tuple[TrialSpec, threading.Thread, threading.Event]] = {}
        self._held: dict[str, tuple[str, list[int]]] = {}  # tag -> (family, device or core ids)
        self._finished: queue.Queue[TrialResult] = queue.Queue()
        prestart_helper(env)

    def _devices(self, family: str) -> list[int]:
        if family == "cpu":
            return sorted(self._cpus or os.sched_getaffinity(0))
        from tuner.devices import describe

        return list(range(describe(family).count))

    def _free(self, family: str) -> list[int]:
        """Device ids of `family` no running trial holds (call with the lock held)."""
        held = {i for fam, ids in self._held.values() if fam == family for i in ids}
        return [i for i in self._devices(family) if i not in held]

    def free_slots(self, spec: TrialSpec) -> int:
        if _multi_node(spec):
            return 1  # submit answers at once with an "unschedulable" result
        world = _world_size(spec)
        with self._lock:
            if self._concurrent:
                return len(self._free(spec.family)) // world
            busy = any(s.family == spec.family for s, _, _ in self._running.values())
        return 0 if busy or len(self._devices(spec.family)) < world else 1

    def submit(self, spec: TrialSpec) -> None:
        if self.free_slots(spec) < 1:
            raise RuntimeError(f"no free {spec.family} slot for trial {spec.tag!r}; ask free_slots() first")
        refusal = _multi_node(spec)
        if refusal:
            self._finished.put(
                TrialResult(status=ERROR, error_kind="unschedulable", error=refusal, tag=spec.tag)
            )
            return
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(spec, stop), name=f"trial-{spec.tag}", daemon=True)
        with self._lock:
            self._running[spec.tag] = (spec, thread, stop)
            if self._concurrent:
                self._held[spec.tag] = (spec.family, self._free(spec.family)[: _world_size(spec)])
        thread.start()

    def _run(self, spec: TrialSpec, stop: threading.Event) -> None:
        env, cpus = dict(self._env or {}), self._cpus
        with self._lock:
            _, ids = self._held.get(spec.tag, (None, None))
        if ids is not None and spec.family == "cpu":
            cpus = ids
        elif ids is not None:
            env[self._VISIBLE[spec.family]] = ",".join(map(str, ids))
        try:
            result = run_trial(spec, env=env, cpus=cpus, stop=stop)
        except Exception as err:  # noqa: BLE001 - a bug here must still come back as a result
            result = TrialResult(status=ERROR, error_kind=type(err).__name__, error=str(err), tag=spec.tag)
        with self._lock:  # with `running()` in one step, so `wait` never sees neither
            self._held.pop(spec.tag, None)
            if self._running.pop(spec.tag, None) is not None:
                self._finished.put(result)

    def wait(self, timeout: float | None = None) -> list[TrialResult]:
        out: list[TrialResult] = []
        with self._lock:
            if timeout is None and not self._running and self._finished.empty():
                return out  # nothing could ever arrive
        try:
            out.append(self._finished.get(timeout=timeout))
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                return out

    def running(self) -> list[str]:
        with self._lock:
            return list(self._running)

    def cancel(self) -> None:
        with self._lock:
            trials = list(self._running.values())
            self._running.clear()
        for _, _, stop in trials:
            stop.set()
        for _, thread, _ in trials:
            thread.join()
        while not self._finished.empty():
            self._finished.get_nowait()
