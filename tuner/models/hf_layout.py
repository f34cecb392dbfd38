"""What the hf family reads off transformers' model built on the meta device (no memory): its
parameter counts and kind of block (`counts`), and whether the tuner's decoder (`hf_nn`) can run
its layers (`layout_problem`). The decoder calls transformers' decoder layers itself, one by one,
with the rotary tables and attention masks that the model's own forward would pass them."""

from __future__ import annotations

import functools
from typing import Any

from tuner.models.hf import resolved

# Per-layer attention kinds the decoder gives a mask of their own (transformers' names).
LAYER_TYPES = ("full_attention", "sliding_attention")
# Model types whose own forward does more around its layers than the decoder repeats.
UNFOLLOWED = {
    "doge": "its attention adds a learned dynamic mask to a materialised causal mask, which the "
    "decoder leaves to SDPA's causal flag",
    "phi4_multimodal": "its model carries image and audio encoders, which the text decoder leaves "
    "out (their parameters would be counted, never trained); use phi3 for its text model",
}


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
