"""A stop request that a signal handler may set: `StopFlag`, used by the trial launcher and by the
worker service for SIGTERM/SIGINT."""

from __future__ import annotations

import time

# How often `StopFlag.wait` looks at the flag: the most a stop request waits to be noticed.
POLL_S = 0.05


class StopFlag:
    """A plain attribute, no lock. `threading.Event` takes a lock in `set()`, and a handler that
    interrupts code holding that lock (the Event's own `wait`, or another handler's `set`: SIGINT
    from Ctrl-C and then SIGTERM from `tuner serve` reach a worker a moment apart) waits for it
    forever. Seen once in CI: an orphaned launcher in a futex wait with a signal handler's
    `acquire` on top of another `acquire` of the same lock, its rank a zombie. Other threads read
    the flag with `is_set()`; an assignment is atomic in CPython."""

    def __init__(self) -> None:
        self.requested = False

    def set(self, *_: object) -> None:
        """Usable as a signal handler itself: `signal.signal(SIGTERM, flag.set)`."""
        self.requested = True

    def is_set(self) -> bool:
        return self.requested

    def wait(self, timeout: float) -> bool:
        """Sleep until the flag is set or `timeout` seconds pass; returns the flag. Sleeps in short
        slices instead of on a lock, so a handler that sets the flag needs no lock to wake it."""
        deadline = time.monotonic() + timeout
        while not self.requested:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(POLL_S, left))
        return self.requested
