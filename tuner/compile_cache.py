"""A build's portable compile caches (`torch.compiler.save_cache_artifacts`): how a rank saves one
(`tuner.workload.build_rank`), which ranks share one (`tuner.build.kernels`), and which one a rank
loads (`tuner.workload.run`, `TUNER_COMPILE_CACHE`): `compile-cache.bin` for rank 0 and every rank
that compiled the same graphs, `compile-cache-rank<R>.bin` for a rank whose graphs differ (a
pipeline stage of its own). Kept apart from `tuner.build` so a rank imports nothing of the build."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

SHARED = "compile-cache.bin"
ENV = "TUNER_COMPILE_CACHE"


def rank_file(rank: int) -> str:
    """The name of rank `rank`'s own cache, when its graphs differ from rank 0's."""
    return SHARED if rank == 0 else f"compile-cache-rank{rank}.bin"


def for_rank(shared: Path, rank: int) -> Path:
    """The cache rank `rank` loads, given the shared one's path: its own beside it where the build
    shipped one, else the shared one."""
    own = shared.with_name(rank_file(rank))
    return own if own.is_file() else shared


def load_for_rank(rank: int, environ: Mapping[str, str] = os.environ) -> Path | None:
    """Load the cache `TUNER_COMPILE_CACHE` names (`for_rank`: this rank's own where the build
    shipped one) before anything is compiled; the file loaded, None where none is named."""
    shared = environ.get(ENV)
    if not shared:
        return None
    import torch

    path = for_rank(Path(shared), rank)
    torch.compiler.load_cache_artifacts(path.read_bytes())
    return path


def save(directory: Path, rank: int) -> int | None:
    """Save what this process compiled to `directory/rank<R>.bin`, and the keys of its entries to
    `rank<R>.keys.json` (what `same_graphs` compares); the cache's size, None if nothing compiled."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    blob, info = saved
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank}.bin").write_bytes(blob)
    keys = {kind: sorted(found) for kind, found in info.artifacts.items()}
    (directory / f"rank{rank}.keys.json").write_text(json.dumps(keys, sort_keys=True))
    return len(blob)


def same_graphs(directory: Path, rank: int) -> bool:
    """Whether rank `rank` saved the same cache entries as rank 0 (`save`), so rank 0's cache serves
    it. Not the same bytes: each cache also holds its process's cache directory, object addresses
    and compile times, so two ranks' caches never matched byte for byte."""
    try:
        mine, first = (json.loads((directory / f"rank{r}.keys.json").read_text()) for r in (rank, 0))
    except (OSError, ValueError):
        return False
    return mine == first
