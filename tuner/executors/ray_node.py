"""What runs on a Ray node for a trial: the task (`run_on_node`) that leases the trial's cores on
this host (`CoreLease`), runs this node's ranks through the local runner and streams where it runs,
then the result. The driver side is `tuner.executors.ray_executor`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuner.executors.nodes import free_port, interface_of
from tuner.executors.session import SESSION_FILE
from tuner.executors.warm import node_socket_path
from tuner.record.status import ERROR
from tuner.result import TrialResult, TrialSpec

DEVICE_RESOURCE = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}


def default_lease_dir() -> str:
    return os.environ.get("TUNER_CORE_LEASE_DIR") or os.path.join(
        tempfile.gettempdir(), f"tuner-core-leases-{os.getuid()}"
    )


def world_size(spec: TrialSpec) -> int:
    c = spec.config
    return int(c.get("dp", 1)) * int(c.get("tp", 1)) * int(c.get("pp", 1))


def trial_demand(spec: TrialSpec) -> tuple[str, int]:
    """(Ray resource name, amount) a trial reserves: one device, or on CPU one core, per rank."""
    resource = DEVICE_RESOURCE.get(spec.family)
    if resource is None:
        raise ValueError(f"family: unknown device family {spec.family!r}; use cpu, cuda or npu")
    return resource, world_size(spec)


def demand_options(resource: str, amount: int) -> dict[str, Any]:
    """Ray task options that reserve `amount` of a device resource (`DEVICE_RESOURCE`'s values)."""
    if resource == "CPU":
        return {"num_cpus": amount}
    if resource == "GPU":
        # The device is what a trial must own; its host threads are not worth blocking GPUs for.
        return {"num_cpus": 0, "num_gpus": amount}
    return {"num_cpus": 0, "resources": {resource: amount}}


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


def _node_part(spec: TrialSpec, part: dict[str, Any] | None, ip: str, where: dict[str, Any]):
    """This node's share of a multi-node trial (None for a single-node one); notes it in `where`."""
    from tuner.executors.nodes import NodePart

    if part is None:
        return None
    rank = int(part["node_rank"])
    # Free on every interface, not just `ip`: rank 0's store binds them all, and a port taken on
    # another address (a container's, loopback's) failed the trial when it started.
    addr, port = (ip, free_port("")) if rank == 0 else (part["master_addr"], int(part["master_port"]))
    where.update(node_rank=rank, master_addr=addr, master_port=port)
    if rank:  # nodes may share a filesystem (one host here): each keeps its own trial directory
        spec.workdir = str(Path(spec.workdir) / f"node{rank}")
    return NodePart(rank, int(part["nnodes"]), addr, port)


GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def _gloo_on_node_ip(env: dict[str, str] | None, ip: str) -> dict[str, str] | None:
    """The environment of a multi-node trial's ranks, with gloo bound to the interface of this
    node's Ray address, which the other nodes reach. Left to itself gloo binds the address this
    host's name resolves to, on many hosts a loopback one (Debian's /etc/hosts: 127.0.1.1) that no
    other node reaches: each rank told its peers that address, and they waited for it until the
    trial's timeout. A GLOO_SOCKET_IFNAME of the user's stands."""
    if GLOO_IFNAME in (env or {}) or GLOO_IFNAME in os.environ:
        return env
    name = interface_of(ip)
    return {**(env or {}), GLOO_IFNAME: name} if name else env


def run_on_node(
    spec_dict: dict[str, Any],
    env: dict[str, str] | None,
    lease_dir: str,
    part: dict[str, Any] | None = None,
    helpers: dict[str, str] | None = None,
):
    """The Ray task (a generator): yields where it runs as soon as it starts, then the result dict.

    `part` makes it one node's share of a multi-node trial: {"node_rank", "nnodes"} and, for nodes
    other than 0, the "master_addr" and "master_port" node 0 reported. Node 0 picks the port on its
    own address and reports it in its first yield. `helpers`: the name of each node's warm helper
    (`tuner.executors.ray_warm`), by Ray node id; a node without one uses this worker's own helper.
    """
    import ray

    from tuner.executors.local import run_trial

    spec = TrialSpec.from_dict(spec_dict)
    where = _where(ray)
    node = _node_part(spec, part, ip=where["ray_node_ip"], where=where)
    if node is not None:
        env = _gloo_on_node_ip(env, where["ray_node_ip"])
    # Before the driver hears of the start, which lets its cancel end what the folder's session file
    # names: until this launch writes its own, the file is an earlier run's (a reused --workdir).
    (Path(spec.workdir) / SESSION_FILE).unlink(missing_ok=True)
    yield where  # tells the driver the trial left Ray's queue (see RayExecutor.free_slots)
    local_ranks = world_size(spec) if node is None else node.local_world(world_size(spec))
    helper_name = (helpers or {}).get(where["ray_node_id"])
    helper_socket = node_socket_path(helper_name) if helper_name else None
    lease = None
    if spec.family == "cpu":
        lease = CoreLease.take(local_ranks, lease_dir, spec.timeout_s)
        if lease is None:
            yield error_result(
                spec,
                "no_free_cores",
                f"no {local_ranks} free cores on {socket.gethostname()} within {spec.timeout_s:g}s; "
                f"other trials hold them (lock files in {lease_dir})",
                where,
            ).to_dict()
            return
    try:
        result = _run_interruptible(
            spec,
            where,
            lambda stop: run_trial(
                spec,
                env=env,
                cpus=lease.cores if lease else None,
                stop=stop,
                node=node,
                helper_socket=helper_socket,
            ),
        )
    finally:
        if lease is not None:
            lease.release()
    result.extra.update(where, cores=lease.cores if lease else None, node_wall_s=result.wall_s)
    yield result.to_dict()


def _where(ray) -> dict[str, Any]:
    """Where this task runs, as the driver records it on the trial."""
    ctx = ray.get_runtime_context()
    return {
        "ray_node_id": ctx.get_node_id(),
        "ray_node_ip": ray.util.get_node_ip_address(),
        "worker_pid": os.getpid(),
        # The GPUs/NPUs Ray gave this task (it also set CUDA_VISIBLE_DEVICES etc., which the ranks inherit).
        "accelerator_ids": {kind: ids for kind, ids in ctx.get_accelerator_ids().items() if ids},
    }


def _run_interruptible(
    spec: TrialSpec, where: dict[str, Any], run: Callable[[threading.Event], TrialResult]
) -> TrialResult:
    """`run(stop)` in a thread, so that ray.cancel's KeyboardInterrupt lands here, in the main
    thread, which then sets `stop` and waits until the trial's processes are gone. (Waiting on an
    Event, not Thread.join: an interrupted join marks a live thread as finished, bpo-45274.)"""
    stop, done = threading.Event(), threading.Event()
    box: dict[str, TrialResult] = {}

    def target() -> None:
        try:
            box["result"] = run(stop)
        except Exception as err:  # noqa: BLE001 - a runner bug must still come back as a result
            box["result"] = error_result(spec, type(err).__name__, f"trial runner failed: {err}", where)
        finally:
            done.set()

    threading.Thread(target=target, name=f"trial-{spec.tag}", daemon=True).start()
    try:
        while not done.wait(0.2):
            pass
    except BaseException:
        stop.set()
        _wait_despite_interrupts(done)
        raise
    return box["result"]


def _wait_despite_interrupts(done: threading.Event) -> None:
    """Wait for `done` even if Ray raises its cancel exception here again: the task must not end
    (and the driver must not hear "cancelled") before the trial's processes are gone."""
    while not done.is_set():
        with contextlib.suppress(BaseException):  # a repeated cancel; keep waiting
            done.wait()


def error_result(
    spec: TrialSpec, kind: str, message: str, where: dict[str, Any] | None = None
) -> TrialResult:
    return TrialResult(status=ERROR, error_kind=kind, error=message, tag=spec.tag, extra=dict(where or {}))
