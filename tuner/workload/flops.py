"""Parameter counts and model FLOPs of a recipe's model, from the recipe alone.

The formulas live with each family (`tuner.models.<family>`, torch-free) and describe exactly
what the family's module builds; the estimator, MFU and the performance model all read them
through these functions, so they agree.
"""

from __future__ import annotations

from tuner.config import Config, recomputed_layers
from tuner.models import family_of
from tuner.recipe import ModelSpec, Recipe


def block_params(m: ModelSpec) -> int:
    return family_of(m).block_params(m)


def param_count(m: ModelSpec) -> int:
    """All parameters of the model (tied weights once)."""
    return family_of(m).param_count(m)


def matmul_params(m: ModelSpec) -> int:
    """Parameters that take part in matmuls (what the 6*N*tokens rule counts)."""
    return family_of(m).matmul_params(m)


def flops_per_token(m: ModelSpec) -> float:
    """Model FLOPs (forward + backward) per token, PaLM-style: 6N plus attention scores.

    Recompute is not counted: MFU measures useful model work, not work repeated to save memory.
    """
    return family_of(m).flops_per_token(m)


def flops_per_step(recipe: Recipe) -> float:
    """Model FLOPs of one optimizer step over the global batch."""
    return flops_per_token(recipe.model) * recipe.tokens_per_step


def block_flops_per_token(m: ModelSpec) -> float:
    """Model FLOPs (forward + backward) of one decoder block per token: its matmuls and its
    attention scores."""
    family = family_of(m)
    return (
        6.0 * family.block_matmul_params(m) + family.attention_score_flops_per_token(m, m.seq_len) / m.layers
    )


def stage_flops_per_token(m: ModelSpec, config: Config) -> list[float]:
    """Hardware FLOPs per token of each pipeline stage: its blocks, the forward of its recomputed
    blocks (or their attention) once more, and on the last stage the embedding and head (never
    recomputed). Counted as a third of the whole model's FLOPs, as it once was, recompute put a
    llama-tiny (whose head is 41% of its matmuls) 1.29x slower under full recompute where it
    measured 1.17-1.19x."""
    family = family_of(m)
    block = block_flops_per_token(m)
    head = max(0.0, family.flops_per_token(m) - m.layers * block)
    again = family.recomputed_flops_per_token(m, config.recompute)
    out = []
    for s in range(config.pp):
        layers = len(family.stage_layers(m, s, config.pp))
        repeated = recomputed_layers(layers, config.recompute_layers) if again else 0
        out.append(layers * block + repeated * again + (head if s == config.pp - 1 else 0.0))
    return out
