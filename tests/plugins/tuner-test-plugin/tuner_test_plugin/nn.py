"""The torch side of tiny-moe, built on whatever device is current (the tuner uses meta)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tuner.models.layers import Decoder, attention


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, backend: str):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(attention(q, k, v, self.backend).transpose(1, 2).reshape(b, t, h))


class Experts(nn.Module):
    def __init__(self, hidden: int, experts: int, inner: int):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(experts, hidden, inner))
        self.w_out = nn.Parameter(torch.empty(experts, inner, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.gate(x).softmax(-1)  # [b, t, e]
        inner = F.gelu(torch.einsum("bth,ehf->btef", x, self.w_in))
        out = torch.einsum("btef,efh->bteh", inner, self.w_out)
        return (out * weights.unsqueeze(-1)).sum(-2)


class Block(nn.Module):
    ATTENTION = "attn"

    def __init__(self, m, o, backend: str):
        super().__init__()
        self.attn_norm = nn.RMSNorm(m.hidden, eps=1e-5)
        self.attn = Attention(m.hidden, m.heads, backend)
        self.mlp_norm = nn.RMSNorm(m.hidden, eps=1e-5)
        self.mlp = Experts(m.hidden, o.experts, o.expert_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyMoEModel(Decoder):
    first_parts = ("embed",)
    last_parts = ("norm", "head")

    def __init__(self, m, o, backend: str = "math"):
        super().__init__(m)
        self.embed: nn.Embedding | None = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleDict({str(i): Block(m, o, backend) for i in range(m.layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(m.hidden, eps=1e-5)
        self.head: nn.Linear | None = nn.Linear(m.hidden, m.vocab, bias=False)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x
