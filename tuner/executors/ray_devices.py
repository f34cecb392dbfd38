"""A Ray cluster's devices as its nodes describe them, for a study that runs its trials there
(`RayExecutor.describe`): the driver may be a head node without the device, and each node counts
what Ray lets trials use on it. The node side (`describe_node`) runs as a task on every node that
has the device's Ray resource; the driver side (`describe_nodes`) asks them and checks they agree.
`call_on_node` runs other work where the devices are (a winner's build)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from tuner.executors.ray_node import DEVICE_RESOURCE

if TYPE_CHECKING:
    from tuner.fingerprint import Described
    from tuner.perf.priors import DevicePriors

# A node describes its devices in a fresh Ray worker that imports torch: seconds, not minutes.
DESCRIBE_TIMEOUT_S = 180.0


def describe_node(family: str, ray_count: int):
    """This node's devices of `family` as a study sees them: (DeviceInfo, fingerprint, performance
    priors), with the device count capped at what Ray lets trials use here (`ray_count`: its
    `--num-cpus`/`--num-gpus`). Run as a task of no resources in a worker that exits after it
    (`max_calls=1`), so the CUDA or NPU context this opens is gone with it. Ray leaves a task that
    asks for no GPU the worker's own device visibility, so the count is the node's."""
    from tuner.devices import describe
    from tuner.fingerprint import fingerprint
    from tuner.perf.priors import device_priors

    info = describe(family)
    info = dataclasses.replace(info, count=min(info.count, ray_count))
    return info, fingerprint(family, info), device_priors(info)


def describe_nodes(requested: str, totals: dict[str, dict[str, float]]) -> tuple[Described, DevicePriors]:
    """(What the recipe's `hardware.device` means on the cluster whose nodes have `totals`, the
    priors the nodes measured). Every node with the device describes itself; nodes that differ in
    model or software (their fingerprints apart from the count) are refused, since a study is keyed
    by one kind of machine. The device count is the largest node's. A ValueError names the field."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tuner.devices import FAMILIES, resolve_family

    having = {
        family: {node: int(r[res]) for node, r in totals.items() if r.get(res, 0) >= 1}
        for family, res in DEVICE_RESOURCE.items()
    }
    family = resolve_family(requested, [f for f in FAMILIES if having[f]], "any node of the Ray cluster")
    task = ray.remote(num_cpus=0, max_calls=1, max_retries=0)(describe_node)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            family, count
        )
        for node, count in having[family].items()
    ]
    try:
        answers = ray.get(refs, timeout=DESCRIBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise ValueError(
            f"hardware.device: the Ray cluster's {family} nodes did not describe their devices within "
            f"{DESCRIBE_TIMEOUT_S:g} s; check that every node runs and has this package installed"
        ) from None
    except ray.exceptions.RayError as err:
        cause = getattr(err, "cause", None) or err
        raise ValueError(
            f"hardware.device: a Ray node could not describe its {family} devices: {cause}"
        ) from None
    return _one_kind(family, answers)


def _one_kind(family: str, answers: list[tuple[Any, dict[str, Any], Any]]) -> tuple[Described, DevicePriors]:
    """The nodes' answers as one description, if they describe one kind of machine."""
    from tuner.fingerprint import Described

    kinds: dict[str, list[Any]] = {}
    for info, fp, priors in answers:
        kind = json.dumps({k: v for k, v in fp.items() if k != "device_count"}, sort_keys=True)
        kinds.setdefault(kind, []).append((info, fp, priors))
    if len(kinds) > 1:
        seen = "; ".join(
            f"{len(group)} x {group[0][0].name} (torch {group[0][1].get('torch')}, host CPU "
            f"{group[0][1].get('cpu')})"
            for group in kinds.values()
        )
        raise ValueError(
            f"hardware.device: the Ray cluster's {family} nodes are not alike ({seen}); a study is "
            "keyed by one kind of machine: tune from a cluster of like nodes"
        )
    [group] = kinds.values()
    info, fp, priors = max(group, key=lambda answer: answer[0].count)
    alike = len({answer[0].count for answer in group}) == 1
    where = "each Ray node" if alike else f"the Ray cluster's largest {family} node"
    return Described(family, dataclasses.replace(info, where=where), fp), priors


# How long a call on a node's devices may wait for them to be free, besides its own run.
CALL_QUEUE_S = 600.0


def _started_then(fn, args: tuple):
    """The task of `call_on_node`: first word that it started (so it holds its devices), then `fn(*args)`."""
    yield None
    yield fn(*args)


def call_on_node(fn, args: tuple, options: dict[str, Any], timeout_s: float | None = None):
    """`fn(*args)` as a Ray task with `options` (what it reserves), its return value, or the
    exception it raised. A TimeoutError if no node started it within CALL_QUEUE_S (the task is
    cancelled), or if it then ran past `timeout_s`. Ctrl-C cancels the task (Ray raises
    KeyboardInterrupt in it, so whatever supervises processes there stops them) and is raised again here."""
    import ray

    # max_calls=1: the worker exits after the call, with whatever device context it opened.
    task = ray.remote(max_retries=0, retry_exceptions=False, max_calls=1, num_returns="streaming")
    gen = task(_started_then).options(**options).remote(fn, args)
    wanted = ", ".join(f"{k}={v}" for k, v in options.items())
    try:
        for bound, late in (
            (CALL_QUEUE_S, f"no Ray node started it within {CALL_QUEUE_S:g} s: its devices ({wanted}) stayed "
             "taken (another job may hold them, or a node left the cluster)"),
            (timeout_s, f"it ran past its {timeout_s} s on the node"),
        ):  # fmt: skip
            ref = gen._next_sync(timeout_s=bound)  # next(gen), bounded
            if ref.is_nil():
                ray.cancel(gen, force=True)
                raise TimeoutError(f"a call on a Ray node's devices failed: {late}")
            value = ray.get(ref)
        return value
    except KeyboardInterrupt:
        ray.cancel(gen)
        raise
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        raise cause if isinstance(cause, Exception) else RuntimeError(str(err)) from None
