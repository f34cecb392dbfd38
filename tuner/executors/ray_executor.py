"""Runs trials as Ray tasks: each task reserves its trial's devices on one node and calls the local
runner (`run_trial`) there, so a trial is still a process group of its own and the driver (the study)
stays the only writer to the Optuna storage.

Placement decisions:
- A trial of `hardware.nodes` = 1 runs as one task on one node, its ranks rendezvous on 127.0.0.1. A
  trial of K > 1 nodes is one placement group of K bundles (`STRICT_SPREAD`), one task per node
  (`tuner.executors.ray_gang`); its ranks rendezvous at node 0's address. A trial no cluster state
  could place comes back at once as an error ("unschedulable", naming the cluster's size) instead
  of waiting in Ray's queue forever.
- GPUs and NPUs are kept apart by Ray itself (`num_gpus`, `resources={"NPU": n}` set the visible
  devices). Ray does not pin CPU tasks to cores, so a CPU trial leases its cores from lock files
  (`CoreLease`, one directory per host: $TUNER_CORE_LEASE_DIR or /tmp/tuner-core-leases-<uid>) and
  `run_trial` pins its ranks to them.
- A worker or node that dies mid-trial makes that trial an error result ("worker_died"); Ray's
  retries are off, so no trial is measured twice or reported twice. A frozen node's task says
  nothing, so `wait` also compares where parts run with Ray's live nodes (`_check_nodes`); a trial
  still queued that the live nodes cannot hold, or that waited past its timeout_s, fails "unschedulable".
- cancel() (and Ctrl-C, through close()) first asks each task to stop, and a task ends only after its
  trial's processes are gone; a worker still running after CANCEL_GRACE_S is force-killed, and the
  trial's launcher and ranks follow it through their parent-death signals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tuner.executors.base import Executor
from tuner.executors.ray_address import check_cluster
from tuner.executors.ray_devices import call_on_node, describe_nodes
from tuner.executors.ray_gang import (
    Part,
    Trial,
    bundle_strategy,
    combine,
    free_per_node,
    gang_slots,
    lost_parts,
    never_started,
    placement_group,
    trial_nodes,
    unplaced_bundles,
    unschedulable,
)
from tuner.executors.ray_node import (  # noqa: F401 - CoreLease is part of this module's surface
    DEVICE_RESOURCE,
    CoreLease,
    default_lease_dir,
    demand_options,
    error_result,
    run_on_node,
    trial_demand,
    world_size,
)
from tuner.executors.ray_stream import NOT_YET, await_end, read_part
from tuner.executors.ray_warm import WarmHosts
from tuner.executors.session import end_processes_in
from tuner.result import TrialResult, TrialSpec

if TYPE_CHECKING:
    from tuner.devices import DeviceInfo
    from tuner.fingerprint import Described
    from tuner.perf.priors import DevicePriors

_log = logging.getLogger(__name__)
T = TypeVar("T")

# cancel() first asks each task to stop its trial (run_trial's kill takes at most ~2 * 3 s), then
# force-kills the workers that did not finish in this time.
CANCEL_GRACE_S = 10.0
# How often `wait` compares where trials run with Ray's live nodes (`_check_nodes`); Ray itself
# takes ~15-30 s to declare a node dead.
NODE_CHECK_S = 2.0
# Ray's per-node resource view trails a task's start and end by ~0.1 s; free_slots counts a trial
# that ended less than this long ago as possibly still held in that view.
RESOURCE_LAG_S = 2.0
# How long one description of the nodes' devices (`describe`) stands: a study asks twice as it
# starts (the preflight, then the driver), a service's worker once per job, and nodes may join.
DESCRIBE_TTL_S = 60.0


# ---- the driver side ------------------------------------------------------------------------------


class RayExecutor(Executor):
    """Trials as Ray tasks on a local Ray runtime or a cluster (`address=` or RAY_ADDRESS).

    The nodes must have this package installed (the same version as the driver): a task imports
    `tuner.executors.local` there. A trial's logs stay in `spec.workdir` on the node that ran it;
    the result carries their tail, the path, and the Ray node id and IP in `result.extra`.
    """

    name = "ray"
    elsewhere = True

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
                check_cluster(address, source, joining=True)
                ray.init(address=address, **quiet)
            else:
                # "local", not None: Ray would otherwise join whatever `ray start` last ran on this
                # host. RAY_ADDRESS=auto asks for that cluster explicitly.
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet)
            self._owns_runtime = True
        self._env = env
        self._lease_dir = lease_dir or default_lease_dir()
        # max_retries=0: a rerun after a worker died would measure the trial twice and report once.
        self._task = ray.remote(max_retries=0, retry_exceptions=False, num_returns="streaming")(run_on_node)
        self._running: dict[str, Trial] = {}
        self._checked = 0.0  # when `_check_nodes` last looked
        self._finished: list[TrialResult] = []
        self._lock = threading.RLock()  # `wait` and `cancel` (the service cancels from its heartbeat)
        self._ended: list[tuple[str, str, int, float]] = []  # (node, resource, amount, when)
        # Each node's warm helper, by node id, for the trial tasks (`tuner.executors.ray_warm`).
        self._warm = WarmHosts(env)
        self._described: dict[str, tuple[float, Any]] = {}  # by hardware.device: (when, Described)
        self._priors: dict[tuple[str, str], Any] = {}  # by (family, device name): the nodes' priors

    # -- the nodes' devices ----------------------------------------------------------------------

    def describe(self, requested: str) -> Described:
        """The cluster's devices of the recipe's `hardware.device`, as the nodes that have them
        describe themselves (`tuner.executors.ray_devices`), not as the driver's machine would."""
        hit = self._described.get(requested)
        if hit is not None and time.monotonic() - hit[0] < DESCRIBE_TTL_S:
            return hit[1]
        described, priors = describe_nodes(requested, self._node_resources()[0])
        self._priors[(described.family, described.device.name)] = priors
        self._described[requested] = (time.monotonic(), described)
        return described

    def device_priors(self, device: DeviceInfo) -> DevicePriors | None:
        """The priors the nodes measured for themselves (`describe`), not the driver's machine's."""
        return self._priors.get((device.family, device.name))

    def call_on_devices(self, fn: Callable[..., T], args: tuple, family: str, count: int) -> T:
        """`fn(*args)` as a task on a node, holding `count` of its `family` devices meanwhile."""
        reason = unschedulable(self._node_resources()[0], DEVICE_RESOURCE[family], count, 1)
        if reason:  # Ray would queue it forever
            raise RuntimeError(f"no live Ray node can run this call: {reason}")
        return call_on_node(fn, args, demand_options(DEVICE_RESOURCE[family], count))

    # -- capacity --------------------------------------------------------------------------------

    def _node_resources(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        # Developer API (Ray's own TPU helpers use it): the only per-node view of what is free.
        from ray._private.state import available_resources_per_node, total_resources_per_node

        return total_resources_per_node(), available_resources_per_node()

    def _unschedulable(self, spec: TrialSpec) -> str | None:
        resource, amount = trial_demand(spec)
        nnodes = trial_nodes(spec)
        totals, _ = self._node_resources()
        return unschedulable(totals, resource, amount // nnodes, nnodes)

    def _free_per_node(self, resource: str) -> tuple[dict[str, float], float]:
        """What each node has free for us now, and what our queued tasks still ask for."""
        totals, avail = self._node_resources()
        recent = time.monotonic() - RESOURCE_LAG_S
        self._ended = [(node, r, a, t) for node, r, a, t in self._ended if t > recent]
        placed = [p for t in self._running.values() for p in t.placed()]
        pending = float(sum(t.pending() for t in self._running.values() if t.resource == resource))
        ended = [(node, r, a) for node, r, a, _ in self._ended]
        return free_per_node(totals, avail, resource, placed, ended, pending), pending

    def _slots_now(self, resource: str, amount: int, nnodes: int = 1) -> int:
        free, pending = self._free_per_node(resource)
        per_node = amount // nnodes
        if nnodes == 1:
            slots = sum(int(f // amount) for f in free.values())
        else:  # a whole placement group or nothing: each part on a node of its own
            slots = gang_slots(list(free.values()), per_node, nnodes)
        # Each queued task of ours takes a slot somewhere.
        return max(0, slots - math.ceil(pending / amount))

    def free_slots(self, spec: TrialSpec) -> int:
        if self._unschedulable(spec):
            return 1  # submit answers at once with an "unschedulable" result; never a silent 0
        with self._lock:
            return self._slots_now(*trial_demand(spec), trial_nodes(spec))

    # -- trials ----------------------------------------------------------------------------------

    def submit(self, spec: TrialSpec) -> None:
        if spec.tag in self._running:
            raise ValueError(f"tag: trial {spec.tag!r} is already running; give each trial its own tag")
        spec = dataclasses.replace(spec, workdir=os.path.abspath(spec.workdir))
        reason = self._unschedulable(spec)
        if reason:
            self._finished.append(error_result(spec, "unschedulable", reason))
            return
        resource, amount = trial_demand(spec)
        if self.free_slots(spec) < 1:
            raise RuntimeError(f"no free {resource} slot for trial {spec.tag!r}; ask free_slots() first")
        nnodes = trial_nodes(spec)
        trial = Trial(spec, resource, amount // nnodes, nnodes, time.monotonic())
        if nnodes > 1:
            # Reserved all at once or not at all: no trial waits half placed while others starve.
            trial.group = placement_group(resource, trial.per_node, nnodes)
        self._running[spec.tag] = trial
        self._launch(trial, 0 if nnodes > 1 else None)

    def _launch(self, trial: Trial, node_rank: int | None, master: dict[str, Any] | None = None) -> None:
        """Start one part of `trial`: the whole trial, or the task of one of its nodes."""
        options = demand_options(trial.resource, trial.per_node)
        part = None
        if node_rank is not None:
            options["scheduling_strategy"] = bundle_strategy(trial.group, node_rank)
            part = {"node_rank": node_rank, "nnodes": trial.nnodes, **(master or {})}
        gen = self._task.options(**options).remote(
            trial.spec.to_dict(), self._env, self._lease_dir, part, self._warm.names
        )
        trial.parts.append(Part(gen, node_rank))

    def _advance(self, trial: Trial, part: Part) -> TrialResult | None:
        """Read the next item a part's task produced; the trial's TrialResult once it is over."""
        item = read_part(trial, part)
        if item is NOT_YET:
            return None
        if item is None:
            if part.node_rank == 0 and len(trial.parts) == 1:  # node 0 told the rendezvous address
                master = {k: part.where[k] for k in ("master_addr", "master_port")}
                for rank in range(1, trial.nnodes):
                    self._launch(trial, rank, master)
            return None
        part.result = item
        if part.where:
            # Ray's resource view may count the trial a moment longer (see _free_per_node).
            self._ended.append((part.where["ray_node_id"], trial.resource, trial.per_node, time.monotonic()))
        return self._settle(trial)

    def _settle(self, trial: Trial) -> TrialResult | None:
        """The trial's result once every part has one; a failed part first stops the others."""
        if trial.failed() is not None and not trial.done():
            self._stop_parts(trial)  # one node failed: the others' ranks would wait on it
        if not trial.done():
            return None
        if trial.group is not None:
            from ray.util import remove_placement_group

            for p in trial.parts:  # let each task return first: removing the group kills its workers
                await_end(p.gen)
            remove_placement_group(trial.group)
        result = combine(trial)
        # What a caller waits for, including Ray's scheduling and worker start (executor overhead).
        result.wall_s = time.monotonic() - trial.submitted
        return result

    def _stop_parts(self, trial: Trial) -> None:
        """End every part still running (gracefully, then by force) and collect their results."""
        import ray

        left = [(trial, p) for p in trial.parts if p.result is None]
        for _, p in left:
            ray.cancel(p.gen, force=False)
        left = self._drain(left, CANCEL_GRACE_S)
        for _, p in left:
            ray.cancel(p.gen, force=True)
        for _, p in self._drain(left, CANCEL_GRACE_S):
            p.result = error_result(trial.spec, "cancelled", "the node's task did not stop", p.where)
        # Nodes that were never launched (node 0 failed before reporting its address).
        for rank in range(len(trial.parts), trial.nnodes):
            trial.parts.append(Part(None, rank, result=error_result(trial.spec, "cancelled", "not started")))

    def wait(self, timeout: float | None = None) -> list[TrialResult]:
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[TrialResult] = []
        while True:
            # A second at a time under the lock: a cancel from another thread (the service's
            # heartbeat) waits at most that long, and never clears what this loop is reading.
            with self._lock:
                out, self._finished = out + self._finished, []
                remaining = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if out or not self._running or remaining <= 0:
                    return out
                live = [(t, p) for t in self._running.values() for p in t.parts if p.result is None]
                by_gen = {id(p.gen): (t, p) for t, p in live}
                ready, _ = ray.wait([p.gen for _, p in by_gen.values()], num_returns=1, timeout=remaining)
                for gen in ready:
                    trial, part = by_gen[id(gen)]
                    result = self._advance(trial, part)
                    if result is not None:
                        del self._running[trial.spec.tag]
                        out.append(result)
                out += self._check_nodes()

    def _check_nodes(self) -> list[TrialResult]:
        """End the trials the cluster can no longer run, each NODE_CHECK_S: a part on a node Ray no
        longer counts as alive (a frozen node's stream stays silent), and a trial never started that
        the live nodes cannot hold or that waited too long (`ray_gang.never_started`)."""
        import ray

        now = time.monotonic()
        if not self._running or now - self._checked < NODE_CHECK_S:
            return []
        self._checked = now
        totals, out = self._node_resources()[0], []
        for trial in list(self._running.values()):
            gens = [p.gen for p in trial.parts if p.result is None and p.gen is not None]
            if gens and ray.wait(gens, num_returns=len(gens), timeout=0)[0]:
                continue  # something to read first (a start, a result, Ray's own error): next pass
            reason = never_started(trial, totals, now)
            if reason:
                result = self._drop(trial, reason)
            else:
                lost = lost_parts(trial, totals, unplaced_bundles(trial))
                result = self._settle(trial) if lost else None
            if result is not None:
                del self._running[trial.spec.tag]
                out.append(result)
        return out

    def _drop(self, trial: Trial, reason: str) -> TrialResult:
        """End a trial Ray never started: cancel its queued tasks and free its placement group."""
        import ray
        from ray.util import remove_placement_group

        for p in trial.parts:
            with contextlib.suppress(Exception):  # an unplaced task may be gone already
                ray.cancel(p.gen, force=False)
        if trial.group is not None:
            remove_placement_group(trial.group)
        result = error_result(trial.spec, "unschedulable", reason)
        result.wall_s = time.monotonic() - trial.submitted
        return result

    def running(self) -> list[str]:
        return list(self._running)

    def where(self, tag: str) -> dict[str, Any] | None:
        """Node id, node IP and worker pid of a running trial (node 0's part of a multi-node one);
        None while it is queued."""
        trial = self._running.get(tag)
        return trial.parts[0].where if trial and trial.parts else None

    def placement(self, tag: str) -> list[dict[str, Any] | None]:
        """Where each node's part of a running trial runs (node id, IP, worker pid), by node rank."""
        trial = self._running.get(tag)
        return [p.where for p in sorted(trial.parts, key=lambda p: p.node_rank or 0)] if trial else []

    def cancel(self) -> None:
        """Stop every running trial; safe from another thread than the one in `wait`."""
        with self._lock:
            self._cancel()

    def _cancel(self) -> None:
        import ray

        trials = list(self._running.values())
        self._running.clear()
        self._finished.clear()
        # Graceful first: the task stops its trial and returns only once the ranks are gone. A forced
        # cancel kills the worker at once and the ranks would die later (their parent-death signal).
        parts = [(t, p) for t in trials for p in t.parts if p.result is None]
        for _, p in parts:
            ray.cancel(p.gen, force=False)
        left = self._drain(parts, CANCEL_GRACE_S)
        for _, p in left:
            ray.cancel(p.gen, force=True)
        self._drain(left, CANCEL_GRACE_S)
        for t in trials:
            # What ran on this machine is gone when cancel returns. The task's own stop should see
            # to it, but in two full test runs on a 2-core Zen 5 one process of the cancelled trial
            # was still alive when the driver heard "cancelled" (never in a test run alone); other
            # nodes' ranks die with their launcher (its parent-death watch). A trial Ray never
            # started ran nothing: a session file in its folder is an earlier run's (a reused
            # --workdir), whose number may lead somebody else's session now.
            killed = end_processes_in(t.spec.workdir, CANCEL_GRACE_S) if any(p.where for p in t.parts) else []
            if killed:
                _log.warning("killed %d process(es) of cancelled trial %r", len(killed), t.spec.tag)
            if t.group is not None:
                from ray.util import remove_placement_group

                remove_placement_group(t.group)

    def _drain(self, parts: list[tuple[Trial, Part]], timeout: float) -> list[tuple[Trial, Part]]:
        """Consume the tasks' outputs until each has ended; return those still going after `timeout`."""
        import ray

        deadline = time.monotonic() + timeout
        left = list(parts)
        while left and time.monotonic() < deadline:
            ready, _ = ray.wait([p.gen for _, p in left], num_returns=1, timeout=deadline - time.monotonic())
            for gen in ready:
                trial, part = next((t, p) for t, p in left if p.gen is gen)
                item = read_part(trial, part)
                if item is NOT_YET:
                    time.sleep(0.05)  # ready by ray.wait, yet the stream's end is still to come
                elif item is not None:
                    part.result = item
                    left.remove((trial, part))
                    if part.where:
                        self._ended.append(
                            (part.where["ray_node_id"], trial.resource, trial.per_node, time.monotonic())
                        )
        return left

    def close(self) -> None:
        import ray

        self.cancel()
        self._warm.close()
        if self._owns_runtime and ray.is_initialized():
            ray.shutdown()
            self._owns_runtime = False
