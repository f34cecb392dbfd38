"""What a recipe's `model` section can name, for `tuner models`, `GET /v1/models` and the
dashboard's submit form: the built-in families with their own fields, the hf family's supported
model types, and the installed plugins with each one's option schema and package. Each family
and plugin comes with `example`, a small `model` section that validates (the form starts a
recipe from it)."""

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

# A model section per family that builds and trains in seconds on one CPU core.
EXAMPLES: dict[str, dict[str, Any]] = {
    "gpt": {"family": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 64, "vocab": 512},
    "llama": {"family": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "seq_len": 64,
              "vocab": 512},
    "hf": {"family": "hf", "seq_len": 64,
           "config": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 512}},
}  # fmt: skip


def models_catalog() -> dict[str, Any]:
    from tuner.models.hf import listed_types

    families = []
    for name, family in _REGISTRY.items():
        entry: dict[str, Any] = {
            "name": name,
            "description": DESCRIPTIONS.get(name, ""),
            "fields": list(family.fields),
        }
        if name == "hf":
            entry["model_types"] = list(listed_types())
        if name in EXAMPLES:
            entry["example"] = EXAMPLES[name]
        families.append(entry)
    return {"families": families, "plugins": plugin_catalog()}
