"""Synthetic token data: sample i is the same tokens whatever the dp split, so every split of one
config sees the same global batches and its losses are comparable."""

from __future__ import annotations

import itertools
import os

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class SyntheticTokens(Dataset):
    """Sample `i` is `seq_len + 1` tokens drawn from a generator seeded by (seed, i)."""

    def __init__(self, vocab: int, seq_len: int, seed: int):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def __len__(self) -> int:
        return 2**62  # endless: the sampler decides which samples a rank reads

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        tokens = torch.randint(self.vocab, (self.seq_len + 1,), generator=gen)
        return tokens[:-1], tokens[1:]


class DpShardSampler(Sampler[int]):
    """Endless global sample indices for one dp rank: of step s's global batch
    [s*gbs, (s+1)*gbs), dp rank r takes the r-th contiguous slice of gbs/dp samples."""

    def __init__(self, global_batch: int, dp: int, dp_rank: int):
        self.global_batch = global_batch
        self.per_rank = global_batch // dp
        self.dp_rank = dp_rank

    def __iter__(self):
        for s in itertools.count():
            start = s * self.global_batch + self.dp_rank * self.per_rank
            yield from range(start, start + self.per_rank)


def make_loader(
    vocab: int,
    seq_len: int,
    seed: int,
    global_batch: int,
    micro_batch: int,
    dp: int,
    dp_rank: int,
    workers: int,
    pin_memory: bool,
) -> DataLoader:
    """Micro-batches of `micro_batch` samples, `global_batch/(micro_batch*dp)` per step."""
    return DataLoader(
        SyntheticTokens(vocab, seq_len, seed),
        batch_size=micro_batch,
        sampler=DpShardSampler(global_batch, dp, dp_rank),
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        drop_last=True,
        worker_init_fn=_test_fault_in_worker,
    )


_held: list[torch.Tensor] = []


def _test_fault_in_worker(_worker: int) -> None:
    """The test hook `TUNER_TEST_FAULT=loader-alloc:<MiB>` (`tuner.workload.run`): each loader
    worker allocates and holds that many MiB, as a loader that leaks into its workers does."""
    kind = os.environ.get("TUNER_TEST_FAULT", "")
    if kind.startswith("loader-alloc:"):
        _held.append(torch.ones(int(kind.split(":", 1)[1]) * 2**20, dtype=torch.uint8))
