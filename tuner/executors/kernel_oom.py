"""The kernel's out-of-memory killer, as a trial sees it: a rank it kills dies by SIGKILL and
leaves no error record, so the only sign is the kernel's own count of its kills."""

from __future__ import annotations

from pathlib import Path


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed since boot (`oom_kill` in
    /proc/vmstat, Linux 4.13 and later; a kill at a cgroup's limit counts there too), or None
    where it is not readable. A rank that died by SIGKILL while this count rose was, in all
    likelihood, one of them: nothing in the tuner sends SIGKILL before a failure or a deadline."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def kills_since(before: int | None) -> int | None:
    """The kills counted since `before` (an `oom_kills()` reading); None where either is unknown."""
    after = oom_kills()
    return None if before is None or after is None else after - before
