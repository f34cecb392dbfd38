"""Ray's side of the warm start (`tuner.executors.warm`): the helper belongs to the node, not to
a Ray worker. The executor starts one `WarmHost` actor per node when it starts; each keeps the
node's helper, listening at `warm.node_socket_path(name)`, and every trial task on that node,
whichever worker Ray gives it, forks its launcher from there (`run_trial(helper_socket=...)`). So
a trial does not wait for torch's import, not even the study's first, nor the first trial of a
worker Ray started later. A node that joins the cluster afterwards has no host: its trial tasks
use their worker's own helper, as a local executor does."""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import Any

from tuner.executors.warm import WarmHelper, enabled, node_socket_path

# How long closing waits for the hosts to end their helpers before it kills them.
CLOSE_GRACE_S = 10.0


class WarmHost:
    """A Ray actor, one per node and executor: keeps the node's helper, listening at
    `node_socket_path(name)`, and starts it again within a second if it dies. The helper, and every
    trial session it started, end with the host."""

    def __init__(self, name: str, env: dict[str, str] | None):
        from tuner.executors.local import trial_env

        self._env = trial_env(env)
        self._path = node_socket_path(name)
        self._lock = threading.Lock()
        self._helper = WarmHelper(self._env, self._path)
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="warm-host", daemon=True).start()

    def _watch(self) -> None:
        while not self._closed.wait(1.0):
            with self._lock:
                if not self._closed.is_set() and not self._helper.alive():
                    self._helper.close()
                    self._helper = WarmHelper(self._env, self._path)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._helper.close()


class WarmHosts:
    """The driver's handle on one `WarmHost` per node alive now. They are started without waiting
    for them (no CPU reserved: a host only waits), so each node's helper imports torch while the
    study prepares its first trial."""

    def __init__(self, env: dict[str, str] | None):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from tuner.executors.local import trial_env

        self.names: dict[str, str] = {}  # each node's helper name, by node id, for the trial tasks
        self._hosts: list[Any] = []
        if not enabled(trial_env(env)):
            return
        actor = ray.remote(num_cpus=0, max_restarts=0)(WarmHost)
        key = uuid.uuid4().hex[:8]
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            node_id = node["NodeID"]
            self.names[node_id] = f"{key}-{node_id[:12]}"
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            self._hosts.append(actor.options(scheduling_strategy=strategy).remote(self.names[node_id], env))

    def close(self) -> None:
        """Each node's helper ends its sessions and exits; a host that does not answer in time is
        killed, and its helper follows it (its stdin closes)."""
        import ray

        hosts, self._hosts, self.names = self._hosts, [], {}
        if not hosts or not ray.is_initialized():
            return
        with contextlib.suppress(Exception):
            ray.wait([h.close.remote() for h in hosts], num_returns=len(hosts), timeout=CLOSE_GRACE_S)
        for h in hosts:
            with contextlib.suppress(Exception):
                ray.kill(h)
