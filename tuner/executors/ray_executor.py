"""Runs trials as Ray tasks: each task reserves its trial's devices on one node and calls the local
runner (`run_trial`) there, so a trial is still a process group of its own and the driver (the study)
stays the only writer to the Optuna storage.

Placement decisions:
- A trial never spans nodes: its ranks rendezvous on 127.0.0.1, so a trial that needs more devices
  than the largest node has comes back at once as an error ("unschedulable") instead of waiting in
  Ray's queue forever. Placement groups across nodes are not used for the same reason.
- GPUs and NPUs are kept apart by Ray itself (`num_gpus`, `resources={"NPU": n}` set the visible
  devices). Ray does not pin CPU tasks to cores, so a CPU trial leases its cores from lock files
  (`CoreLease`, one directory per host: $TUNER_CORE_LEASE_DIR or /tmp/tuner-core-leases-<uid>) and
  `run_trial` pins its ranks to them.
- A worker or node that dies mid-trial makes that trial an error result ("worker_died"); Ray's
  retries are off, so no trial is measured twice or reported twice.
- cancel() (and Ctrl-C, through close()) first asks each task to stop, and a task ends only after its
  trial's processes are gone; a worker still running after CANCEL_GRACE_S is force-killed, and the
  trial's launcher and ranks follow it through their parent-death signals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.executors.base import Executor
from tuner.record.status import ERROR, OOM
from tuner.result import TrialResult, TrialSpec

# cancel() first asks each task to stop its trial (run_trial's kill takes at most ~2 * 3 s), then
# force-kills the workers that did not finish in this time.
CANCEL_GRACE_S = 10.0
# Ray's per-node resource view trails a task's start and end by ~0.1 s; free_slots counts a trial
# that ended less than this long ago as possibly still held in that view.
RESOURCE_LAG_S = 2.0
_DEVICE_RESOURCE = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}


def default_lease_dir() -> str:
    return os.environ.get("TUNER_CORE_LEASE_DIR") or os.path.join(
        tempfile.gettempdir(), f"tuner-core-leases-{os.getuid()}"
    )


def world_size(spec: TrialSpec) -> int:
    c = spec.config
    return int(c.get("dp", 1)) * int(c.get("tp", 1)) * int(c.get("pp", 1))


def trial_demand(spec: TrialSpec) -> tuple[str, int]:
    """(Ray resource name, amount) a trial reserves: one device, or on CPU one core, per rank."""
    resource = _DEVICE_RESOURCE.get(spec.family)
    if resource is None:
        raise ValueError(f"family: unknown device family {spec.family!r}; use cpu, cuda or npu")
    return resource, world_size(spec)


# ---- what runs on the node ------------------------------------------------------------------------


class CoreLease:
    """Exclusive use of some CPU cores of this host, held as `flock`s on one file per core.

    The directory is per host, not per Ray node: two Ray nodes on one machine share its cores. The
    kernel drops the locks when the holder dies, so a killed worker never leaks its cores.
    """

    def __init__(self, cores: list[int], files: list[Any]):
        self.cores = cores
        self._files = files

    @classmethod
    def try_take(cls, count: int, lease_dir: str) -> CoreLease | None:
        Path(lease_dir).mkdir(parents=True, exist_ok=True)
        cores, files = [], []
        for core in sorted(os.sched_getaffinity(0)):
            f = open(os.path.join(lease_dir, f"core{core}.lock"), "a")  # noqa: SIM115 - held until release
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            cores.append(core)
            files.append(f)
            if len(cores) == count:
                return cls(cores, files)
        for f in files:
            f.close()
        return None

    @classmethod
    def take(cls, count: int, lease_dir: str, timeout_s: float) -> CoreLease | None:
        """Wait up to `timeout_s` for `count` free cores (another Ray node on this host may hold them)."""
        deadline = time.monotonic() + timeout_s
        while True:
            lease = cls.try_take(count, lease_dir)
            if lease is not None or time.monotonic() >= deadline:
                return lease
            time.sleep(0.2)

    def release(self) -> None:
        for f in self._files:
            f.close()
        self._files = []


def _run_on_node(spec_dict: dict[str, Any], env: dict[str, str] | None, lease_dir: str):
    """The Ray task (a generator): yields where it runs as soon as it starts, then the result dict."""
    import ray

    from tuner.executors.local import run_trial

    ctx = ray.get_runtime_context()
    where = {
        "ray_node_id": ctx.get_node_id(),
        "ray_node_ip": ray.util.get_node_ip_address(),
        "worker_pid": os.getpid(),
        # The GPUs/NPUs Ray gave this task (it also set CUDA_VISIBLE_DEVICES etc., which the ranks inherit).
        "accelerator_ids": {kind: ids for kind, ids in ctx.get_accelerator_ids().items() if ids},
    }
    yield where  # tells the driver the trial left Ray's queue (see RayExecutor.free_slots)
    spec = TrialSpec.from_dict(spec_dict)
    lease = None
    if spec.family == "cpu":
        lease = CoreLease.take(world_size(spec), lease_dir, spec.timeout_s)
        if lease is None:
            yield _error(
                spec,
                "no_free_cores",
                f"no {world_size(spec)} free cores on {socket.gethostname()} within {spec.timeout_s:g}s; "
                f"other trials hold them (lock files in {lease_dir})",
                where,
            ).to_dict()
            return
    stop, done = threading.Event(), threading.Event()
    box: dict[str, TrialResult] = {}

    def target() -> None:
        try:
            box["result"] = run_trial(spec, env=env, cpus=lease.cores if lease else None, stop=stop)
        except Exception as err:  # noqa: BLE001 - a runner bug must still come back as a result
            box["result"] = _error(spec, type(err).__name__, f"trial runner failed: {err}", where)
        finally:
            done.set()

    # The trial runs in a thread so that ray.cancel's KeyboardInterrupt lands here, in the main
    # thread, which then stops the trial and waits until its processes are gone. (Waiting on an
    # Event, not Thread.join: an interrupted join marks a live thread as finished, bpo-45274.)
    threading.Thread(target=target, name=f"trial-{spec.tag}", daemon=True).start()
    try:
        while not done.wait(0.2):
            pass
    except BaseException:
        stop.set()
        _wait_despite_interrupts(done)
        raise
    finally:
        if lease is not None:
            lease.release()
    result = box["result"]
    result.extra.update(where, cores=lease.cores if lease else None, node_wall_s=result.wall_s)
    yield result.to_dict()


def _wait_despite_interrupts(done: threading.Event) -> None:
    """Wait for `done` even if Ray raises its cancel exception here again: the task must not end
    (and the driver must not hear "cancelled") before the trial's processes are gone."""
    while not done.is_set():
        with contextlib.suppress(BaseException):  # a repeated cancel; keep waiting
            done.wait()


def _error(spec: TrialSpec, kind: str, message: str, where: dict[str, Any] | None = None) -> TrialResult:
    return TrialResult(status=ERROR, error_kind=kind, error=message, tag=spec.tag, extra=dict(where or {}))


# ---- the driver side ------------------------------------------------------------------------------


@dataclass
class _Trial:
    spec: TrialSpec
    resource: str
    amount: int
    gen: Any  # ray.ObjectRefGenerator
    submitted: float
    where: dict[str, Any] | None = None  # set once the task started on a node


class RayExecutor(Executor):
    """Trials as Ray tasks on a local Ray runtime or a cluster (`address=` or RAY_ADDRESS).

    The nodes must have this package installed (the same version as the driver): a task imports
    `tuner.executors.local` there. A trial's logs stay in `spec.workdir` on the node that ran it;
    the result carries their tail, the path, and the Ray node id and IP in `result.extra`.
    """

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        env: dict[str, str] | None = None,
        num_cpus: int | None = None,
        lease_dir: str | None = None,
    ):
        import ray

        self._owns_runtime = False
        if not ray.is_initialized():
            source = "address" if address else "RAY_ADDRESS"
            address = address or os.environ.get("RAY_ADDRESS") or None
            quiet = {"logging_level": logging.ERROR, "log_to_driver": False}
            if address:
                _check_reachable(address, source)
                ray.init(address=address, **quiet)
            else:
                # "local", not None: Ray would otherwise join whatever `ray start` last ran on this
                # host. RAY_ADDRESS=auto asks for that cluster explicitly.
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet)
            self._owns_runtime = True
        self._env = env
        self._lease_dir = lease_dir or default_lease_dir()
        # max_retries=0: a rerun after a worker died would measure the trial twice and report once.
        self._task = ray.remote(max_retries=0, retry_exceptions=False, num_returns="streaming")(_run_on_node)
        self._running: dict[str, _Trial] = {}
        self._finished: list[TrialResult] = []
        self._ended: list[tuple[str, str, int, float]] = []  # (node, resource, amount, when)

    # -- capacity --------------------------------------------------------------------------------

    def _node_resources(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        # Developer API (Ray's own TPU helpers use it): the only per-node view of what is free.
        from ray._private.state import available_resources_per_node, total_resources_per_node

        return total_resources_per_node(), available_resources_per_node()

    def _unschedulable(self, spec: TrialSpec) -> str | None:
        resource, amount = trial_demand(spec)
        totals, _ = self._node_resources()
        largest = max((int(t.get(resource, 0)) for t in totals.values()), default=0)
        if amount <= largest:
            return None
        return (
            f"the trial needs {amount} {resource} on one node (its ranks rendezvous on localhost) but the "
            f"largest node has {largest} {resource}; lower hardware.devices to {largest} or add a bigger node"
        )

    def _slots_now(self, resource: str, amount: int) -> int:
        totals, avail = self._node_resources()
        mine: dict[str, float] = {}  # ours on each node, including just-ended trials Ray may still count
        pending = 0.0
        recent = time.monotonic() - RESOURCE_LAG_S
        self._ended = [(node, r, a, t) for node, r, a, t in self._ended if t > recent]
        placed = [(t.where["ray_node_id"], t.resource, t.amount) for t in self._running.values() if t.where]
        for node, res, amt in placed + [(node, r, a) for node, r, a, _ in self._ended]:
            if res == resource:
                mine[node] = mine.get(node, 0.0) + amt
        for t in self._running.values():
            if t.resource == resource and t.where is None:
                pending += t.amount
        slots = 0
        for node, total in totals.items():
            # Ray's view trails our starts and ends by ~0.1 s, and may show a task of ours as started
            # before its "started" message reached us. So other jobs hold what Ray counts as used
            # beyond our placed, just-ended and queued trials; our own share we know exactly.
            cap = total.get(resource, 0.0)
            used = cap - avail.get(node, {}).get(resource, 0.0)
            others = max(0.0, used - mine.get(node, 0.0) - pending)
            running = sum(a for n, r, a in placed if n == node and r == resource)
            slots += int(max(0.0, cap - others - running) // amount)
        # Each queued task of ours takes a slot somewhere.
        return max(0, slots - math.ceil(pending / amount))

    def free_slots(self, spec: TrialSpec) -> int:
        if self._unschedulable(spec):
            return 1  # submit answers at once with an "unschedulable" result; never a silent 0
        return self._slots_now(*trial_demand(spec))

    # -- trials ----------------------------------------------------------------------------------

    def submit(self, spec: TrialSpec) -> None:
        if spec.tag in self._running:
            raise ValueError(f"tag: trial {spec.tag!r} is already running; give each trial its own tag")
        spec = dataclasses.replace(spec, workdir=os.path.abspath(spec.workdir))
        reason = self._unschedulable(spec)
        if reason:
            self._finished.append(_error(spec, "unschedulable", reason))
            return
        resource, amount = trial_demand(spec)
        if self.free_slots(spec) < 1:
            raise RuntimeError(f"no free {resource} slot for trial {spec.tag!r}; ask free_slots() first")
        if resource == "CPU":
            options = {"num_cpus": amount}
        elif resource == "GPU":
            # The device is what a trial must own; its host threads are not worth blocking GPUs for.
            options = {"num_cpus": 0, "num_gpus": amount}
        else:
            options = {"num_cpus": 0, "resources": {resource: amount}}
        gen = self._task.options(**options).remote(spec.to_dict(), self._env, self._lease_dir)
        self._running[spec.tag] = _Trial(spec, resource, amount, gen, time.monotonic())

    def _advance(self, trial: _Trial) -> TrialResult | None:
        """Read the next item the trial's task produced; a TrialResult once it is over."""
        result = self._read(trial)
        if result is not None and trial.where:
            # Ray's resource view may count the trial a moment longer (see _slots_now).
            self._ended.append((trial.where["ray_node_id"], trial.resource, trial.amount, time.monotonic()))
        return result

    def _read(self, trial: _Trial) -> TrialResult | None:
        import ray
        from ray.exceptions import OutOfMemoryError, RayError, RayTaskError, TaskCancelledError

        try:
            item = ray.get(next(trial.gen))
        except StopIteration:
            return _error(trial.spec, "worker_died", "the Ray task ended without a result", trial.where)
        except TaskCancelledError:
            return _error(trial.spec, "cancelled", "the Ray task was cancelled", trial.where)
        except OutOfMemoryError as err:
            result = _error(
                trial.spec, "worker_died", f"Ray killed the worker: {_first_lines(err)}", trial.where
            )
            result.status = OOM
            return result
        except RayTaskError as err:
            cause = err.cause if isinstance(err.cause, BaseException) else err
            kind = "cancelled" if isinstance(cause, TaskCancelledError) else type(cause).__name__
            hint = ""
            if isinstance(cause, ImportError):
                hint = (
                    "\nInstall this package (training-tuner, same version as the driver) on every Ray node."
                )
            return _error(
                trial.spec, kind, f"the Ray task failed: {_first_lines(err, 12)}{hint}", trial.where
            )
        except RayError as err:  # WorkerCrashedError, NodeDiedError, OwnerDiedError, ...
            return _error(
                trial.spec, "worker_died", f"{type(err).__name__}: {_first_lines(err)}", trial.where
            )
        if "status" not in item:
            trial.where = item
            return None
        result = TrialResult.from_dict(item)
        # What a caller waits for, including Ray's scheduling and worker start (executor overhead).
        result.wall_s = time.monotonic() - trial.submitted
        result.node = result.node or item.get("extra", {}).get("ray_node_ip")
        return result

    def wait(self, timeout: float | None = None) -> list[TrialResult]:
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        out, self._finished = self._finished, []
        while not out and self._running:
            remaining = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if remaining <= 0:
                break
            by_gen = {id(t.gen): t for t in self._running.values()}
            ready, _ = ray.wait([t.gen for t in self._running.values()], num_returns=1, timeout=remaining)
            for gen in ready:
                trial = by_gen[id(gen)]
                result = self._advance(trial)
                if result is not None:
                    del self._running[trial.spec.tag]
                    out.append(result)
        return out

    def running(self) -> list[str]:
        return list(self._running)

    def where(self, tag: str) -> dict[str, Any] | None:
        """Node id, node IP and worker pid of a running trial; None while it is queued."""
        trial = self._running.get(tag)
        return trial.where if trial else None

    def cancel(self) -> None:
        import ray

        trials = list(self._running.values())
        self._running.clear()
        self._finished.clear()
        # Graceful first: the task stops its trial and returns only once the ranks are gone. A forced
        # cancel kills the worker at once and the ranks would die later (their parent-death signal).
        for t in trials:
            ray.cancel(t.gen, force=False)
        left = self._drain(trials, CANCEL_GRACE_S)
        for t in left:
            ray.cancel(t.gen, force=True)
        self._drain(left, CANCEL_GRACE_S)

    def _drain(self, trials: list[_Trial], timeout: float) -> list[_Trial]:
        """Consume the tasks' outputs until each has ended; return those still going after `timeout`."""
        import ray

        deadline = time.monotonic() + timeout
        left = list(trials)
        while left and time.monotonic() < deadline:
            ready, _ = ray.wait([t.gen for t in left], num_returns=1, timeout=deadline - time.monotonic())
            for gen in ready:
                trial = next(t for t in left if t.gen is gen)
                if self._advance(trial) is not None:
                    left.remove(trial)
        return left

    def close(self) -> None:
        import ray

        self.cancel()
        if self._owns_runtime and ray.is_initialized():
            ray.shutdown()
            self._owns_runtime = False


def _check_reachable(address: str, source: str) -> None:
    """Fail fast on a cluster address nothing answers at: Ray itself retries for minutes."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return  # "auto", "ray://..." and the like: Ray resolves them
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as err:
        raise ConnectionError(
            f"{source}={address}: no Ray cluster answers there ({err.strerror or err}); start one with "
            "`ray start --head`, fix the address, or unset RAY_ADDRESS to run trials on a local Ray runtime"
        ) from None


def _first_lines(err: BaseException, lines: int = 4) -> str:
    return "\n".join(str(err).strip().splitlines()[:lines])
