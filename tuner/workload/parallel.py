"""Where a rank sits: the parallel degrees and device mesh (`ParallelDims`), the process group,
and the CPU cores this rank may use."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def _mesh_hash(self: DeviceMesh) -> int:
    """`DeviceMesh.__hash__` from its content alone (torch's own `_stable_hash`, the digest of the
    same key its hash uses), the same in every process."""
    if not getattr(self, "_hash", None):
        self._hash = int(self._stable_hash()[:16], 16) - (1 << 63) or 1
    return self._hash


# A device mesh caches its Python hash in `_hash`, which Inductor's FX graph cache pickles into
# the key of every graph with DTensor inputs: a hash of strings (randomized per interpreter) and,
# on Python 3.11, of None (its address). So a tensor-parallel compiled graph never matched
# another process's cache entry: every study, and every new warm helper, compiled its tp graphs
# again (gpt-tiny tp=2: 4 s more warm-up in that first trial on a 2-core Zen 2; BENCHMARKS
# section 8). From content alone, equal meshes still hash equal, in every process. A torch
# without `_stable_hash` keeps its own hash.
if hasattr(DeviceMesh, "_stable_hash"):
    DeviceMesh.__hash__ = _mesh_hash  # type: ignore[method-assign]


@dataclass
class ParallelDims:
    """The one owner of dp/tp/pp (torchtitan style); nothing else re-derives them.

    Ranks are laid out pp-major, tp-minor (mesh dims ("pp", "dp", "tp")) so tensor-parallel
    peers, which talk every layer, are neighbours on a node.
    """

    dp: int
    tp: int
    pp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(
                f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.dp * self.tp * self.pp} but the "
                f"trial has {self.world_size} ranks; choose degrees whose product is the rank count"
            )

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        if self._mesh is None:
            self._mesh = init_device_mesh(
                device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp")
            )
        return self._mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index on each axis (the same layout as the mesh)."""
        return {
            "pp": rank // (self.dp * self.tp),
            "dp": (rank // self.tp) % self.dp,
            "tp": rank % self.tp,
        }


@dataclass(frozen=True)
class RankEnv:
    """The torchrun-style environment a launcher gives each rank."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @classmethod
    def from_environ(cls) -> RankEnv:
        def num(key: str, default: int) -> int:
            raw = os.environ.get(key, str(default))
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None

        world = num("WORLD_SIZE", 1)
        return cls(num("RANK", 0), num("LOCAL_RANK", 0), world, num("LOCAL_WORLD_SIZE", world))


def init_distributed(backend: str, env: RankEnv, timeout_s: float) -> None:
    """Join the trial's process group (a no-op for a single rank, which needs no collectives)."""
    if env.world_size == 1 or dist.is_initialized():
        return
    dist.init_process_group(
        backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout_s)
    )


def set_rank_threads(env: RankEnv, cpu_affinity: str) -> list[int]:
    """Give this rank its share of the cores so ranks on one host do not oversubscribe them.

    Returns the cores this rank's share is drawn from. With `cpu_affinity=per_rank` the rank is
    also bound to exactly those cores.
    """
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // env.local_world_size)
    start = (env.local_rank * share) % len(cores)
    mine = cores[start : start + share] or cores[:share]
    if cpu_affinity == "per_rank":
        os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return mine
