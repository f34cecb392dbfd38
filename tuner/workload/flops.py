"""Parameter counts and model FLOPs of the reference GPT, from the recipe alone.

The architecture these formulas describe is the one `tuner.workload.model` builds: learned token
and position embeddings, `layers` pre-norm blocks (LayerNorm with bias, bias-free Linear layers:
fused qkv, attention output, MLP up and down with GELU), a final LayerNorm and an untied,
bias-free LM head. The estimator and MFU both use these numbers, so they live in one place.
"""

from __future__ import annotations

from tuner.recipe import ModelSpec, Recipe


def block_params(m: ModelSpec) -> int:
    h, f = m.hidden, m.ffn_size
    attn = 3 * h * h + h * h
    mlp = h * f + f * h
    norms = 2 * (2 * h)
    return attn + mlp + norms


def param_count(m: ModelSpec) -> int:
    """All parameters of the model."""
    embed = m.vocab * m.hidden + m.seq_len * m.hidden
    head = m.hidden * m.vocab
    final_norm = 2 * m.hidden
    return embed + m.layers * block_params(m) + final_norm + head


def matmul_params(m: ModelSpec) -> int:
    """Parameters that take part in matmuls (what the 6*N*tokens rule counts)."""
    h, f = m.hidden, m.ffn_size
    return m.layers * (4 * h * h + 2 * h * f) + h * m.vocab


def flops_per_token(m: ModelSpec) -> float:
    """Model FLOPs (forward + backward) per token, PaLM-style: 6N plus attention scores.

    Recompute is not counted: MFU measures useful model work, not work repeated to save memory.
    """
    return 6.0 * matmul_params(m) + 12.0 * m.layers * m.hidden * m.seq_len


def flops_per_step(recipe: Recipe) -> float:
    """Model FLOPs of one optimizer step over the global batch."""
    tokens = recipe.train.global_batch_size * recipe.model.seq_len
    return flops_per_token(recipe.model) * tokens
