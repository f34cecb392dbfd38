"""A rank's peak memory: the allocator's statistics on CUDA/NPU, the resident set on CPU.

CPU has no allocator view in torch, so a CPU rank reads its resident set twice: the trial's
high-water mark is its `reserved` (glibc's retained heap included), and one untimed step (the
second warm-up step, or one after the timed steps when the warm-up is shorter), with the heap
trimmed and malloc's in-use bytes sampled, gives its `allocated` (`HeldMemory`).
docs/DESIGN.md, "CPU memory", has the numbers behind the split.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch


def _proc_status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_memory(family: str) -> int:
    """Start a fresh peak-memory window; return the baseline (bytes) later peaks are relative to.

    On CPU torch keeps no allocator statistics, so the peak is the process's resident-set high
    water mark (VmHWM), reset through /proc/self/clear_refs, and the baseline is the RSS now.
    """
    if family == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return 0
    if family == "npu":
        torch.npu.reset_peak_memory_stats()
        return 0
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _proc_status_kb("VmRSS") * 1024


def peak_memory(family: str, baseline: int = 0) -> tuple[int, int]:
    """(allocated, reserved) peak bytes since `reset_peak_memory`."""
    peak = memory_peak(family, baseline)
    return peak.allocated, peak.reserved


@dataclass(frozen=True)
class MemoryPeak:
    """Peak memory of one rank since `reset_peak_memory`, as the device's allocator reports it."""

    allocated: int  # bytes in tensors (CPU: what the rank holds with freed memory handed back)
    reserved: int  # bytes the caching allocator (CPU: the process's heap) holds from the device
    active: int | None = None  # bytes in active blocks (incl. freed-but-not-yet-reusable); CUDA/NPU
    separate: bool = False  # allocated and reserved are two readings, not one read twice

    @property
    def fragmentation(self) -> int | None:
        """Reserved minus allocated at the peak: what the pool holds but no tensor uses. The two
        peaks may fall at different moments, so this bounds the waste at the allocation peak from
        above. None where both figures are one reading (a CPU rank without `HeldMemory`)."""
        return max(0, self.reserved - self.allocated) if self.separate else None


def memory_peak(family: str, baseline: int = 0) -> MemoryPeak:
    """CPU: allocated and reserved are both the resident-set growth over `baseline` (RSS high
    water mark - baseline) until `HeldMemory` separates them; CUDA/NPU: the allocator's
    peak statistics."""
    if family in ("cuda", "npu"):
        stats = (torch.cuda if family == "cuda" else torch.npu).memory_stats()
        return MemoryPeak(
            allocated=int(stats.get("allocated_bytes.all.peak", 0)),
            reserved=int(stats.get("reserved_bytes.all.peak", 0)),
            active=int(stats.get("active_bytes.all.peak", 0)),
            separate=True,
        )
    growth = max(0, _rss_high_water() - baseline)
    return MemoryPeak(growth, growth)


def _rss_high_water() -> int:
    hwm = _proc_status_kb("VmHWM") * 1024
    if hwm == 0:  # no /proc: fall back to getrusage (kilobytes on Linux)
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return hwm


HOST_MEMORY_ENV = "TUNER_HOST_MEMORY"  # =exact: a CPU rank measures the bytes it holds
_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES = -3, 128 * 1024  # glibc's mallopt key, its first value
_M_ARENA_MAX = -8


def one_malloc_heap(family: str) -> bool:
    """CPU, glibc: every thread of the rank allocates from the main heap (`M_ARENA_MAX` 1), so
    `HeldMemory`'s trim reaches all of its freed memory. `malloc_trim` returns a thread heap's free
    pages but never that heap's free top, which held 32 MiB of an FSDP llama-tiny rank (gloo's
    threads free there): its held reading was 139 MiB against 106 in exact mode, 106.5 with one
    heap. Called at the rank's start, before its threads exist; True when it was set."""
    libc = _glibc() if family == "cpu" else None
    return bool(libc and libc.mallopt(_M_ARENA_MAX, 1))


def exact_host_memory(family: str) -> bool:
    """With `TUNER_HOST_MEMORY=exact`, make a CPU rank's resident set follow its live memory for
    the whole trial: glibc's malloc then maps every block of 128 KiB or more on its own and
    unmaps it when freed. Called before the memory baseline; True when it was done (CPU, glibc,
    the variable set).

    By default glibc raises that threshold to the largest block freed (up to 32 MiB) and its
    heap keeps freed chunks resident, so the RSS peak grows step after step with the heap's
    fragmentation, not with the config (numbers in docs/DESIGN.md, "CPU memory"). Exact mode
    costs page faults on every large allocation (+40% to +70% CPU time per step on llama-tiny):
    it is for checking `HeldMemory` against, not for timing.
    """
    if family != "cpu" or os.environ.get(HOST_MEMORY_ENV, "") != "exact":
        return False
    libc = _glibc()
    return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None


class HeldMemory:
    """A CPU rank's allocated peak over one untimed step: the CPU's counterpart of the CUDA
    allocator's `allocated_bytes.all.peak`, where the trial's RSS peak is its `reserved`.

    On entry the heap's free pages go back to the OS (`malloc_trim`), so the resident set is what
    the rank holds between steps (weights, gradients, optimizer state, code: 126 MiB for a
    gpt-tiny rank at micro-batch 4, against 127 MiB when glibc hands freed memory back all trial
    long). During the step a thread samples malloc's in-use bytes every millisecond
    (`mallinfo2`); their rise is the step's transient (32.8 MiB there, against 33 MiB of RSS
    rise in exact mode). Resident bytes are not used for the transient because the step's small
    blocks land in the trimmed holes and fault in whole pages (+14 MiB on the same rank).
    """

    INTERVAL_S = 0.001

    def __init__(self, libc: ctypes.CDLL, baseline: int):
        self._libc, self._baseline = libc, baseline
        self.taken = False  # whether a step was read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="held-memory", daemon=True)

    def _in_use(self) -> int:
        info = self._libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.top = max(self.top, self._in_use())
            time.sleep(self.INTERVAL_S)

    def __enter__(self) -> HeldMemory:
        self._libc.malloc_trim(0)
        self.held = max(0, _proc_status_kb("VmRSS") * 1024 - self._baseline)
        self.start = self.top = self._in_use()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.top = max(self.top, self._in_use())
        self.taken = True

    def peak(self, timed: MemoryPeak) -> MemoryPeak:
        """`timed` (the timed steps' reading) with its allocated figure from this step."""
        return replace(timed, allocated=self.held + self.top - self.start, separate=True)


def held_memory(family: str, baseline: int) -> HeldMemory | None:
    """The `HeldMemory` reading for a rank whose memory baseline is `baseline`; None where there
    is none (not CPU, or malloc is not glibc's), and allocated stays the RSS reading then."""
    libc = _glibc() if family == "cpu" else None
    return HeldMemory(libc, baseline) if libc is not None else None
