"""A trial's processes are one session (the launcher leads it): finding what is alive in a session,
and ending all of it, so a trial never leaves a process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# SIGTERM, then this long, then SIGKILL.
TERM_GRACE_S = 3.0
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


def _live_processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the parenthesised command: state ppid pgrp
    session ...) of every live (non-zombie) process of this machine."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            yield int(entry), fields


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is `sid`, from /proc."""
    return [pid for pid, fields in _live_processes() if int(fields[3]) == sid]


# In a trial's directory (a node part's, on Ray): the session its launcher leads and the host it runs
# on, written before it starts a rank (`record_session`). The latest launch's only: an earlier
# launch's session was ended with it, and its number may since lead somebody else's.
SESSION_FILE = "session"


def host_identity() -> str:
    """This machine and pid namespace: a session id means a process group only where it was
    recorded. A runs directory shared between hosts (compose's /data/runs, NFS) holds the node
    parts' session files of other machines, whose numbers may be anyone's here."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # no /proc: no entry is known to be this host's, and none is acted on
    return f"{boot}/{pidns}"


def record_session(workdir: Path) -> None:
    """Record the session this process leads (a trial's launcher, before its ranks start) and this
    host (`host_identity`) in `workdir`, so that `pids_in` can tell the trial's processes from
    anyone else's."""
    (workdir / SESSION_FILE).write_text(f"{os.getsid(0)} {host_identity()}\n")


def trial_sessions(directory: str) -> set[int]:
    """The sessions the trial's launchers recorded in `directory` or below it on this host.

    A file without this host's identity is not acted on: another host's, or one written before
    the identity was recorded (a launcher of an earlier version; nothing tells whose machine it
    ran on, and killing a stranger's session is worse than leaving a cancelled trial's remains to
    its launcher's own parent-death watch)."""
    here = host_identity()
    sids = set()
    for path in Path(directory).rglob(SESSION_FILE):
        with contextlib.suppress(OSError, ValueError):
            sid, host = path.read_text().split()
            if here and host == here:
                sids.add(int(sid))
    return sids - {0}


def pids_in(directory: str) -> list[int]:
    """Live (non-zombie) processes of this machine in the sessions the trial's launchers recorded in
    `directory` (`record_session`): the launcher, its ranks, their workers, and what they left
    when the launcher died, wherever they work. Nobody else's, even sitting in the directory: a
    user's shell or `tail -f` there leads or belongs to a session of its own."""
    sids = trial_sessions(directory)
    if not sids:
        return []
    return [pid for pid, fields in _live_processes() if int(fields[3]) in sids and pid != os.getpid()]


def end_processes_in(directory: str, grace_s: float) -> list[int]:
    """Wait up to `grace_s` for the trial's processes recorded in `directory` (`pids_in`) to exit,
    then SIGKILL the rest and wait for them to go. Returns the pids that had to be killed."""
    left = _wait_gone(lambda: pids_in(directory), grace_s, 0.05)
    _signal_all(left, signal.SIGKILL)
    _wait_gone(lambda: pids_in(directory), TERM_GRACE_S, 0.02)
    return left


def _wait_gone(alive: Callable[[], list[int]], seconds: float, poll_s: float) -> list[int]:
    """Poll `alive` every `poll_s` until it lists no process or `seconds` pass; what it lists
    then."""
    end = time.monotonic() + seconds
    while (left := alive()) and time.monotonic() < end:
        time.sleep(poll_s)
    return left


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_session(sid: int, leader: subprocess.Popen | None = None) -> None:
    """Terminate every process of session `sid`: SIGTERM, a grace period, then SIGKILL.

    The ranks are killed before the launcher, so the launcher (their parent) reaps them instead of
    leaving zombies for init. Without `leader` (the warm helper's forked launcher, its unreaped
    child: the pid cannot have been reused), the launcher is stopped first, so it forks no rank
    while its session is ended, and killed last; it may not lead its session yet (a fork that has
    not reached `setsid`), so it is signalled by pid.
    """
    if leader is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sid, signal.SIGSTOP)
    others = [p for p in session_pids(sid) if p != sid]
    if not others and leader is not None and leader.poll() is not None:
        return
    _signal_all(others, signal.SIGTERM)
    left = _wait_gone(lambda: [p for p in session_pids(sid) if p != sid], TERM_GRACE_S, 0.05)
    _signal_all(left, signal.SIGKILL)
    if leader is not None:
        try:
            leader.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            leader.kill()
            leader.wait()
    else:
        _signal_all([sid], signal.SIGKILL)  # stopped, it would not act on SIGTERM before SIGCONT
    _signal_all(session_pids(sid), signal.SIGKILL)
    # A killed process lives on until the kernel has torn it down (its memory, its sockets): wait
    # for that too, so that nothing of the trial is running when this returns.
    _wait_gone(lambda: session_pids(sid), TERM_GRACE_S, 0.02)


def signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
