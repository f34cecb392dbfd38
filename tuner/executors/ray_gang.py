"""A trial that spans nodes, on the driver side: one Ray placement group with a bundle per node
(`STRICT_SPREAD`, so each bundle lands on its own node and Ray reserves them all or none), one task
per bundle. Node 0's task starts first and reports the rendezvous address (its node's IP and a
free port); the other nodes' tasks start with it. Their results become one: node 0's measurement,
or the first real failure of any node. A trial the cluster can no longer run (a node it runs on
died, or it was never placed) is judged here too (`lost_parts`, `never_started`)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from tuner.executors.outcome import is_consequence
from tuner.executors.ray_node import error_result
from tuner.record.status import OK, OOM
from tuner.result import TrialResult, TrialSpec


def trial_nodes(spec: TrialSpec) -> int:
    return int(spec.recipe.get("hardware", {}).get("nodes", 1) or 1)


@dataclass
class Part:
    """One node's task of a trial (the only part of a single-node trial)."""

    gen: Any  # ray.ObjectRefGenerator
    node_rank: int | None  # None: a single-node trial
    where: dict[str, Any] | None = None  # set once the task started on a node
    result: TrialResult | None = None
    lost: bool = False  # its node died (or froze) while it ran: the cause, whatever the others say


@dataclass
class Trial:
    spec: TrialSpec
    resource: str
    per_node: int  # devices (CPU: cores) each node's part holds
    nnodes: int
    submitted: float
    parts: list[Part] = field(default_factory=list)
    group: Any = None  # the placement group of a multi-node trial

    @property
    def amount(self) -> int:
        return self.per_node * self.nnodes

    def placed(self) -> list[tuple[str, str, int]]:
        return [(p.where["ray_node_id"], self.resource, self.per_node) for p in self.parts if p.where]

    def pending(self) -> int:
        """Devices asked for whose task has not started (a gang's unlaunched parts included)."""
        started = sum(1 for p in self.parts if p.where)
        return self.per_node * (self.nnodes - started)

    def failed(self) -> Part | None:
        return next((p for p in self.parts if p.result is not None and p.result.status != OK), None)

    def done(self) -> bool:
        return len(self.parts) == self.nnodes and all(p.result is not None for p in self.parts)


def placement_group(resource: str, per_node: int, nnodes: int):
    from ray.util.placement_group import placement_group as make

    bundle = {resource: float(per_node)}
    return make([dict(bundle) for _ in range(nnodes)], strategy="STRICT_SPREAD")


def bundle_strategy(group, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index, placement_group_capture_child_tasks=True
    )


def free_per_node(
    totals: dict[str, dict[str, float]],
    avail: dict[str, dict[str, float]],
    resource: str,
    placed: list[tuple[str, str, float]],
    ended: list[tuple[str, str, float]],
    pending: float,
) -> dict[str, float]:
    """What each node has free for one driver's trials: Ray's per-node totals and availability,
    with the driver's own placed trials, trials that ended moments ago and queued demand, each
    (node, resource, amount). Ray's view trails our starts and ends by ~0.1 s, and may show a task
    of ours as started before its "started" message reached us. So other jobs hold what Ray counts
    as used beyond our placed, just-ended and queued trials; our own share we know exactly."""
    mine: dict[str, float] = {}
    for node, res, amount in placed + ended:
        if res == resource:
            mine[node] = mine.get(node, 0.0) + amount
    free = {}
    for node, total in totals.items():
        cap = total.get(resource, 0.0)
        used = cap - avail.get(node, {}).get(resource, 0.0)
        others = max(0.0, used - mine.get(node, 0.0) - pending)
        running = sum(a for n, r, a in placed if n == node and r == resource)
        free[node] = max(0.0, cap - others - running)
    return free


def gang_slots(free_per_node: list[float], per_node: int, nnodes: int) -> int:
    """How many more trials of `nnodes` parts of `per_node` devices fit, each part on its own node."""
    bundles = sorted((int(f // per_node) for f in free_per_node), reverse=True)
    slots = 0
    while len([b for b in bundles if b > 0]) >= nnodes:
        for i in range(nnodes):
            bundles[i] -= 1
        bundles.sort(reverse=True)
        slots += 1
    return slots


def unschedulable(
    totals: dict[str, dict[str, float]], resource: str, per_node: int, nnodes: int
) -> str | None:
    """Why no cluster state could ever place this trial, naming the cluster's size; None if one could."""
    sizes = sorted((int(t.get(resource, 0)) for t in totals.values()), reverse=True) or [0]
    cluster = f"the cluster has {len(sizes)} node(s), {sum(sizes)} {resource} in all"
    if nnodes == 1:
        if per_node <= sizes[0]:
            return None
        return (
            f"the trial needs {per_node} {resource} on one node but the largest node has {sizes[0]} {resource} "
            f"({cluster}); lower hardware.devices to {sizes[0]}, or spread the trial with hardware.nodes"
        )
    fitting = sum(1 for s in sizes if s >= per_node)
    if fitting >= nnodes:
        return None
    return (
        f"the trial needs {nnodes} nodes with {per_node} {resource} each (hardware.nodes={nnodes}) but "
        f"{cluster}, and only {fitting} node(s) have {per_node}; lower hardware.devices or hardware.nodes"
    )


# The least a trial may wait for its devices (`never_started`), whatever its timeout_s: a Ray
# worker's start on a loaded node takes seconds.
QUEUE_FLOOR_S = 30.0


def lost_parts(trial: Trial, live: Collection[str], unplaced: Collection[int] = ()) -> list[Part]:
    """Mark and return the parts still running on a node Ray no longer counts as alive (by id in
    `live`), and those not started whose bundle lost its node (by node rank in `unplaced`). A
    frozen or cut-off node's task stream stays silent, and a task whose bundle's node died waits
    for it forever; without this their peers ran out their timeout and the trial blamed them."""
    lost = []
    for p in trial.parts:
        if p.result is not None:
            continue
        if p.where and p.where["ray_node_id"] not in live:
            where = f"{p.where.get('ray_node_ip')} ({p.where['ray_node_id'][:12]}) while the trial ran there"
        elif not p.where and p.node_rank in unplaced:
            where = f"that held node {p.node_rank}'s devices before its task started there"
        else:
            continue
        message = f"node died: Ray lost node {where} (it crashed, froze or was cut off from the cluster)"
        p.result, p.lost = error_result(trial.spec, "worker_died", message, p.where), True
        lost.append(p)
    return lost


def unplaced_bundles(trial: Trial) -> set[int]:
    """Node ranks of a multi-node trial whose task has not started and whose bundle no longer has a
    node: Ray reschedules a placement group one of whose nodes died (state RESCHEDULING, that
    bundle's node id empty), which STRICT_SPREAD cannot do without a spare node, and the task waits
    for it. The trial lost a node either way, and ends like one whose running part did."""
    waiting = [p.node_rank for p in trial.parts if p.where is None and p.result is None]
    if trial.group is None or not waiting:
        return set()
    from ray.util import placement_group_table

    table = placement_group_table(trial.group)
    if table.get("state") != "RESCHEDULING":
        return set()
    nodes = table.get("bundles_to_node_id") or {}
    return {rank for rank in waiting if not nodes.get(rank)}


def never_started(trial: Trial, totals: dict[str, dict[str, float]], now: float) -> str | None:
    """Why a trial none of whose parts has started never will, or None: the live nodes (their
    `totals`) can no longer hold it (a node died while it was queued, and Ray keeps a placement
    group that needs it pending forever), or it has waited past its timeout_s (QUEUE_FLOOR_S at least)."""
    if any(p.where or p.result for p in trial.parts):
        return None
    reason = unschedulable(totals, trial.resource, trial.per_node, trial.nnodes)
    if reason:
        return f"the trial never got its devices: a node left the cluster while it was queued, and {reason}"
    waited, bound = now - trial.submitted, max(trial.spec.timeout_s, QUEUE_FLOOR_S)
    if waited > bound:
        return (
            f"the trial never got its devices: Ray had not started it {waited:.0f} s after it was submitted "
            f"(the bound is its timeout_s, {QUEUE_FLOOR_S:g} s at least); another job may hold them"
        )
    return None


def combine(trial: Trial) -> TrialResult:
    """One result for the whole trial: the first real failure of any node (a node that was only
    cancelled, or only lost its peers, because another failed is not the cause), else node 0's
    measurement, with where every rank ran. A part whose node died comes first: the others' failures
    (their peers vanished, or they ran out their timeout waiting) follow from it."""
    failures = [p for p in trial.parts if p.result is not None and p.result.status != OK]
    real = [p for p in failures if p.result.error_kind != "cancelled"] or failures
    # As within a node (`outcome.classify`): an out-of-memory first, then a node that failed on
    # its own before one that only lost its peers or was ended by its launcher; node order within.
    real.sort(key=lambda p: (not p.lost, p.result.status != OOM, is_consequence(p.result)))
    if real:
        cause = real[0]
        result = cause.result
        if trial.nnodes > 1 and cause.node_rank is not None:
            result.error = f"node {cause.node_rank} of {trial.nnodes}: {result.error}"
    else:
        cause = next(p for p in trial.parts if not p.node_rank)
        result = cause.result
    # Results the driver makes itself (a lost node, a dead worker) name the node too.
    result.node = result.node or (cause.where or {}).get("ray_node_ip")
    rank_nodes = []
    for p in sorted(trial.parts, key=lambda p: p.node_rank or 0):
        rank_nodes += [(p.where or {}).get("ray_node_id")] * trial.per_node
    result.rank_nodes = rank_nodes
    result.nodes = len({n for n in rank_nodes if n}) or None
    result.extra["placement"] = [
        {"node_rank": p.node_rank or 0, **{k: (p.where or {}).get(k) for k in ("ray_node_id", "ray_node_ip")}}
        for p in trial.parts
    ]
    return result
