"""A cancelled trial's session files in a runs directory shared between hosts (compose's /data/runs,
NFS): the driver ends only the sessions recorded on its own host and pid namespace, never a local
process whose session id happens to match another host's entry."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tuner.executors.session import SESSION_FILE, end_processes_in, host_identity, pids_in


@pytest.fixture
def bystander():
    """A process of this host leading a session of its own (`setsid sleep 300`): somebody else's."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield proc
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _record(trial: Path, sid: int, host: str | None) -> None:
    (trial / "node1").mkdir(parents=True)
    text = f"{sid}\n" if host is None else f"{sid} {host}\n"
    (trial / "node1" / SESSION_FILE).write_text(text)


def test_host_identity_is_this_boot_and_pid_namespace():
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert host_identity() == f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"


@pytest.mark.parametrize(
    "host",
    [
        "00000000-0000-0000-0000-000000000000/4026531836",  # another machine's launcher
        "same-boot-other-pidns",  # filled in below: another container of this machine
        None,  # a file of the old format: nothing says where it was written
    ],
)
def test_a_session_recorded_elsewhere_is_never_killed_here(tmp_path, bystander, host):
    if host == "same-boot-other-pidns":
        host = host_identity().split("/")[0] + "/1"
    _record(tmp_path / "trial-x", bystander.pid, host)

    assert pids_in(str(tmp_path / "trial-x")) == []
    assert end_processes_in(str(tmp_path / "trial-x"), 0.2) == []
    assert bystander.poll() is None


def test_a_session_recorded_on_this_host_is_ended(tmp_path, bystander):
    _record(tmp_path / "trial-x", bystander.pid, host_identity())

    assert end_processes_in(str(tmp_path / "trial-x"), 0.2) == [bystander.pid]
    assert bystander.wait(timeout=5) == -signal.SIGKILL
