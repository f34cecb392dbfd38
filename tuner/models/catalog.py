"""What a recipe's `model` section can name, for `tuner models` and `GET /v1/models`: the
built-in families with their own fields, the hf family's supported model types, and the
installed plugins with each one's option schema."""

from __future__ import annotations

from typing import Any

from tuner.models.base import _REGISTRY
from tuner.models.plugins import catalog as plugin_catalog

DESCRIPTIONS = {
    "gpt": "GPT-2 style decoder (LayerNorm, GELU MLP, learned positions).",
    "llama": "Llama-3 layout (RMSNorm, RoPE, SwiGLU, grouped-query attention).",
    "hf": "A Hugging Face transformers decoder-only model built from model.config (data only).",
    "plugin": "An installed model plugin: model.plugin names it, model.options are its options.",
}


def models_catalog() -> dict[str, Any]:
    from tuner.models.hf import supported_types

    families = []
    for name, family in _REGISTRY.items():
        entry: dict[str, Any] = {
            "name": name,
            "description": DESCRIPTIONS.get(name, ""),
            "fields": list(family.fields),
        }
        if name == "hf":
            entry["model_types"] = list(supported_types())
        families.append(entry)
    return {"families": families, "plugins": plugin_catalog()}
