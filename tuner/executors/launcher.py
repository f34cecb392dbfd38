"""The launcher of one trial, `python -m tuner.executors.launcher SPEC.json WORLD MODULE [--cpus 0,1]
[--node NODE_RANK,NNODES,ADDR,PORT]`: started by `run_trial` in a new session, it starts every rank
(of this node, for a multi-node trial) of `python -m MODULE SPEC.json` with
torchrun's environment variables, writes their output with rank prefixes to `trial.log`, ends the
group when a rank fails, and records each rank's exit in `exits.json`. Started cold it imports no
torch; forked from the warm helper (`tuner.executors.warm`) it forks each rank from itself, torch
already imported (`tuner.executors.forked`), and supervises them the same way.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from tuner.executors.kernel_oom import kills_since, oom_kills
from tuner.executors.nodes import NodePart, free_port, rank_env
from tuner.executors.session import TERM_GRACE_S, die_with_parent, record_session
from tuner.stopping import StopFlag

# After the first rank fails, the others get this long to fail on their own (and write their error
# json) before they are terminated: a rank blocked in a collective with a dead peer may never return.
FAIL_GRACE_S = 2.0


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


class RankGroup:
    """The ranks of one trial: their output pumped into trial.log with rank prefixes, their exits
    recorded in order, and the rest ended once one fails (after FAIL_GRACE_S) or on SIGTERM."""

    def __init__(
        self,
        procs: dict[int, subprocess.Popen],
        workdir: Path,
        stopping: StopFlag,
        oom_kills_at_start: int | None,
    ):
        self.procs = procs
        self.workdir = workdir
        self.stopping = stopping
        self.sel = selectors.DefaultSelector()
        for rank, p in procs.items():
            self.sel.register(p.stdout, selectors.EVENT_READ, rank)
        self.partial = dict.fromkeys(procs, b"")
        self.exits: list[dict] = []
        self.first_output: dict[int, float] = {}
        self.cpu_at_ready: float | None = None
        self.first_failure: float | None = None
        self.terminated_at: float | None = None
        self.all_exited_at: float | None = None
        self.oom_kills_at_start = oom_kills_at_start  # read before the first rank started

    def run(self) -> None:
        with open(self.workdir / "trial.log", "ab") as log:
            while len(self.exits) < len(self.procs) or self.sel.get_map():
                # A rank's own children (loader workers) may hold its pipe open after it exited.
                if self.all_exited_at is not None and time.monotonic() - self.all_exited_at > 1.0:
                    break
                self._pump(log)
                self._reap()
                self._end_the_rest()

    def _pump(self, log) -> None:
        for key, _ in self.sel.select(timeout=0.1):
            rank = key.data
            chunk = os.read(key.fd, 65536)
            if not chunk:
                self.sel.unregister(key.fileobj)
                chunk = b"\n" if self.partial[rank] else b""
            *lines, self.partial[rank] = (self.partial[rank] + chunk).split(b"\n")
            if lines and rank not in self.first_output:
                self.first_output[rank] = time.time()
                if rank == 0:
                    self.cpu_at_ready = sum(_cpu_seconds(q.pid) for q in self.procs.values())
            for line in lines:
                log.write(b"[rank%d] %s\n" % (rank, line))
            log.flush()

    def _reap(self) -> None:
        for rank, p in self.procs.items():
            if p.returncode is None and p.poll() is not None:
                self.exits.append({"rank": rank, "returncode": p.returncode, "t": time.time()})
                if p.returncode != 0 and self.first_failure is None:
                    self.first_failure = time.monotonic()
                if len(self.exits) == len(self.procs):
                    self.all_exited_at = time.monotonic()

    def _end_the_rest(self) -> None:
        alive = [p for p in self.procs.values() if p.returncode is None]
        now = time.monotonic()
        give_up = self.first_failure is not None and now - self.first_failure > FAIL_GRACE_S
        if not alive or not (self.stopping.is_set() or give_up):
            return
        if self.terminated_at is None:
            self.terminated_at = now
            for p in alive:
                p.terminate()
        elif now - self.terminated_at > TERM_GRACE_S:
            for p in alive:
                p.kill()

    def record(self, port: int, node: NodePart | None) -> dict:
        return {
            "session": os.getsid(0),
            "world_size": len(self.procs),
            "node_rank": 0 if node is None else node.node_rank,
            "port": port,
            "exits": self.exits,
            # How many processes the kernel's OOM killer killed while the ranks ran (None: unknown).
            "oom_kills": kills_since(self.oom_kills_at_start),
            "first_output": self.first_output,
            # CPU seconds of all ranks, which unlike wall time do not depend on how busy the machine is.
            "cpu_at_rank0_ready_s": self.cpu_at_ready,
            "cpu_total_s": _children_cpu_seconds(),
        }


def _start_rank(
    rank: int, world: int, port: int, module: str, spec_path: str, fork: bool, node: NodePart | None
):
    env = rank_env(rank, world, port, node)
    if fork:
        from tuner.executors.forked import fork_rank

        return fork_rank(module, spec_path, env)
    return subprocess.Popen(
        [sys.executable, "-m", module, spec_path],
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: die_with_parent(signal.SIGKILL),  # single-threaded here: safe
    )


def _launch(
    spec_path: str,
    world: int,
    module: str,
    cpus: list[int] | None,
    fork: bool = False,
    node: NodePart | None = None,
) -> int:
    # A cold launcher is told who started it: had its caller died while this interpreter was still
    # starting, getppid() would already name init, and the check below would wrongly pass. (A warm
    # one is forked, so getppid() is its helper from the first instruction.)
    parent = int(os.environ.pop("TUNER_LAUNCHER_PARENT", "") or os.getppid())
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the caller died before prctl took effect
        return 1
    if cpus:
        os.sched_setaffinity(0, cpus)
    stopping = StopFlag()
    signal.signal(signal.SIGTERM, stopping.set)
    workdir = Path(spec_path).parent
    record_session(workdir)
    port = free_port() if node is None else node.master_port
    ranks = range(world) if node is None else node.ranks(world)
    kills_before = oom_kills()
    procs = {rank: _start_rank(rank, world, port, module, spec_path, fork, node) for rank in ranks}
    group = RankGroup(procs, workdir, stopping, kills_before)
    group.run()
    (workdir / "exits.json").write_text(json.dumps(group.record(port, node)))
    return 0


def _option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    if name not in argv:
        return None, argv
    i = argv.index(name)
    return argv[i + 1], argv[:i] + argv[i + 2 :]


def main(argv: list[str], fork: bool = False) -> int:
    """`fork`: start the ranks by forking this process (the warm start) instead of new interpreters."""
    cpus, argv = _option(argv, "--cpus")
    node, argv = _option(argv, "--node")  # this node's share of a multi-node trial (NodePart.to_arg)
    spec_path, world, module = argv
    return _launch(
        spec_path,
        int(world),
        module,
        [int(c) for c in cpus.split(",")] if cpus else None,
        fork,
        NodePart.from_arg(node) if node else None,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
