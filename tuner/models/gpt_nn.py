"""The GPT family in torch, exactly as `tuner.models.gpt` counts it, with its tensor-parallel
plan (Megatron's: column-wise qkv and MLP up, row-wise attention out and MLP down; the token
embedding and LM head split over the vocabulary)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tuner.models.layers import Decoder, attention


class Attention(nn.Module):
    def __init__(self, m, backend: str):
        super().__init__()
        self.head_dim = m.head_dim
        self.backend = backend
        # Rows are laid out [head, (q, k, v), head_dim], not [(q, k, v), head, head_dim], so a
        # column-wise tensor-parallel split hands each rank whole heads with their q, k and v.
        self.qkv = nn.Linear(m.hidden, 3 * m.hidden, bias=False)
        self.out = nn.Linear(m.hidden, m.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)  # heads / tp under tensor parallelism
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        y = attention(q, k, v, self.backend)
        return self.out(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.up = nn.Linear(m.hidden, m.ffn_size, bias=False)
        self.down = nn.Linear(m.ffn_size, m.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    ATTENTION = "attn"  # the submodule selective recompute checkpoints

    def __init__(self, m, backend: str):
        super().__init__()
        self.ln1 = nn.LayerNorm(m.hidden)
        self.attn = Attention(m, backend)
        self.ln2 = nn.LayerNorm(m.hidden)
        self.mlp = MLP(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(Decoder):
    """Decoder-only GPT-2-style transformer."""

    first_parts = ("tok_emb", "pos_emb")
    last_parts = ("norm", "lm_head")

    def __init__(self, m, attention_backend: str = "math"):
        super().__init__(m)
        self.tok_emb: nn.Embedding | None = nn.Embedding(m.vocab, m.hidden)
        self.pos_emb: nn.Embedding | None = nn.Embedding(m.seq_len, m.hidden)
        self.layers = nn.ModuleDict({str(i): Block(m, attention_backend) for i in range(m.layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(m.hidden)
        self.lm_head: nn.Linear | None = nn.Linear(m.hidden, m.vocab, bias=False)
        # Under sequence parallelism the summed embeddings are cut to this rank's sequence chunk.
        self.sequence_mesh = None

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
            if self.sequence_mesh is not None:
                x = _scatter_sequence(x, self.sequence_mesh)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


def _scatter_sequence(x: torch.Tensor, mesh) -> torch.Tensor:
    """Replicated [b, s, h] -> this rank's [b, s/tp, h]; backward all-gathers the gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(1)]).to_local()


def build(m, attention_backend: str = "math") -> GPT:
    return GPT(m, attention_backend)


def init_rule(m):
    """GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers), norms 1/0."""
    residual_std = 0.02 / math.sqrt(2 * m.layers)

    def rule(name: str) -> tuple[str, float]:
        if ".ln" in name or name.startswith("norm."):
            return ("ones", 0.0) if name.endswith("weight") else ("zeros", 0.0)
        if name.endswith(("attn.out.weight", "mlp.down.weight")):
            return "normal", residual_std
        return "normal", 0.02

    return rule


def parallelize(model: GPT, tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.out": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
    }
    if sp:
        into = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan |= {"ln1": SequenceParallel(), "attn": into, "ln2": SequenceParallel(), "mlp": into}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)
    if model.tok_emb is not None:
        parallelize_module(model.tok_emb, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
        model.sequence_mesh = tp_mesh if sp else None
    if model.lm_head is not None:
        if sp:
            parallelize_module(model.norm, tp_mesh, SequenceParallel())
        head = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1))
        parallelize_module(model.lm_head, tp_mesh, head)
    model.vocab_group = tp_mesh.get_group()
