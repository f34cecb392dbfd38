"""This process's memory cgroup (v1 or v2): where the kernel counts its out-of-memory kills
(`tuner.executors.kernel_oom`) and what limits the memory a CPU trial may use (`tuner.devices`).

/proc/self/cgroup names the cgroup relative to the hierarchy's root, which a container may have
mounted at one of its ancestors: the longest tail of that path that exists under the mount is the
cgroup (the mount itself, at worst)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
# v1 writes "no limit" as the largest page-aligned 64-bit count; anything near it is no limit.
_NO_LIMIT = 2**62


def memory_cgroup() -> tuple[Path, int] | None:
    """(the directory of this process's memory cgroup, its cgroup version 1 or 2); None where
    there is none readable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and _exists(ROOT / "cgroup.controllers"):
            mount, version, probe = ROOT, 2, "memory.events"
        elif "memory" in controllers.split(","):
            mount, version, probe = ROOT / "memory", 1, "memory.oom_control"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts) + 1):
            directory = mount.joinpath(*parts[i:])
            if _exists(directory / probe):
                return directory, version
    return None


def memory_limit() -> int | None:
    """The bytes this process's memory cgroup and those above it, up to the mount, may use
    together: the smallest limit among them; None where none is set or readable."""
    found = memory_cgroup()
    if found is None:
        return None
    directory, version = found
    mount = ROOT if version == 2 else ROOT / "memory"
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    limits = []
    for d in (directory, *directory.parents):
        try:
            text = (d / name).read_text().strip()
        except OSError:
            text = ""
        if text.isdigit() and int(text) < _NO_LIMIT:
            limits.append(int(text))
        if d == mount:
            break
    return min(limits) if limits else None


def _exists(path: Path) -> bool:
    """Whether `path` exists; False where a directory on the way may not be searched (Path.exists
    raises then)."""
    try:
        return path.exists()
    except OSError:
        return False
