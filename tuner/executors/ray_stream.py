"""Reading one part's Ray task stream on the driver side: where the task started, the trial's
result, or the Ray error it ended with, each without blocking longer than READ_TIMEOUT_S."""

from __future__ import annotations

import contextlib
from typing import Any

from tuner.executors.ray_gang import Part, Trial
from tuner.executors.ray_node import error_result
from tuner.record.status import OOM
from tuner.result import TrialResult

# How long one read of a part's stream may block. `next()` on Ray's ObjectRefGenerator has no
# bound: at the end of a stream it waits for the task's return, which never came for a cancelled
# part whose peer node was killed, and the driver hung until the trial's own timeout (300 s in
# the node-kill test) with the force-cancel never reached.
READ_TIMEOUT_S = 0.5
NOT_YET = object()  # `read_part`: nothing to read yet


def read_part(trial: Trial, part: Part) -> Any:
    """The part's next item: None for where it runs (kept in `part.where`), its result, or
    `NOT_YET` when the stream has nothing within READ_TIMEOUT_S."""
    import ray
    from ray.exceptions import OutOfMemoryError, RayError, RayTaskError, TaskCancelledError

    try:
        ref = part.gen._next_sync(timeout_s=READ_TIMEOUT_S)  # next(gen), bounded (Ray 2.60)
        if ref.is_nil():
            return NOT_YET
        item = ray.get(ref)
    except StopIteration:
        return error_result(trial.spec, "worker_died", "the Ray task ended without a result", part.where)
    except TaskCancelledError:
        return error_result(trial.spec, "cancelled", "the Ray task was cancelled", part.where)
    except OutOfMemoryError as err:
        result = error_result(
            trial.spec, "worker_died", f"Ray killed the worker: {first_lines(err)}", part.where
        )
        result.status = OOM
        return result
    except RayTaskError as err:
        cause = err.cause if isinstance(err.cause, BaseException) else err
        kind = "cancelled" if isinstance(cause, TaskCancelledError) else type(cause).__name__
        hint = ""
        if isinstance(cause, ImportError):
            hint = "\nInstall this package (training-tuner, same version as the driver) on every Ray node."
        return error_result(
            trial.spec, kind, f"the Ray task failed: {first_lines(err, 12)}{hint}", part.where
        )
    except RayError as err:  # WorkerCrashedError, NodeDiedError, OwnerDiedError, ...
        return error_result(
            trial.spec, "worker_died", f"{type(err).__name__}: {first_lines(err)}", part.where
        )
    if "status" not in item:
        part.where = item
        return None
    result = TrialResult.from_dict(item)
    result.node = result.node or item.get("extra", {}).get("ray_node_ip")
    return result


def await_end(gen, timeout_s: float = 2.0) -> None:
    """Wait (briefly) for a task that already sent its result to return."""
    import ray

    if gen is None:
        return
    with contextlib.suppress(Exception):  # StopIteration when it has returned; anything else: gone
        ready, _ = ray.wait([gen], timeout=timeout_s)
        if ready:
            gen._next_sync(timeout_s=timeout_s)  # next(gen), bounded: see READ_TIMEOUT_S


def first_lines(err: BaseException, lines: int = 4) -> str:
    return "\n".join(str(err).strip().splitlines()[:lines])
