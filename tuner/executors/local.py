"""Runs trials on this machine: each trial's ranks in a process session of their own, then classifies
how the trial ended. `run_trial` is also what the Ray executor calls on a remote node.

Layout of one trial: the caller starts a small launcher (`python -m tuner.executors.local`, no torch
import) in a NEW session; the launcher starts every rank of `python -m tuner.workload SPEC.json` with
torchrun's environment variables, writes their output with rank prefixes to `trial.log`, kills the
group when a rank fails, and records each rank's exit in `exits.json`. Skipping torchrun's elastic
agent saves one torch import per trial. The caller owns the deadline and kills the whole session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tuner.executors.base import Executor
from tuner.result import TrialResult, TrialSpec

# After the first rank fails, the others get this long to fail on their own (and write their error
# json) before they are terminated: a rank blocked in a collective with a dead peer may never return.
FAIL_GRACE_S = 2.0
# SIGTERM, then this long, then SIGKILL.
TERM_GRACE_S = 3.0
LOG_TAIL_LINES = 40
PORT_RETRIES = 1
_OOM_TEXTS = ("CUDA out of memory", "NPU out of memory", "OutOfMemoryError", "out of memory")
_PR_SET_PDEATHSIG = 1
# What each rank runs (`python -m <module> SPEC.json`); tests swap in a stand-in rank.
RANK_MODULE = "tuner.workload"


def run_trial(
    spec: TrialSpec,
    *,
    env: dict[str, str] | None = None,
    cpus: list[int] | None = None,
    stop: threading.Event | None = None,
    module: str | None = None,
) -> TrialResult:
    """Run one trial to completion and classify it; never raises because the trial failed.

    `env` adds environment variables for the ranks; `cpus` pins every rank to those cores;
    setting `stop` ends the trial early (status error, error_kind "cancelled"); `module` is what
    each rank runs instead of RANK_MODULE (the build runs `tuner.workload.build_rank`).
    """
    # The launcher runs in the trial's directory and the ranks read paths from the spec: a relative
    # workdir would mean another place to each of them.
    spec = dataclasses.replace(spec, workdir=str(Path(spec.workdir).absolute()))
    workdir = Path(spec.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec.to_dict(), indent=1))
    cmd = [sys.executable, "-m", "tuner.executors.local", str(spec_path), str(_world_size(spec))]
    cmd.append(module or RANK_MODULE)
    if cpus:
        cmd += ["--cpus", ",".join(str(c) for c in cpus)]
    child_env = {**os.environ, **(env or {})}
    # The ranks must import this same `tuner`, wherever the caller found it.
    package_root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, child_env.get("PYTHONPATH")) if p)

    start = time.monotonic()
    for attempt in range(1 + PORT_RETRIES):
        result = _run_once(spec, cmd, child_env, start + spec.timeout_s, stop)
        # The rendezvous port is free when the launcher picks it but only bound seconds later,
        # once rank 0 has imported torch; another process may take it in between.
        clash = "address already in use" in f"{result.error} {result.log_tail}".lower()
        if not (result.status == "error" and clash) or attempt == PORT_RETRIES:
            break
    if attempt:
        result.extra["port_retries"] = attempt
    return _finish(spec, result, start)


def _run_once(
    spec: TrialSpec, cmd: list[str], env: dict[str, str], deadline: float, stop: threading.Event | None
) -> TrialResult:
    workdir = Path(spec.workdir)
    for stale in [workdir / "result.json", workdir / "exits.json", *workdir.glob("rank*.error.json")]:
        stale.unlink(missing_ok=True)
    log_path = workdir / "trial.log"
    started_at = time.time()
    try:
        with open(workdir / "launcher.log", "wb") as launcher_log:
            launcher = subprocess.Popen(
                cmd,
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=launcher_log,
                start_new_session=True,
            )
    except OSError as err:
        return TrialResult(
            status="error", error_kind="launch", error=f"cannot start the trial launcher: {err}"
        )
    ended = _supervise(launcher, deadline, stop)
    result = _classify(spec, workdir, launcher.returncode, ended)
    result.extra["session"] = launcher.pid  # the trial's session id (its launcher leads it)
    timeline = _timeline(workdir, started_at)
    if timeline:
        result.extra["timeline"] = timeline
    result.log_path = str(log_path)
    result.log_tail = tail(log_path, LOG_TAIL_LINES)
    return result


def _timeline(workdir: Path, started_at: float) -> dict[str, float]:
    """Seconds from launch to rank 0's first output line (it prints once its training is built:
    imports, process group and model) and to the last rank's exit, and the CPU seconds all ranks
    had used at those points. Where per-trial overhead goes."""
    exits = _read_json(workdir / "exits.json") or {}
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


def _finish(spec: TrialSpec, result: TrialResult, start: float) -> TrialResult:
    result.wall_s = time.monotonic() - start
    result.node = socket.gethostname()
    result.tag = spec.tag
    if result.estimated_peak_mem_bytes is None:
        result.estimated_peak_mem_bytes = spec.estimated_peak_mem_bytes
    return result


def _supervise(launcher: subprocess.Popen, deadline: float, stop: threading.Event | None) -> str:
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


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is `sid`, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp session ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_session(sid: int, leader: subprocess.Popen | None = None) -> None:
    """Terminate every process of session `sid`: SIGTERM, a grace period, then SIGKILL.

    The ranks are killed before the launcher, so the launcher (their parent) reaps them instead of
    leaving zombies for init.
    """
    others = [p for p in session_pids(sid) if p != sid]
    if not others and (leader is None or leader.poll() is not None):
        return
    _signal_all(others, signal.SIGTERM)
    end = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < end and [p for p in session_pids(sid) if p != sid]:
        time.sleep(0.05)
    _signal_all([p for p in session_pids(sid) if p != sid], signal.SIGKILL)
    if leader is not None:
        try:
            leader.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            leader.kill()
            leader.wait()
    _signal_all(session_pids(sid), signal.SIGKILL)


# ---- classification ------------------------------------------------------------------------------


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _classify(spec: TrialSpec, workdir: Path, launcher_rc: int | None, ended: str) -> TrialResult:
    if ended == "timeout":
        return TrialResult(
            status="timeout",
            error_kind="timeout",
            error=f"trial ran past its timeout of {spec.timeout_s:g}s and was killed",
        )
    if ended == "cancelled":
        return TrialResult(status="error", error_kind="cancelled", error="trial was cancelled")
    exits = _read_json(workdir / "exits.json")
    if exits is None:
        launcher_log = tail(workdir / "launcher.log", 10)
        return TrialResult(
            status="error",
            error_kind="launcher",
            error=f"trial launcher exited with code {launcher_rc} before recording the ranks: {launcher_log}",
        )
    # Exit order matters: the first rank to fail is the cause, later ones usually lost a peer.
    order = [(int(e["rank"]), int(e["returncode"])) for e in exits["exits"]]
    failed = [(r, rc) for r, rc in order if rc != 0]
    errors = {r: _read_json(workdir / f"rank{r}.error.json") for r, _ in failed}
    if not failed:
        data = _read_json(workdir / "result.json")
        if data is None:
            return TrialResult(
                status="error",
                error_kind="no_result",
                error="all ranks exited 0 but rank 0 wrote no result.json",
            )
        result = TrialResult.from_dict(data)
        return _check_budget(spec, result)
    # An out-of-memory on any rank is never a consequence of another rank failing.
    for r, _ in failed:
        err = errors[r]
        if err and err.get("status") == "oom":
            return _failed_result("oom", r, err)
    rank, rc = failed[0]
    err = errors.get(rank)
    if err:
        return _failed_result(err.get("status", "error"), rank, err)
    if rc < 0:
        name = signal_name(rc)
        # Nothing here sends SIGKILL before a failure or the deadline; the kernel's OOM killer does.
        hint = " (often the kernel's out-of-memory killer; check `dmesg`)" if name == "SIGKILL" else ""
        return TrialResult(status="error", error_kind=name, error=f"rank {rank} was killed by {name}{hint}")
    log_tail = tail(workdir / "trial.log", LOG_TAIL_LINES)
    if any(t in log_tail for t in _OOM_TEXTS):
        return TrialResult(status="oom", error_kind="oom", error=f"rank {rank}: {_last_error_line(log_tail)}")
    return TrialResult(
        status="error",
        error_kind="exit_code",
        error=f"rank {rank} exited with code {rc}: {_last_error_line(log_tail)}",
    )


def _failed_result(status: str, rank: int, err: dict) -> TrialResult:
    status = status if status in ("oom", "error") else "error"
    return TrialResult(
        status=status,
        error_kind=err.get("error_kind") or status,
        error=f"rank {rank}: {err.get('error') or 'failed without a message'}",
        extra={"traceback": err.get("traceback")} if err.get("traceback") else {},
    )


def _check_budget(spec: TrialSpec, result: TrialResult) -> TrialResult:
    budget = spec.memory_budget_bytes
    peak = result.peak_mem_reserved_bytes or result.peak_mem_allocated_bytes
    if result.status == "ok" and budget and peak and peak > budget:
        result.status = "oom"
        result.error_kind = "budget"
        result.error = (
            f"measured peak memory {peak / 2**30:.2f} GiB exceeds the memory budget {budget / 2**30:.2f} GiB"
        )
    return result


def _last_error_line(text: str) -> str:
    lines = [ln.split("] ", 1)[-1].strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line[:500]
    return lines[-1][:500] if lines else "no output"


def tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a text file ("" when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * lines))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


# ---- the executor ---------------------------------------------------------------------------------


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
        world = _world_size(spec)
        with self._lock:
            if self._concurrent:
                return len(self._free(spec.family)) // world
            busy = any(s.family == spec.family for s, _, _ in self._running.values())
        return 0 if busy or len(self._devices(spec.family)) < world else 1

    def submit(self, spec: TrialSpec) -> None:
        if self.free_slots(spec) < 1:
            raise RuntimeError(f"no free {spec.family} slot for trial {spec.tag!r}; ask free_slots() first")
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
            result = TrialResult(status="error", error_kind=type(err).__name__, error=str(err), tag=spec.tag)
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


# ---- the launcher: `python -m tuner.executors.local SPEC.json WORLD MODULE [--cpus 0,1]` -----------


def _die_with_parent(sig: int) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(spec_path: str, world: int, module: str, cpus: list[int] | None) -> int:
    parent = os.getppid()
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the caller died before prctl took effect
        return 1
    if cpus:
        os.sched_setaffinity(0, cpus)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    workdir = Path(spec_path).parent
    port = _free_port()
    procs: dict[int, subprocess.Popen] = {}
    sel = selectors.DefaultSelector()
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",
        }
        p = subprocess.Popen(
            [sys.executable, "-m", module, spec_path],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: _die_with_parent(signal.SIGKILL),  # single-threaded here: safe
        )
        procs[rank] = p
        sel.register(p.stdout, selectors.EVENT_READ, rank)
    exits: list[dict] = []
    partial = dict.fromkeys(procs, b"")
    first_failure: float | None = None
    first_output: dict[int, float] = {}
    cpu_at_ready = None
    terminated_at: float | None = None
    all_exited_at: float | None = None
    with open(workdir / "trial.log", "ab") as log:
        while len(exits) < world or sel.get_map():
            # A rank's own children (loader workers) may hold its pipe open after it exited.
            if all_exited_at is not None and time.monotonic() - all_exited_at > 1.0:
                break
            for key, _ in sel.select(timeout=0.1):
                rank = key.data
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    chunk = b"\n" if partial[rank] else b""
                *lines, partial[rank] = (partial[rank] + chunk).split(b"\n")
                if lines and rank not in first_output:
                    first_output[rank] = time.time()
                    if rank == 0:
                        cpu_at_ready = sum(_cpu_seconds(q.pid) for q in procs.values())
                for line in lines:
                    log.write(b"[rank%d] %s\n" % (rank, line))
                log.flush()
            for rank, p in procs.items():
                if p.returncode is None and p.poll() is not None:
                    exits.append({"rank": rank, "returncode": p.returncode, "t": time.time()})
                    if p.returncode != 0 and first_failure is None:
                        first_failure = time.monotonic()
                    if len(exits) == world:
                        all_exited_at = time.monotonic()
            alive = [p for p in procs.values() if p.returncode is None]
            now = time.monotonic()
            give_up = first_failure is not None and now - first_failure > FAIL_GRACE_S
            if alive and (stopping.is_set() or give_up):
                if terminated_at is None:
                    terminated_at = now
                    for p in alive:
                        p.terminate()
                elif now - terminated_at > TERM_GRACE_S:
                    for p in alive:
                        p.kill()
    record = {
        "session": os.getsid(0),
        "world_size": world,
        "port": port,
        "exits": exits,
        "first_output": first_output,
        # CPU seconds of all ranks, which unlike wall time do not depend on how busy the machine is.
        "cpu_at_rank0_ready_s": cpu_at_ready,
        "cpu_total_s": _children_cpu_seconds(),
    }
    (workdir / "exits.json").write_text(json.dumps(record))
    return 0


def main(argv: list[str]) -> int:
    cpus = None
    if "--cpus" in argv:
        i = argv.index("--cpus")
        cpus = [int(c) for c in argv[i + 1].split(",")]
        argv = argv[:i] + argv[i + 2 :]
    spec_path, world, module = argv
    return _launch(spec_path, int(world), module, cpus)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
