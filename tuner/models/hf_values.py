"""The values of a recipe's hf config, checked before transformers sees them (`tuner.models.hf.
config_problems`): plain data only, no key that would load or run code, sizes within `ModelSpec`'s
bounds, norm epsilons positive, a sliding window a positive count, dropout rates probabilities,
activations ones transformers knows. Each problem is a (field, message) pair naming the fix."""

from __future__ import annotations

import math
import re
from typing import Any

# Keys that would make transformers import or fetch code or files, or that the tuner owns.
REFUSED_KEYS = frozenset({"auto_map", "trust_remote_code", "architectures", "attn_implementation", "dtype",
                          "torch_dtype", "quantization_config", "transformers_version"})  # fmt: skip
_CODE_WORDS = re.compile(r"class|module|file|path|auto_|tokenizer|processor|remote|url|repo", re.I)
# (least, most) of a config's sizes, mirrored from tuner.recipe.ModelSpec's Field bounds (layers
# 1..512, hidden 8..65536, heads 1..1024, vocab 2..2_000_000, kv_heads and ffn >= 1, seq_len
# <= 1_048_576): the sizes become those fields. ModelSpec leaves ffn unbounded; 16 x the widest
# hidden keeps it finite. A model needs no positions past the longest seq_len.
SIZE_BOUNDS = {
    "num_hidden_layers": (1, 512),
    "hidden_size": (8, 65536),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 65536),
    "vocab_size": (2, 2_000_000),
    "intermediate_size": (1, 16 * 65536),
    "max_position_embeddings": (1, 1_048_576),
}
ACTIVATION_KEYS = ("hidden_act", "hidden_activation")
_EPS_KEY = re.compile(r"(^|_)eps(ilon)?($|_)")
# Probabilities (dropout rates): torch refuses one outside [0, 1] in every trial's first step.
_PROBABILITY_KEY = re.compile(r"(^|_)(dropout|drop_prob|dropout_rate|dropout_prob)($|_)|_pdrop$")


def plain_problems(value: Any, where: str, out: list[tuple[str, str]]) -> None:
    """Numbers, strings, booleans, null, and lists/mappings of them; mapping keys checked too."""
    if isinstance(value, float) and not math.isfinite(value):
        out.append((where, f"{value} is not a finite number; write the value itself (a YAML .inf or a "
                           "JSON 1e400 is stored as null)"))  # fmt: skip
        return
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            plain_problems(v, f"{where}[{i}]", out)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                out.append((where, f"key {k!r} is not text; config keys are names"))
            elif k in REFUSED_KEYS or _CODE_WORDS.search(k):
                out.append((f"{where}.{k}", "names code or a file; a recipe is data, remove it"))
            else:
                plain_problems(v, f"{where}.{k}", out)
        return
    out.append((where, f"{type(value).__name__} is not plain data (numbers, text, lists, mappings)"))


def _size_problem(key: str, value: Any) -> str | None:
    low, high = SIZE_BOUNDS[key]
    if isinstance(value, bool) or not isinstance(value, int):
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        shown = f"text {shown}" if isinstance(value, str) else shown
        return f"{shown} is not a whole number; set {key} to an integer from {low} to {high} (no quotes)"
    if not low <= value <= high:
        return f"{value} is out of range; set {key} to an integer from {low} to {high}"
    return None


def _eps_problem(key: str, value: Any) -> str | None:
    if isinstance(value, str):
        return (f"text {value!r} is not a number; write it as a float such as 1.0e-6 "
                "(YAML reads 1e-6 without the point as text)")  # fmt: skip
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
        return f"{value} is not positive; set {key} to a small positive float such as 1.0e-6"
    return None


def _window_problem(value: Any) -> str | None:
    """A sliding window is a positive token count, or null for full attention (transformers reads
    0 as a window in some models and as none in others)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{value!r} is not a positive whole number; set sliding_window to the window in tokens, or null for none"
    return None


def _probability_problem(key: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return f"{value!r} is not a probability; set {key} to a number from 0 to 1 (0: no dropout)"
    return None


def value_problems(config: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """The sizes, norm epsilons and activations a recipe gives, checked before transformers sees
    them (its config builds per-layer lists from the sizes, and takes a negative epsilon)."""
    out: list[tuple[str, str]] = []
    for key, value in config.items():
        problem = None
        if value is None:
            continue
        if key in SIZE_BOUNDS:
            problem = _size_problem(key, value)
        elif _EPS_KEY.search(key):
            problem = _eps_problem(key, value)
        elif key == "sliding_window":
            problem = _window_problem(value)
        elif _PROBABILITY_KEY.search(key):
            problem = _probability_problem(key, value)
        elif key in ACTIVATION_KEYS and isinstance(value, str):
            from transformers.activations import ACT2FN

            if value not in ACT2FN:
                problem = f"{value!r} is not an activation transformers knows; use one of {', '.join(sorted(ACT2FN))}"
        if problem:
            out.append((f"{where}.{key}", problem))
    return out
