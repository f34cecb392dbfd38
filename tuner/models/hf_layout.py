"""What the hf family reads off transformers' model built on the meta device (no memory): its
parameter counts and kind of block (`counts`), whether the tuner's decoder (`hf_nn`) can run
its layers (`layout_problem`: each layer's attention kind, `layer_types`) and split them by the
model's tensor-parallel plan (`tp_problem`). The decoder calls transformers' decoder layers itself, one by one,
with the rotary tables and attention masks that the model's own forward would pass them."""

from __future__ import annotations

import functools
import re
from typing import Any

from tuner.models.hf import config_attr, resolved

# Per-layer attention kinds the decoder gives a mask of their own (transformers' names).
LAYER_TYPES = ("full_attention", "sliding_attention")
# Model types whose own forward does more around its layers than the decoder repeats.
UNFOLLOWED = {
    "doge": "its attention adds a learned dynamic mask to a materialised causal mask, which the "
    "decoder leaves to SDPA's causal flag",
    "phi4_multimodal": "its model carries image and audio encoders, which the text decoder leaves "
    "out (their parameters would be counted, never trained); use phi3 for its text model",
    "gemma3n_text": "its layers take per-layer inputs and shared key/value states (AltUp, per-layer "
    "embeddings) that its own forward computes",
    "hrm_text": "its model keeps its layers in two recurrent modules (H_module, L_module), not in layers",
    "longcat_flash": "its config counts two sublayers per decoder layer (num_hidden_layers = 2 x num_layers), "
    "so the stages and counts would read twice the layers built",
}


def sliding_mask(cfg: Any, seq_len: int) -> bool:
    """Whether the model's sliding-window layers need a mask at `seq_len`: some layer slides, and
    the sequence is longer than the window (a query sees keys less than the window behind it, so
    up to the window's length causal attention is the same)."""
    window = getattr(cfg, "sliding_window", None)
    return bool(window and seq_len > window and "sliding_attention" in layer_types(cfg))


def layer_types(cfg: Any) -> list[str]:
    """Each decoder layer's attention kind, as transformers' own model reads it: the config's
    `layer_types` ("full_attention", "sliding_attention", ...), else every layer sliding when the
    config sets a window (Mistral, Starcoder2) and full when it does not."""
    every = "sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"
    return list(getattr(cfg, "layer_types", None) or [every] * cfg.num_hidden_layers)


@functools.lru_cache(maxsize=8)
def _meta_model(config_json: str) -> Any:
    import torch

    from tuner.models import hf_nn

    with torch.device("meta"):
        return hf_nn.build_hf(resolved(config_json))


@functools.lru_cache(maxsize=64)
def counts(config_json: str) -> dict[str, int]:
    """Parameter counts of the meta model: embedding, one block (all / matmul / attention
    matmul), the head (final norm and, untied, the output projection), the whole model."""
    model = _meta_model(config_json)
    c = {"embedding": 0, "block": 0, "block_matmul": 0, "attention_matmul": 0, "head": 0, "total": 0}
    layers = model.model.layers
    block0 = layers[0]
    # The estimates multiply one block by the layers: a model whose blocks differ (dense first
    # layers of an MoE, per-layer widths) is refused by the recipe check (`_build_problems`).
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    c["uneven_layer"] = next((i for i, n in enumerate(sizes) if n != sizes[0]), 0)
    for name, p in block0.named_parameters():
        c["block"] += p.numel()
        if p.dim() == 2:
            c["block_matmul"] += p.numel()
            if name.startswith("self_attn."):
                c["attention_matmul"] += p.numel()
    # The block's kind: three inner-width matrices, a gated MLP (not an MoE's experts); RMSNorm.
    f, h = int(getattr(model.config, "intermediate_size", 0) or 0), model.config.hidden_size
    c["gated_mlp"] = int(c["block_matmul"] - c["attention_matmul"] == 3 * h * f)
    c["rms_norm"] = int(any("RMSNorm" in type(mod).__name__ for mod in block0.modules()))
    c["norm_width"], c["head_norm_width"] = _norm_widths(block0, model.config)
    c |= _routed_experts(block0, model.config, c["block_matmul"] - c["attention_matmul"])
    # Each token runs `top_k` of the experts: that share of their weights is the block's matmul
    # parameters (its FLOPs) too.
    c["block_matmul"] += c.pop("active_expert_params")
    c["embedding"] = model.model.embed_tokens.weight.numel()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    c["head"] = sum(p.numel() for p in model.model.norm.parameters())
    c["head"] += 0 if tied else model.lm_head.weight.numel()
    c["tied"] = int(tied)
    c["total"] = sum(p.numel() for p in model.parameters())
    return c


# A query's or key's own norm (Qwen3, Gemma 3: q_norm; Persimmon: q_layernorm; Hunyuan:
# query_layernorm), applied per head or to the whole projection: either way it normalises q or k.
_HEAD_NORM = re.compile(r"(?:q|query|k|key)_(?:norm|layernorm)")


def _norm_widths(block: Any, cfg: Any) -> tuple[int, int]:
    """Elements per token the block's norms normalise: (over the residual stream, as many as the
    block has: Gemma 3's sandwich has four; or a latent, by its weight's width), (over the queries
    and keys: their norms'). The estimator counts the copies a norm saves of each."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    d = _head_width(block, cfg)
    kv = config_attr(cfg, "num_key_value_heads") or heads
    stream = per_head = 0
    for name, mod in block.named_modules():
        if "Norm" not in type(mod).__name__ or any(True for _ in mod.children()):
            continue
        leaf = name.rpartition(".")[2]
        if _HEAD_NORM.fullmatch(leaf):
            per_head += (heads if leaf[0] == "q" else kv) * d
        else:
            weight = getattr(mod, "weight", None)
            stream += weight.shape[-1] if weight is not None and weight.dim() else h
    return stream, per_head


def _head_width(block: Any, cfg: Any) -> int:
    """One head's width in `block`: its attention module's own (a heterogeneous config, Gemma 4's,
    refuses a global read of `head_dim`: it may differ per layer), else the config's."""
    d = getattr(getattr(block, "self_attn", None), "head_dim", None)
    return int(d or config_attr(cfg, "head_dim") or cfg.hidden_size // cfg.num_attention_heads)


def _routed_experts(block: Any, cfg: Any, mlp_matmul: int) -> dict[str, int]:
    """An MoE block's experts (transformers keeps them as 3-D tensors, one slice per expert):
    how many, how many a token is routed to (`num_experts_per_tok`), each one's inner width (gated:
    three matrices of hidden x width), the width of a shared dense expert beside them (what of
    the block's 2-D matrices outside attention, `mlp_matmul`, is not the router), and the expert
    parameters one token runs (`top_k` of the experts)."""
    stacked = [p for p in block.parameters() if p.dim() >= 3]
    if not stacked:
        return {"experts": 0, "top_k": 0, "expert_width": 0, "shared_width": 0, "active_expert_params": 0}
    h, experts = cfg.hidden_size, stacked[0].shape[0]
    numel = sum(p.numel() for p in stacked)
    top_k = min(int(_routed_per_token(cfg) or experts), experts)
    return {"experts": experts, "top_k": top_k, "expert_width": numel // experts // (3 * h),
            "shared_width": max(0, mlp_matmul - experts * h) // (3 * h),
            "active_expert_params": numel * top_k // experts}  # fmt: skip


# Where a config names the experts a token is routed to (Aria: moe_topk).
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


def _routed_per_token(cfg: Any) -> int | None:
    for key in TOP_K_KEYS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@functools.lru_cache(maxsize=64)
def layout_problem(config_json: str) -> str | None:
    """Why the decoder cannot run this model's layers as transformers' model does, or None."""
    cfg = resolved(config_json)
    if cfg.model_type in UNFOLLOWED:
        return f"{cfg.model_type}: {UNFOLLOWED[cfg.model_type]}"
    model = _meta_model(config_json)
    built, expected = len(getattr(model.model, "layers", None) or ()), getattr(cfg, "num_hidden_layers", None)
    if expected is not None and built != expected:
        return (f"it builds {built} decoder layers for num_hidden_layers {expected}, which the stages and "
                "counts read")  # fmt: skip
    if getattr(model.model, "rotary_emb", None) is None:
        return f"{cfg.model_type} has no model-wide rotary embedding (rotary_emb)"
    plain = [i for i, layer in enumerate(model.model.layers) if not hasattr(layer, "self_attn")]
    if plain:
        return f"layer {plain[0]} has no self_attn (a hybrid of linear and full attention layers)"
    kinds = sorted(set(getattr(cfg, "layer_types", None) or []) - set(LAYER_TYPES))
    if kinds:
        return f"its layer_types include {', '.join(kinds)}; the decoder knows {' and '.join(LAYER_TYPES)}"
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict) and set(rope) & set(LAYER_TYPES) and None in rope.values():
        return "some of its layer types have no rotary embedding (rope_parameters: null)"
    return None


# A router's modules: every rank routes the whole (replicated) hidden states, so its weights stay
# whole under tensor parallel, as the plans leave them.
ROUTER_NAMES = ("gate", "router")


@functools.lru_cache(maxsize=64)
def tp_problem(config_json: str) -> str | None:
    """Why the model's own `base_model_tp_plan` (colwise/rowwise entries) cannot split its blocks
    as the estimator counts them, or None. A parameter the plan leaves whole is fine where every
    rank applies it to the whole tensor (a norm over the hidden states or over one head, a
    router); anything else (Youtu's latent-attention projections, which its plan leaves whole on
    every rank; Cohere's per-head q/k norms, which no longer match the rank's heads) is refused."""
    import fnmatch

    model = _meta_model(config_json)
    cfg = model.config
    plan = getattr(cfg, "base_model_tp_plan", None) or {}
    covered = [key.removeprefix("layers.*.") for key in plan]
    widths = {cfg.hidden_size, _head_width(model.model.layers[0], cfg)}
    for name, p in model.model.layers[0].named_parameters():
        module = name.rpartition(".")[0]
        if any(fnmatch.fnmatchcase(module, key) for key in covered):
            continue
        if module.rpartition(".")[2] in ROUTER_NAMES or (p.dim() == 1 and p.shape[0] in widths):
            continue
        return (f"its tensor-parallel plan leaves {name} {tuple(p.shape)} whole on every rank: it would not "
                "match the rank's share of the heads, or run whole where the estimates split the block")  # fmt: skip
    return None
