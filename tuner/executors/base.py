"""The executor contract: how the study hands trials to devices and gets results back.

Implementations: `local.LocalExecutor` (subprocesses on this machine) and
`ray_executor.RayExecutor` (Ray tasks on a cluster). One contract test suite runs against both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from tuner.result import TrialResult, TrialSpec

if TYPE_CHECKING:
    from tuner.devices import DeviceInfo
    from tuner.fingerprint import Described
    from tuner.perf.priors import DevicePriors


T = TypeVar("T")


class Executor(ABC):
    """Runs trials, each in a process group of its own, never in the caller's process.

    Contract:
    - `free_slots(spec)` says how many more trials like `spec` can start now without sharing a
      device (or, on CPU, a core) with a running trial. Concurrency follows resources.
    - `submit(spec)` starts the trial and returns at once. It raises `RuntimeError` when there is
      no free slot; callers ask `free_slots` first.
    - `wait(timeout)` blocks until at least one submitted trial finished (or `timeout` seconds
      passed) and returns the finished results. Each submitted trial's result is returned exactly
      once, with `result.tag == spec.tag`. A trial that crashed, hung, ran out of memory or lost
      its worker comes back as a result with that status; `wait` itself does not raise for it.
    - `cancel()` stops every running trial (no orphan processes) and forgets them.
    - `close()` releases the executor's resources; it cancels what still runs.
    """

    name: str = "abstract"
    # Whether trials may run on other machines than this one (so files they write are not here).
    elsewhere: bool = False

    @abstractmethod
    def free_slots(self, spec: TrialSpec) -> int: ...

    @abstractmethod
    def submit(self, spec: TrialSpec) -> None: ...

    @abstractmethod
    def wait(self, timeout: float | None = None) -> list[TrialResult]: ...

    @abstractmethod
    def running(self) -> list[str]:
        """Tags of the trials in flight."""

    @abstractmethod
    def cancel(self) -> None: ...

    def close(self) -> None:
        self.cancel()

    def describe(self, requested: str) -> Described:
        """What a recipe's `hardware.device` (auto, cpu, cuda or npu) means where these trials run:
        the family, what its devices offer and the fingerprint a study of them is keyed by; a
        ValueError naming the field and the fix where there is no such device. The default: this
        machine's (`tuner.fingerprint.described_here`)."""
        from tuner.fingerprint import described_here

        return described_here(requested)

    def call_on_devices(self, fn: Callable[..., T], args: tuple, family: str, count: int) -> T:
        """`fn(*args)` where this executor's trials run, holding `count` devices of `family`
        meanwhile (a winner's build); by default in this process, on this machine."""
        return fn(*args)

    def device_priors(self, device: DeviceInfo) -> DevicePriors | None:
        """The performance model's priors for the machine these trials run on, where this host's
        own (`tuner.perf.priors.device_priors(device)`, the default: None) would be wrong."""
        return None

    def run(self, spec: TrialSpec) -> TrialResult:
        """Run one trial to completion (convenience for `tuner measure` and tests)."""
        self.submit(spec)
        while True:
            for result in self.wait(timeout=1.0):
                if result.tag == spec.tag:
                    return result

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
