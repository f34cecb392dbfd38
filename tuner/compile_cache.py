"""The names of a build's portable compile caches (`torch.compiler.save_cache_artifacts`), one rule
for the build that writes them (`tuner.build.kernels`) and the rank that loads them
(`tuner.workload.run`, `TUNER_COMPILE_CACHE`): `compile-cache.bin` for rank 0 and every rank that
compiled the same graphs, `compile-cache-rank<R>.bin` for a rank whose graphs differ (a pipeline
stage of its own). Kept apart from `tuner.build` so a rank imports nothing of the build."""

from __future__ import annotations

from pathlib import Path

SHARED = "compile-cache.bin"


def rank_file(rank: int) -> str:
    """The name of rank `rank`'s own cache, when its graphs differ from rank 0's."""
    return SHARED if rank == 0 else f"compile-cache-rank{rank}.bin"


def for_rank(shared: Path, rank: int) -> Path:
    """The cache rank `rank` loads, given the shared one's path: its own beside it where the build
    shipped one, else the shared one."""
    own = shared.with_name(rank_file(rank))
    return own if own.is_file() else shared
