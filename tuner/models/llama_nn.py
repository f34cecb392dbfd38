"""The Llama-3 family in torch, exactly as `tuner.models.llama` counts it, in torchtitan's
layout, with its tensor-parallel plan: column-wise wq/wk/wv and w1/w3, row-wise wo and w2 (each
rank keeps whole query and key/value heads), the token embedding and output split over the
vocabulary, and RMSNorms sharded over the sequence under `sequence_parallel`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tuner.models.layers import Decoder, attention
from tuner.models.llama import LLAMA


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim/2] of the rotary embedding, in fp32."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of [batch, heads, seq, head_dim] by position (fp32 math)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, m, backend: str):
        super().__init__()
        self.head_dim = m.head_dim
        self.backend = backend
        kv_width = LLAMA.kv_heads(m) * m.head_dim
        self.wq = nn.Linear(m.hidden, m.hidden, bias=False)
        self.wk = nn.Linear(m.hidden, kv_width, bias=False)
        self.wv = nn.Linear(m.hidden, kv_width, bias=False)
        self.wo = nn.Linear(m.hidden, m.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts come from the shapes: heads/tp and kv_heads/tp under tensor parallelism.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = q.shape[1] // k.shape[1]
        if group > 1:  # grouped-query attention: each kv head serves `group` query heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = attention(q, k, v, self.backend)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, m):
        super().__init__()
        f = LLAMA.ffn_size(m)
        self.w1 = nn.Linear(m.hidden, f, bias=False)
        self.w2 = nn.Linear(f, m.hidden, bias=False)
        self.w3 = nn.Linear(m.hidden, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    ATTENTION = "attention"  # the submodule selective recompute checkpoints

    def __init__(self, m, backend: str):
        super().__init__()
        self.attention_norm = nn.RMSNorm(m.hidden, eps=1e-5)
        self.attention = Attention(m, backend)
        self.ffn_norm = nn.RMSNorm(m.hidden, eps=1e-5)
        self.feed_forward = FeedForward(m)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(Decoder):
    first_parts = ("tok_embeddings",)
    last_parts = ("norm", "output")

    def __init__(self, m, attention_backend: str = "math"):
        super().__init__(m)
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleDict({str(i): Block(m, attention_backend) for i in range(m.layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(m.hidden, eps=1e-5)
        self.output: nn.Linear | None = nn.Linear(m.hidden, m.vocab, bias=False)
        self.retie()

    def retie(self) -> None:
        if LLAMA.tied(self.spec) and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.spec
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        # Every stage builds the tables for the full sequence (under sequence parallelism a
        # block's input holds a slice of it, but attention runs on the gathered sequence).
        cos, sin = rope_tables(m.seq_len, m.head_dim, LLAMA.rope_theta(m), x.device)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x


def build(m, attention_backend: str = "math") -> Llama:
    return Llama(m, attention_backend)


def init_rule(m):
    """torchtitan's scheme with plain normals: projections N(0, 0.02), the residual outputs (wo,
    w2) and w3 scaled by depth, the output N(0, hidden^-1/2), the embedding N(0, 1) (hidden^-1/2
    when tied to the output), norms 1."""
    depth_std = 0.02 / math.sqrt(2 * m.layers)
    head_std = m.hidden**-0.5

    def rule(name: str) -> tuple[str, float]:
        if name.endswith("norm.weight"):
            return "ones", 0.0
        if name.startswith("tok_embeddings."):
            return "normal", head_std if LLAMA.tied(m) else 1.0
        if name.startswith("output."):
            return "normal", head_std
        if name.endswith(("wo.weight", "w2.weight", "w3.weight")):
            return "normal", depth_std
        return "normal", 0.02

    return rule


def parallelize(model: Llama, tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    out = Shard(1) if sp else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=out),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=out),
    }
    if sp:
        plan |= {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
        }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)
    if model.tok_embeddings is not None:
        embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
        parallelize_module(model.tok_embeddings, tp_mesh, embed)
    if model.output is not None:
        if sp:
            parallelize_module(model.norm, tp_mesh, SequenceParallel())
        head = ColwiseParallel(input_layouts=out, output_layouts=Shard(-1))
        parallelize_module(model.output, tp_mesh, head)
    model.retie()
    model.vocab_group = tp_mesh.get_group()
