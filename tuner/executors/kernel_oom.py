"""The kernel's out-of-memory killer, as a trial sees it: a rank it kills dies by SIGKILL and
leaves no error record, so the only sign is the kernel's own count of its kills.

The count is read where it is narrowest: this process's memory cgroup (`tuner.cgroup`; v2
`memory.events`, v1 `memory.oom_control`: kills of processes in the cgroup the launcher and its
ranks share, whether the cgroup's limit or the machine ran out), else the machine's (`oom_kill`
in /proc/vmstat, Linux 4.13 and later), where a kill elsewhere on the machine while a rank died
by SIGKILL for another reason would be taken for this trial's."""

from __future__ import annotations

from pathlib import Path

from tuner.cgroup import memory_cgroup


def _read_count(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _cgroup_file() -> Path | None:
    """This process's memory cgroup's file of event counts."""
    found = memory_cgroup()
    if found is None:
        return None
    directory, version = found
    return directory / ("memory.events" if version == 2 else "memory.oom_control")


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed, counted in this process's
    memory cgroup where readable, else on the whole machine; None where neither is readable. A
    rank that died by SIGKILL while this count rose was, in all likelihood, one of them: nothing in
    the tuner sends SIGKILL before a failure or a deadline."""
    cgroup = _cgroup_file()
    count = _read_count(cgroup, "oom_kill") if cgroup is not None else None
    return count if count is not None else _read_count(Path("/proc/vmstat"), "oom_kill")


def kills_since(before: int | None) -> int | None:
    """The kills counted since `before` (an `oom_kills()` reading); None where either is unknown,
    or where the count went down (the readings came from two counters: the cgroup's file became
    unreadable in between)."""
    after = oom_kills()
    return None if before is None or after is None or after < before else after - before
