"""Parameter counts and model FLOPs of a recipe's model, from the recipe alone.

The formulas live with each family (`tuner.models.<family>`, torch-free) and describe exactly
what the family's module builds; the estimator, MFU and the performance model all read them
through these functions, so they agree.
"""

from __future__ import annotations

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
