"""`model.family: hf`: a Hugging Face `transformers` decoder-only causal LM built from a config.

The recipe's `model.config` is data: `model_type` plus keys the config class declares. It is
checked here, before `transformers` sees it (`config_problems`): keys that would load or run code
(`auto_map`, `trust_remote_code`, anything naming a class, module, file or path) and undeclared
keys are refused, values must be plain numbers, strings, booleans, lists or mappings, the sizes
whole numbers within `ModelSpec`'s bounds, norm epsilons positive and activations ones
transformers knows (its config builds per-layer lists, so a billion layers would spin). Then the
config must build, its heads divide the width and its key/value heads the heads, and its meta
model must build: whatever transformers or torch raises is the recipe's problem (a `(field,
message)` pair), never a traceback. The model is built with `AutoConfig.for_model` and
`AutoModelForCausalLM.from_config` on the meta device (`hf_nn`), never from the hub. The
recipe's sizes (layers, hidden, heads, vocab, ffn) are the config's (`resolve_model`), and the
parameter counts are the meta model's own (`hf_layout.counts`).

Unlike gpt and llama, this module loads torch when it counts: `transformers`' config classes
import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
from typing import TYPE_CHECKING, Any

from tuner.models.base import ModelFamily, Requirement, SavedWidths, register
from tuner.models.hf_values import plain_problems, value_problems

if TYPE_CHECKING:
    from tuner.recipe import ModelSpec

# recipe field -> the config attribute it is read from
SIZE_FIELDS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "vocab": "vocab_size",
    "ffn": "intermediate_size",
}
MAX_REASON_CHARS = 400


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


@functools.cache
def listed_types() -> tuple[str, ...]:
    """The model types the tuner takes: `supported_types` that run SDPA attention (`runs_sdpa`).
    What `tuner models` lists and a wrong model_type is told to choose from; it imports every
    one's modeling module (about 1.6 s), so a recipe's own check asks `runs_sdpa` of its type only.
    Types whose forward the decoder does not follow (`hf_layout.UNFOLLOWED`) are refused, so not
    listed either."""
    from tuner.models.hf_layout import UNFOLLOWED

    return tuple(t for t in supported_types() if t not in UNFOLLOWED and runs_sdpa(t))


@functools.cache
def runs_sdpa(model_type: str) -> bool:
    """Whether transformers' causal LM of `model_type` runs its attention through SDPA, the kernels
    the tuner chooses between (a few run eager attention only: Gemma 2, gpt-oss, ...). Imports
    that one model's module."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return bool(getattr(MODEL_FOR_CAUSAL_LM_MAPPING[_config_class(model_type)], "_supports_sdpa", False))
    except (KeyError, ImportError, AttributeError):
        return False


def _config_class(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


# Keys of shipped config.json files that config classes no longer declare but still read: every
# class that declares `rope_parameters` folds these into it.
LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling", "partial_rotary_factor")
_KWARGS_READ = re.compile(r"kwargs\.(?:get|pop)\(\s*[\"'](\w+)[\"']")
# `getattr(config, "head_dim", ...)` in a modeling module: a key the model reads though its config
# class does not declare it (Qwen2, Qwen3-MoE, Cohere, Phi-3... take `head_dim` this way).
_CONFIG_READ = re.compile(r"getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']")


@functools.cache
def _modeling_reads(cls: Any) -> frozenset[str]:
    """The keys the model type's modeling module reads off its config with `getattr`, from the
    module's source (not imported: a source scan, as for the config class)."""
    import importlib.util

    module = cls.__module__.replace(".configuration_", ".modeling_")
    with contextlib.suppress(ImportError, ValueError, AttributeError, OSError):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            with open(spec.origin, encoding="utf-8") as f:
                return frozenset(_CONFIG_READ.findall(f.read()))
    return frozenset()


def _declared(cls: Any) -> set[str]:
    """The keys a config class takes: its fields, the legacy rotary keys where it has
    `rope_parameters`, what its own code reads from its extra keyword arguments (Gemma 3's
    `rope_local_base_freq` and `sliding_window_pattern`), and what its modeling module reads with
    `getattr` (`_modeling_reads`: Qwen3-MoE's `head_dim`)."""
    import inspect

    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
    else:
        names = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    if "rope_parameters" in names:
        names |= set(LEGACY_ROPE_KEYS)
    with contextlib.suppress(OSError, TypeError):
        names |= set(_KWARGS_READ.findall(inspect.getsource(cls)))
    return names | _modeling_reads(cls)


def config_problems(config: Any, where: str = "model.config") -> list[tuple[str, str]]:
    """(field, message) for everything wrong with a recipe's hf config; [] when it builds."""
    if not isinstance(config, dict):
        return [(where, "must be a mapping with model_type and the config class's keys")]
    out: list[tuple[str, str]] = []
    plain_problems({k: v for k, v in config.items() if k != "model_type"}, where, out)
    model_type = config.get("model_type")
    if model_type not in supported_types():
        return out + [
            (
                f"{where}.model_type",
                f"{model_type!r} is not a supported decoder-only model_type; "
                f"use one of {', '.join(listed_types())}",
            )  # fmt: skip
        ]
    if not runs_sdpa(model_type):
        return out + [
            (
                f"{where}.model_type",
                f"transformers runs {model_type} with eager attention only, and the tuner drives SDPA's "
                "kernels; this model_type is not supported",
            )
        ]
    declared = _declared(_config_class(model_type))
    for key in config:
        if key != "model_type" and key not in declared and not any(f == f"{where}.{key}" for f, _ in out):
            out.append((f"{where}.{key}", f"{model_type}'s config declares no {key!r}; remove it"))
    if not out:
        out = value_problems(config, where)
    if not out:
        out = _build_problems(config, where)
    return out


def config_attr(cfg: Any, name: str) -> Any:
    try:  # a per-layer attribute of a heterogeneous config refuses a global read
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001
        return None


def _shape_problems(cfg: Any, config: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """What gpt and llama refuse too: heads that do not divide the width, key/value heads that
    do not divide the heads (the config's values, defaults included; the field is a key given)."""
    hidden, heads = config_attr(cfg, "hidden_size"), config_attr(cfg, "num_attention_heads")
    kv = config_attr(cfg, "num_key_value_heads")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, heads)):
        return []
    out = []
    if hidden % heads:
        key = "num_attention_heads" if "num_attention_heads" in config else "hidden_size"
        out.append((f"{where}.{key}", f"num_attention_heads ({heads}) does not divide hidden_size ({hidden}); set "
                    "num_attention_heads to a divisor of hidden_size, or hidden_size to a multiple of it"))  # fmt: skip
    if isinstance(kv, int) and kv > 0 and heads % kv:
        key = "num_key_value_heads" if "num_key_value_heads" in config else "num_attention_heads"
        out.append((f"{where}.{key}", f"num_key_value_heads ({kv}) does not divide num_attention_heads ({heads}): "
                    "each key/value head serves a whole group of query heads; set num_key_value_heads to a "
                    f"divisor of {heads}"))  # fmt: skip
    return out


def _reason(err: BaseException, typed: bool) -> str:
    """An exception's whole message on one line, trimmed; with its type where that says more."""
    text = " ".join(str(err).split())
    if typed or not text:
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def _named(reason: str, config: dict[str, Any], where: str) -> str:
    """`model.config.<key>` when the reason quotes one of the config's keys, else `model.config`."""
    for name in re.findall(r"['\"`]([A-Za-z_]\w*)['\"`]", reason):
        if name in config and name != "model_type":
            return f"{where}.{name}"
    return where


def _build_problems(config: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """The config must build in transformers, and so must its meta model (what the counts and
    every entry point's checks build); anything either raises is the recipe's problem."""
    key = json.dumps(config, sort_keys=True)
    try:
        cfg = resolved(key)
    except Exception as err:  # noqa: BLE001 - any refusal of a data config is the user's to fix
        reason = _reason(err, typed=False)
        return [(_named(reason, config, where), f"transformers refused it: {reason}")]
    out = _shape_problems(cfg, config, where)
    if out:
        return out
    from tuner.models.hf_layout import counts, layout_problem

    try:  # the layout first: counting a model kept elsewhere than `model.layers` would raise
        problem = layout_problem(key)
        c = counts(key) if problem is None else {}
    except Exception as err:  # noqa: BLE001 - same: the config is data, its failure the user's
        reason = _reason(err, typed=True)
        return [(_named(reason, config, where), f"transformers could not build the model: {reason}")]
    fix = "wrap the model in a plugin family (model.family: plugin) or pick another model_type"
    if problem:
        return [(where, f"{problem}; the tuner's decoder cannot run it yet: {fix}")]
    if c["uneven_layer"]:
        return [(where, f"its layers differ in size (layer 0 and layer {c['uneven_layer']}: dense first "
                 "layers of a mixture of experts, or per-layer widths); the tuner's memory and FLOP "
                 "estimates take every layer to be like the first, so such a model is not supported yet")]  # fmt: skip
    return []


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
        value = config_attr(cfg, attr)
        if value is None and field != "ffn":  # ffn: None takes the family's default width
            problems.append(("model.config", f"model_type {model['config'].get('model_type')!r} has no "
                             f"{attr}: the tuner reads a decoder's sizes from it; this type is not supported"))  # fmt: skip
            continue
        if field in model and model[field] is not None and model[field] != value:
            problems.append((f"model.{field}", f"{model[field]} differs from model.config.{attr} ({value}); "
                                               f"remove {field}, the config sets it"))  # fmt: skip
        out[field] = value
    return out, problems


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
        from tuner.models.hf_layout import counts

        return counts(_key(m.config))

    def tied(self, m: ModelSpec) -> bool:
        return bool(self._c(m)["tied"])

    def ffn_size(self, m: ModelSpec) -> int:
        return int(getattr(hf_config(m), "intermediate_size", None) or 4 * m.hidden)

    def kv_heads(self, m: ModelSpec) -> int:
        return int(getattr(hf_config(m), "num_key_value_heads", None) or m.heads)

    def gated_mlp(self, m: ModelSpec) -> bool:
        return bool(self._c(m)["gated_mlp"])

    def rms_norm(self, m: ModelSpec) -> bool:
        return bool(self._c(m)["rms_norm"])

    def routed_experts(self, m: ModelSpec) -> tuple[int, int, int, int] | None:
        c = self._c(m)
        return (c["experts"], c["top_k"], c["expert_width"], c["shared_width"]) if c["experts"] else None

    def recomputed_flops_per_token(self, m: ModelSpec, recompute: str) -> float:
        """An MoE block's last op is its experts' weighted sum, which needs each expert's down
        projection again: full recompute repeats the whole forward."""
        if recompute == "full" and self.routed_experts(m):
            return (
                2.0 * self.block_matmul_params(m) + 2.0 * m.heads * sum(self.attention_widths(m)) * m.seq_len
            )
        return super().recomputed_flops_per_token(m, recompute)

    def saved_widths(self, m: ModelSpec, fused: bool) -> SavedWidths:
        """The norms the meta model has; transformers' SDPA call keeps k and v at the key/value heads
        in a fused, unmasked kernel with equal head widths up to 256 (`use_gqa_in_sdpa`), else at
        every head, and its contiguous output is the output projection's input (one tensor)."""
        c, (qk, v), heads, kv = self._c(m), self.attention_widths(m), m.heads, self.kv_heads(m)
        kv_saved = heads + (kv - heads) * (1 - self.masked_share(m) if fused and qk == v <= 256 else 0)
        return SavedWidths(c["norm_width"], c["head_norm_width"], (heads + kv_saved) * (qk + v))

    def masked_share(self, m: ModelSpec) -> float:
        from tuner.models.hf_layout import layer_types, sliding_mask

        cfg = hf_config(m)
        if not sliding_mask(cfg, m.seq_len):
            return 0.0
        kinds = layer_types(cfg)
        return kinds.count("sliding_attention") / len(kinds)

    def head_dim(self, m: ModelSpec) -> int:
        return self.attention_widths(m)[0]

    def attention_widths(self, m: ModelSpec) -> tuple[int, int]:
        """Multi-head latent attention's queries and keys are `qk_nope_head_dim + qk_rope_head_dim`
        wide and its values `v_head_dim` (its `head_dim` is the rotary part alone)."""
        cfg = hf_config(m)
        nope, rope, v = (config_attr(cfg, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        if all(isinstance(x, int) for x in (nope, rope, v)):
            return nope + rope, v
        d = int(config_attr(cfg, "head_dim") or super().head_dim(m))
        return d, d

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

    def preload(self, m: ModelSpec) -> None:
        """And the architecture's modeling module, which transformers imports lazily (111 MiB of
        a qwen2 rank's resident set, that the CPU reading counted as the model's)."""
        super().preload(m)
        from transformers import AutoModelForCausalLM

        with contextlib.suppress(KeyError, ImportError):
            AutoModelForCausalLM._model_mapping[type(hf_config(m))]  # noqa: B018 - imports its class

    def requires(self, m: ModelSpec) -> list[Requirement]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            have = version("transformers")
        except PackageNotFoundError:
            have = None
        return [Requirement("transformers", "transformers", have, module="transformers")]

    def shape_reasons(self, m: ModelSpec, tp: int, pp: int, sequence_parallel: bool) -> list[tuple[str, str]]:
        from tuner.models.hf_layout import tp_problem
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
            elif problem := tp_problem(_key(m.config)):
                r.append(("model.config", f"{cfg.model_type}: {problem}; use tp = 1"))
            if sequence_parallel:
                r.append(("model.config", "sequence_parallel is not supported for hf models; turn it off"))
        if pp > 1 and self.tied(m):
            r.append(("model.config.tie_word_embeddings", "tied embeddings span the first and last stage; "
                                                          "use pp = 1"))  # fmt: skip
        return r


HF = register(HFFamily())
