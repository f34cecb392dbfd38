"""`model.family: hf`: a Hugging Face `transformers` decoder-only causal LM built from a config.

The recipe's `model.config` is data: `model_type` plus keys the config class declares. It is
checked here, before `transformers` sees it (`config_problems`): keys that would load or run code
(`auto_map`, `trust_remote_code`, anything naming a class, module, file or path) and undeclared
keys are refused, values must be plain numbers, strings, booleans, lists or mappings. The model
is built with `AutoConfig.for_model` and `AutoModelForCausalLM.from_config` on the meta device
(`hf_nn`), never from the hub. The recipe's sizes (layers, hidden, heads, vocab, ffn) are the
config's (`resolve_model`), and the parameter counts are the meta model's own (`counts`).

Unlike gpt and llama, this module loads torch when it counts: `transformers`' config classes
import it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import TYPE_CHECKING, Any

from tuner.models.base import ModelFamily, Requirement, register

if TYPE_CHECKING:
    from tuner.recipe import ModelSpec

# Keys that would make transformers import or fetch code or files, or that the tuner owns.
REFUSED_KEYS = frozenset({"auto_map", "trust_remote_code", "architectures", "attn_implementation", "dtype",
                          "torch_dtype", "quantization_config", "transformers_version"})  # fmt: skip
_CODE_WORDS = re.compile(r"class|module|file|path|auto_|tokenizer|processor|remote|url|repo", re.I)
# recipe field -> the config attribute it is read from
SIZE_FIELDS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "vocab": "vocab_size",
    "ffn": "intermediate_size",
}


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@functools.cache
def supported_types() -> tuple[str, ...]:
    """Decoder-only causal LMs in transformers' standard layout: a causal-LM class and a
    pipeline plan of exactly embed_tokens -> layers -> norm (what the tuner cuts into stages)."""
    _offline()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            cls = CONFIG_MAPPING[name]
        except (KeyError, ImportError, AttributeError):
            continue
        plan = getattr(cls, "base_model_pp_plan", None) or {}
        if set(plan) == {"embed_tokens", "layers", "norm"} and not getattr(cls, "is_encoder_decoder", False):
            out.append(name)
    return tuple(sorted(out))


def _config_class(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _declared(cls: Any) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    import inspect

    return set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}


def _plain(value: Any, where: str, out: list[tuple[str, str]]) -> None:
    """Numbers, strings, booleans, null, and lists/mappings of them; mapping keys checked too."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _plain(v, f"{where}[{i}]", out)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                out.append((where, f"key {k!r} is not text; config keys are names"))
            elif k in REFUSED_KEYS or _CODE_WORDS.search(k):
                out.append((f"{where}.{k}", "names code or a file; a recipe is data, remove it"))
            else:
                _plain(v, f"{where}.{k}", out)
        return
    out.append((where, f"{type(value).__name__} is not plain data (numbers, text, lists, mappings)"))


def config_problems(config: Any, where: str = "model.config") -> list[tuple[str, str]]:
    """(field, message) for everything wrong with a recipe's hf config; [] when it builds."""
    if not isinstance(config, dict):
        return [(where, "must be a mapping with model_type and the config class's keys")]
    out: list[tuple[str, str]] = []
    _plain({k: v for k, v in config.items() if k != "model_type"}, where, out)
    model_type = config.get("model_type")
    supported = supported_types()
    if model_type not in supported:
        return out + [
            (
                f"{where}.model_type",
                f"{model_type!r} is not a supported decoder-only model_type; "
                f"use one of {', '.join(supported)}",
            )  # fmt: skip
        ]
    declared = _declared(_config_class(model_type))
    for key in config:
        if key != "model_type" and key not in declared and not any(f == f"{where}.{key}" for f, _ in out):
            out.append((f"{where}.{key}", f"{model_type}'s config declares no {key!r}; remove it"))
    if not out:
        try:
            resolved(json.dumps(config, sort_keys=True))
        except Exception as err:  # noqa: BLE001 - any refusal of a data config is the user's to fix
            out.append((where, f"transformers refused it: {str(err).splitlines()[0]}"))
    return out


@functools.lru_cache(maxsize=64)
def resolved(config_json: str) -> Any:
    """The transformers config object of a checked config (cached by its JSON)."""
    _offline()
    from transformers import AutoConfig

    data = json.loads(config_json)
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


# The last configs' cache keys, by object: the space's enumeration asks for the same recipe's
# config hundreds of thousands of times, and dumping it to JSON each time was a third of it. The
# entry holds the dict itself, so its id cannot be reused while it is cached.
_KEYS: dict[int, tuple[dict[str, Any], str]] = {}


def _key(config: dict[str, Any]) -> str:
    hit = _KEYS.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    if len(_KEYS) >= 64:
        _KEYS.clear()
    key = json.dumps(config, sort_keys=True)
    _KEYS[id(config)] = (config, key)
    return key


def hf_config(m: ModelSpec) -> Any:
    return resolved(_key(m.config))


def resolve_model(model: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A recipe's `model` section with the sizes filled from its hf config, and the problems.
    A size the recipe gives must equal the config's."""
    problems = config_problems(model.get("config"))
    if problems:
        return model, problems
    cfg = resolved(json.dumps(model["config"], sort_keys=True))
    out = dict(model)
    for field, attr in SIZE_FIELDS.items():
        value = getattr(cfg, attr)
        if field in model and model[field] is not None and model[field] != value:
            problems.append((f"model.{field}", f"{model[field]} differs from model.config.{attr} ({value}); "
                                               f"remove {field}, the config sets it"))  # fmt: skip
        out[field] = value
    return out, problems


@functools.lru_cache(maxsize=64)
def counts(config_json: str) -> dict[str, int]:
    """Parameter counts of the meta model: embedding, one block (all / matmul / attention
    matmul), the head (final norm and, untied, the output projection), the whole model."""
    import torch

    from tuner.models import hf_nn

    with torch.device("meta"):
        model = hf_nn.build_hf(resolved(config_json))
    c = {"embedding": 0, "block": 0, "block_matmul": 0, "attention_matmul": 0, "head": 0, "total": 0}
    block0 = model.model.layers[0]
    for name, p in block0.named_parameters():
        c["block"] += p.numel()
        if p.dim() == 2:
            c["block_matmul"] += p.numel()
            if name.startswith("self_attn."):
                c["attention_matmul"] += p.numel()
    c["embedding"] = model.model.embed_tokens.weight.numel()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    c["head"] = sum(p.numel() for p in model.model.norm.parameters())
    c["head"] += 0 if tied else model.lm_head.weight.numel()
    c["tied"] = int(tied)
    c["total"] = sum(p.numel() for p in model.parameters())
    return c


class HFFamily(ModelFamily):
    name = "hf"
    fields = ("config",)
    nn_module = "tuner.models.hf_nn"

    def check_field(self, field: str, value: Any, values: dict[str, Any]) -> str | None:
        if field == "config":
            if value is None:
                return "the hf family needs model.config (model_type and the config's keys)"
            problems = config_problems(value)
            return "; ".join(f"{f}: {msg}" for f, msg in problems) or None
        return super().check_field(field, value, values)

    def _c(self, m: ModelSpec) -> dict[str, int]:
        return counts(_key(m.config))

    def tied(self, m: ModelSpec) -> bool:
        return bool(self._c(m)["tied"])

    def ffn_size(self, m: ModelSpec) -> int:
        return int(getattr(hf_config(m), "intermediate_size", None) or 4 * m.hidden)

    def kv_heads(self, m: ModelSpec) -> int:
        return int(getattr(hf_config(m), "num_key_value_heads", None) or m.heads)

    def column_parallel_inputs(self, m: ModelSpec) -> int:
        """The block entries of the model's own tensor-parallel plan that are column-wise."""
        plan = getattr(hf_config(m), "base_model_tp_plan", None) or {}
        return sum(1 for style in plan.values() if style == "colwise") or super().column_parallel_inputs(m)

    def attention_matmul_params(self, m: ModelSpec) -> int:
        return self._c(m)["attention_matmul"]

    def block_matmul_params(self, m: ModelSpec) -> int:
        return self._c(m)["block_matmul"]

    def block_params(self, m: ModelSpec) -> int:
        return self._c(m)["block"]

    def embedding_params(self, m: ModelSpec) -> int:
        return self._c(m)["embedding"]

    def head_params(self, m: ModelSpec) -> int:
        return self._c(m)["head"]

    def param_count(self, m: ModelSpec) -> int:
        return self._c(m)["total"]

    def vocab_params(self, m: ModelSpec, first: bool, last: bool) -> int:
        if self.tied(m) and first and last:
            return m.vocab * m.hidden
        return m.vocab * m.hidden * (int(first) + int(last))

    def requires(self, m: ModelSpec) -> list[Requirement]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            have = version("transformers")
        except PackageNotFoundError:
            have = None
        return [Requirement("transformers", "transformers", have, module="transformers")]

    def shape_reasons(self, m: ModelSpec, tp: int, pp: int, sequence_parallel: bool) -> list[tuple[str, str]]:
        from tuner.models.hf_nn import unsupported_tp_styles

        r: list[tuple[str, str]] = []
        cfg = hf_config(m)
        if tp > 1:
            plan = getattr(cfg, "base_model_tp_plan", None) or {}
            bad = unsupported_tp_styles(plan)
            if not plan:
                r.append(("model.config", f"{cfg.model_type} has no base_model_tp_plan; use tp = 1"))
            elif bad:
                r.append(("model.config", f"{cfg.model_type}'s tp plan uses {', '.join(bad)}; use tp = 1"))
            if sequence_parallel:
                r.append(("model.config", "sequence_parallel is not supported for hf models; turn it off"))
        if pp > 1 and self.tied(m):
            r.append(("model.config.tie_word_embeddings", "tied embeddings span the first and last stage; "
                                                          "use pp = 1"))  # fmt: skip
        return r


HF = register(HFFamily())
