"""A build's phases run as trials of their own (`tuner.executors.local.run_trial` with the build's
rank module): each phase is a fresh process group, so a compile crash or hang costs the phase."""

from __future__ import annotations

import dataclasses
import threading
import time

from tuner.build.base import BuildError
from tuner.record.status import ERROR, OK, TIMEOUT
from tuner.result import TrialResult, TrialSpec

RANK_MODULE = "tuner.workload.build_rank"


def run_phase(spec: TrialSpec, env: dict[str, str], deadline: float, what: str) -> TrialResult:
    from tuner.executors.local import run_trial

    left = deadline - time.monotonic()
    if left <= 1:
        raise BuildError(f"the build ran out of time before the {what}; raise --timeout-s")
    spec = dataclasses.replace(spec, timeout_s=left)
    # run_trial supervises from a thread: Ctrl-C here sets `stop`, and run_trial then ends the
    # phase's whole process session instead of leaving compiler processes behind.
    stop, box = threading.Event(), {}

    def supervise() -> None:
        try:
            box["r"] = run_trial(spec, env=env, module=RANK_MODULE, stop=stop)
        except Exception as err:  # noqa: BLE001 - reported below as a failed phase
            box["r"] = TrialResult(status=ERROR, error_kind=type(err).__name__, error=str(err))

    worker = threading.Thread(target=supervise, daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.25)
    except KeyboardInterrupt:
        stop.set()
        worker.join()
        raise
    result = box["r"]
    if result.status != OK:
        hint = "; raise --timeout-s" if result.status == TIMEOUT else ""
        raise BuildError(f"{what} failed ({result.status}): {result.error}{hint}; log: {result.log_path}")
    return result
