"""The hf family in torch: transformers' own modules (`AutoModelForCausalLM.from_config`, on
whatever device is current: the workload uses `meta`), rearranged into the tuner's `Decoder`
skeleton so pipeline stages, recompute, offload, compile, FSDP and DDP treat it like gpt and
llama: `embed_tokens` (first stage), `layers` (transformers' decoder layers, keyed by index),
`norm` and `lm_head` (last stage). The rotary embedding's tables are computed on the host, outside
the module tree, so the meta build never leaves them uninitialised.

Tensor parallel follows the model's own `base_model_tp_plan`, translated to DTensor
`parallelize_module` (colwise -> ColwiseParallel, rowwise -> RowwiseParallel); the embedding and
the output are split over the vocabulary, and the loss is the vocabulary-parallel cross entropy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from tuner.models.hf import hf_config
from tuner.models.layers import SDPA_BACKENDS, Decoder

TP_STYLES = ("colwise", "rowwise")


def unsupported_tp_styles(plan: dict[str, str]) -> list[str]:
    """The plan's styles the translation does not cover (plans of the decoder layers only)."""
    bad = {style for key, style in plan.items() if style not in TP_STYLES or not key.startswith("layers.*.")}
    return sorted(bad)


def build_hf(cfg) -> nn.Module:
    """transformers' causal LM for a config, in fp32 with SDPA attention, nothing downloaded."""
    from transformers import AutoModelForCausalLM

    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def _scope_kernel(attn: nn.Module, backend: str) -> None:
    """Run `attn` under the chosen SDPA kernel, also when recompute replays it in backward (an
    instance attribute, so parameter names and the tp plan's paths stay transformers')."""
    forward = attn.forward

    def scoped(*args, **kwargs):
        with sdpa_kernel(SDPA_BACKENDS[backend]):
            return forward(*args, **kwargs)

    attn.forward = scoped


class HFDecoder(Decoder):
    first_parts = ("embed_tokens",)
    last_parts = ("norm", "lm_head")

    def __init__(self, m, attention_backend: str = "math"):
        super().__init__(m)
        cfg = hf_config(m)
        hf = build_hf(cfg)
        self.backend = attention_backend
        self.embed_tokens: nn.Module | None = hf.model.embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(hf.model.layers)})
        for layer in self.layers.values():
            layer.ATTENTION = "self_attn"  # what selective recompute checkpoints
            _scope_kernel(layer.self_attn, attention_backend)
        self.norm: nn.Module | None = hf.model.norm
        self.lm_head: nn.Module | None = hf.lm_head
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        with torch.device("cpu"):
            rotary = type(hf.model.rotary_emb)(config=cfg)
        self._rotary = [rotary]  # a list: not a submodule, so never on meta nor in the state
        self.retie()

    def retie(self) -> None:
        if self.tied and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rotary = self._rotary[0]
        cpu_x = torch.empty(1, device="cpu", dtype=torch.float32)
        cos, sin = rotary(cpu_x, positions.cpu())
        # In the hidden states' dtype, as transformers' own model does (bf16 under amp=O2).
        cos, sin = cos.to(x.device, x.dtype), sin.to(x.device, x.dtype)
        for layer in self.layers.values():
            out = layer(x, position_ids=positions, position_embeddings=(cos, sin))
            x = out[0] if isinstance(out, tuple) else out
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


def build(m, attention_backend: str = "math") -> HFDecoder:
    return HFDecoder(m, attention_backend)


def init_rule(m):
    """transformers' own scheme: normal(0, initializer_range) for Linears and embeddings, norms
    one, biases zero."""
    std = float(getattr(hf_config(m), "initializer_range", 0.02))

    def rule(name: str) -> tuple[str, float]:
        if name.endswith("norm.weight"):
            return "ones", 0.0
        if name.endswith(".bias"):
            return "zeros", 0.0
        return "normal", std

    return rule


def parallelize(model: HFDecoder, tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if sequence_parallel:
        raise ValueError("sequence_parallel is not supported for hf models")
    plan_in = getattr(hf_config(model.spec), "base_model_tp_plan", None) or {}
    if not plan_in or unsupported_tp_styles(plan_in):
        raise ValueError("this hf model has no tensor-parallel plan the tuner can translate")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {key.removeprefix("layers.*."): styles[style]() for key, style in plan_in.items()}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)
    if model.embed_tokens is not None:
        embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        parallelize_module(model.embed_tokens, tp_mesh, embed)
    if model.lm_head is not None:
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1)))
    model.retie()
    model.vocab_group = tp_mesh.get_group()
