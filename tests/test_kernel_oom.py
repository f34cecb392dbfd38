"""A rank the kernel's out-of-memory killer ends is an `oom`, not an `error`: the sampler's OOM floor
and memory model learn from it as from a device OOM. The real thing: `tuner measure` run in a
memory cgroup smaller than what one rank allocates."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from test_measure_cli import TINY  # the two-rank tiny gpt `tuner measure` is tested on

from tuner.executors.kernel_oom import _cgroup_file, kills_since, oom_kills
from tuner.executors.outcome import classify
from tuner.record.status import ERROR, OOM
from tuner.result import TrialResult, TrialSpec


def _new_memory_cgroup(limit_bytes: int) -> Path:
    """A fresh memory cgroup (v1 or v2) limited to `limit_bytes`, or a skip where none can be made."""
    name = f"tuner-test-{uuid.uuid4().hex[:8]}"
    v1 = Path("/sys/fs/cgroup/memory")
    if v1.is_dir():
        group, limit_file = v1 / name, "memory.limit_in_bytes"
    else:
        own = Path("/proc/self/cgroup").read_text().splitlines()[0].split("::", 1)[-1].lstrip("/")
        group, limit_file = Path("/sys/fs/cgroup") / own / name, "memory.max"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit_bytes))
    except OSError as err:
        with contextlib.suppress(OSError):
            group.rmdir()
        pytest.skip(f"cannot make a memory cgroup with a limit here ({err}); it needs root")
    return group


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    group = _new_memory_cgroup(limit_bytes)
    try:
        yield group
    finally:
        deadline = time.monotonic() + 10
        while True:  # its last processes are still being torn down for a moment
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def test_the_kernels_count_of_its_kills_is_read_in_this_process_cgroup_where_there_is_one():
    if not Path("/proc/vmstat").exists():
        pytest.skip("no /proc/vmstat")
    assert isinstance(oom_kills(), int) and kills_since(oom_kills()) == 0
    assert kills_since(None) is None
    if Path("/sys/fs/cgroup/memory").is_dir() or Path("/sys/fs/cgroup/cgroup.controllers").exists():
        assert _cgroup_file() is not None and _cgroup_file().name in ("memory.events", "memory.oom_control")


def test_an_unsearchable_cgroup_falls_back_to_the_machines_count(monkeypatch):
    """Path.exists raises where a directory on the way may not be searched: that reading used to
    escape from the launcher, ending every trial as a launcher error, instead of counting the
    machine's kills. And a count that went down (two counters) is unknown, not a kill."""
    if not Path("/proc/vmstat").exists():
        pytest.skip("no /proc/vmstat")

    def denied(self, *args, **kwargs):
        if str(self).startswith("/sys/fs/cgroup"):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    real = Path.exists
    monkeypatch.setattr(Path, "exists", denied)
    assert _cgroup_file() is None
    machine = oom_kills()
    assert isinstance(machine, int)
    assert kills_since(machine + 1) is None


def test_a_kill_in_another_cgroup_is_not_counted_as_this_ones():
    """The machine's count would take another container's kill for this trial's."""
    if _cgroup_file() is None:
        pytest.skip("no memory cgroup readable here")
    before = oom_kills()
    with memory_cgroup(64 * 2**20) as group:
        script = f"echo $$ > {group}/cgroup.procs && exec {sys.executable} -c 'b = bytearray(256 * 2**20)'"
        assert subprocess.run(["sh", "-c", script], timeout=60).returncode == -signal.SIGKILL
    assert oom_kills() == before


def test_cpu_memory_is_the_containers_limit_where_that_is_smaller():
    """In a container or batch job limited to less than the machine, CPU trials were planned and
    budgeted against the machine's memory, and the kernel ended them at the limit."""
    probe = "from tuner.devices import describe; print(describe('cpu').memory_bytes)"
    machine = int(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    )
    with memory_cgroup(1200 * 2**20) as group:
        run = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) == 1200 * 2**20 < machine


def _measure_in_a_small_cgroup(tmp_path: Path, fault: dict[str, str], *args: str) -> dict:
    """`tuner measure` of the tiny recipe in a 1,200 MiB memory cgroup with a fault that allocates
    past it: its JSON document, after checking it exited 1 as an oom."""
    if oom_kills() is None:
        pytest.skip("the kernel's oom_kill count is not readable here")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    with memory_cgroup(1200 * 2**20) as group:
        run = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"]
            + [sys.executable, "-m", "tuner.cli.main", "measure", "tiny.yaml", *args, "--json"],
            cwd=tmp_path,
            env={**os.environ, **fault},
            capture_output=True,
            text=True,
            timeout=240,
        )
    doc = json.loads(run.stdout)
    assert run.returncode == 1 and doc["status"] == OOM, doc["error"]
    return doc


def test_a_rank_the_kernels_oom_killer_ends_is_an_oom_with_the_fix(tmp_path):
    doc = _measure_in_a_small_cgroup(
        tmp_path, {"TUNER_TEST_FAULT": "alloc:3000", "TUNER_TEST_FAULT_RANK": "1"}
    )
    assert "rank 1 was killed by the kernel's out-of-memory killer" in doc["error"]
    assert "micro_batch_size" in doc["error"]


def test_a_loader_worker_the_kernels_oom_killer_ends_is_an_oom(tmp_path):
    """The killer took a rank's data-loader worker, not the rank: the rank reported "DataLoader
    worker ... exited unexpectedly" and the trial was an `error` the memory model never saw."""
    doc = _measure_in_a_small_cgroup(
        tmp_path, {"TUNER_TEST_FAULT": "loader-alloc:3000"}, "--set", "loader_workers=1"
    )
    assert "a process it started was killed, and the kernel's out-of-memory killer" in doc["error"]
    assert "DataLoader worker" in doc["error"] and "loader_workers" in doc["error"]


def test_a_loader_worker_killed_without_the_oom_killer_stays_an_error(tmp_path):
    exits = [{"rank": 0, "returncode": 1, "t": 1.0}]
    (tmp_path / "exits.json").write_text(json.dumps({"exits": exits, "oom_kills": 0}))
    text = "DataLoader worker (pid(s) 4242) exited unexpectedly"
    (tmp_path / "rank0.error.json").write_text(json.dumps({"status": ERROR, "error": text}))
    result = classify(
        TrialSpec(recipe={}, config={}, family="cpu", workdir=str(tmp_path)), tmp_path, 1, "exited"
    )
    assert result.status == ERROR and result.error == f"rank 0: {text}"


def _ranks_exited(workdir: Path, oom_kills_then: int | None) -> TrialSpec:
    exits = [{"rank": 1, "returncode": -9, "t": 1.0}, {"rank": 0, "returncode": 1, "t": 1.5}]
    (workdir / "exits.json").write_text(json.dumps({"exits": exits, "oom_kills": oom_kills_then}))
    (workdir / "rank0.error.json").write_text(
        json.dumps({"status": ERROR, "error": "Connection closed by peer"})
    )
    return TrialSpec(recipe={}, config={}, family="cpu", workdir=str(workdir))


@pytest.mark.parametrize(
    ("kills", "status", "says"),
    [
        (1, OOM, "out-of-memory killer (it killed 1 process(es)"),
        (0, ERROR, "SIGKILL (not the kernel's out-of-memory killer, by its count)"),
        (None, ERROR, "SIGKILL (check `dmesg`)"),
    ],
)
def test_a_sigkilled_rank_is_an_oom_only_when_the_kernel_counted_a_kill(tmp_path, kills, status, says):
    result = classify(_ranks_exited(tmp_path, kills), tmp_path, 0, "exited")
    assert result.status == status and says in result.error and result.error.startswith("rank 1 ")


def _node_exited(
    workdir: Path, exits: list[tuple[int, int]], oom_kills_then: int, lost: list[int]
) -> TrialResult:
    """One node's part of a two-node trial, as its launcher leaves it, classified."""
    workdir.mkdir()
    records = [{"rank": r, "returncode": rc, "t": float(i)} for i, (r, rc) in enumerate(exits)]
    (workdir / "exits.json").write_text(json.dumps({"exits": records, "oom_kills": oom_kills_then}))
    for r in lost:
        (workdir / f"rank{r}.error.json").write_text(
            json.dumps({"status": ERROR, "error": "Connection closed by peer"})
        )
    spec = TrialSpec(recipe={}, config={}, family="cpu", workdir=str(workdir))
    return classify(spec, workdir, 0, "exited", expect_result=False)


def test_an_oom_kill_on_another_node_is_the_trials_cause(tmp_path):
    """Node 1's rank 2 was killed by the OOM killer and its rank 3 lost the peer; on node 0, rank
    0 lost the peer and rank 1, stuck in a collective, was ended by its launcher (SIGTERM). The
    trial was an `error` blaming node 0's SIGTERMed rank: node order won, and within node 0 the
    rank with no record came before the one that only lost a peer."""
    from tuner.executors.ray_gang import Part, Trial, combine

    node0 = _node_exited(tmp_path / "node0", [(0, 1), (1, -signal.SIGTERM)], 0, lost=[0])
    node1 = _node_exited(tmp_path / "node1", [(2, -signal.SIGKILL), (3, 1)], 1, lost=[3])
    assert node0.status == ERROR and "rank 0: Connection closed by peer" in node0.error
    assert node1.status == OOM
    spec = TrialSpec(recipe={}, config={}, family="cpu", workdir=str(tmp_path))
    trial = Trial(spec=spec, resource="CPU", per_node=2, nnodes=2, submitted=0.0,
                  parts=[Part(None, 0, result=node0), Part(None, 1, result=node1)])  # fmt: skip
    result = combine(trial)
    assert result.status == OOM
    assert result.error.startswith("node 1 of 2: rank 2 was killed by the kernel's out-of-memory killer")
