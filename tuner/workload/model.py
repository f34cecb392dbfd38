"""The reference GPT that every trial trains, exactly as `tuner.workload.flops` counts it.

Weights are initialised per parameter name from the seed, so a pipeline stage, a tensor-parallel
shard and the single-process model all start from the same numbers.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tuner.recipe import ModelSpec

SDPA_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}

# npu_fusion_attention's documented causal mode (sparse_mode=2) takes a fixed 2048x2048
# upper-triangular mask whatever the sequence length.
_NPU_CAUSAL_MASK_SIZE = 2048


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    """Causal attention over [batch, heads, seq, head_dim] tensors with the named kernel."""
    if backend == "npu_fusion":
        return _npu_fusion_attention(q, k, v)
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _npu_fusion_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    import torch_npu  # only reachable on Ascend, where the feasibility rules allow npu_fusion

    n = _NPU_CAUSAL_MASK_SIZE
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), diagonal=1)
    out = torch_npu.npu_fusion_attention(
        q,
        k,
        v,
        q.shape[1],
        "BNSD",
        atten_mask=mask,
        scale=1.0 / math.sqrt(q.shape[-1]),
        keep_prob=1.0,
        sparse_mode=2,
    )
    return out[0]


class Attention(nn.Module):
    def __init__(self, m: ModelSpec, backend: str):
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
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.up = nn.Linear(m.hidden, m.ffn_size, bias=False)
        self.down = nn.Linear(m.ffn_size, m.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, m: ModelSpec, backend: str):
        super().__init__()
        self.ln1 = nn.LayerNorm(m.hidden)
        self.attn = Attention(m, backend)
        self.ln2 = nn.LayerNorm(m.hidden)
        self.mlp = MLP(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer. A pipeline stage is the same class with the parts it does not
    own removed: `layers` is a ModuleDict keyed by global layer index so names survive slicing."""

    def __init__(self, m: ModelSpec, attention_backend: str = "math"):
        super().__init__()
        self.spec = m
        self.tok_emb: nn.Embedding | None = nn.Embedding(m.vocab, m.hidden)
        self.pos_emb: nn.Embedding | None = nn.Embedding(m.seq_len, m.hidden)
        self.layers = nn.ModuleDict({str(i): Block(m, attention_backend) for i in range(m.layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(m.hidden)
        self.lm_head: nn.Linear | None = nn.Linear(m.hidden, m.vocab, bias=False)
        # amp=O1: (device type, dtype) to autocast the forward in. The model owns it so a
        # pipeline stage, DDP and FSDP all run their forward under it and no backward does.
        self.autocast: tuple[str, torch.dtype] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] -> logits [batch, seq, vocab] (a middle stage: hidden -> hidden)."""
        if self.autocast is None:
            return self._forward(x)
        device_type, dtype = self.autocast
        with torch.autocast(device_type, dtype=dtype):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x

    def keep_stage(self, stage: int, stages: int) -> GPT:
        """Drop everything pipeline stage `stage` of `stages` does not own (in place)."""
        per = self.spec.layers // stages
        owned = range(stage * per, (stage + 1) * per)
        for name in list(self.layers.keys()):
            if int(name) not in owned:
                del self.layers[name]
        if stage != 0:
            self.tok_emb = self.pos_emb = None
        if stage != stages - 1:
            self.norm = self.lm_head = None
        return self


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """GPT-2 style init, each tensor drawn from its own name-keyed generator (split-invariant)."""
    residual_std = 0.02 / math.sqrt(2 * model.spec.layers)
    for name, p in model.named_parameters():
        if ".ln" in name or name.startswith("norm."):
            p.fill_(1.0 if name.endswith("weight") else 0.0)
            continue
        std = residual_std if name.endswith(("attn.out.weight", "mlp.down.weight")) else 0.02
        gen = torch.Generator().manual_seed(_param_seed(seed, name))
        p.copy_(torch.randn(p.shape, generator=gen) * std)


def build_model(m: ModelSpec, attention_backend: str, seed: int, device: torch.device) -> GPT:
    model = GPT(m, attention_backend).to(device)
    init_weights(model, seed)
    return model
