"""The hf family in torch: transformers' own modules (`AutoModelForCausalLM.from_config`, on
whatever device is current: the workload uses `meta`), rearranged into the tuner's `Decoder`
skeleton so pipeline stages, recompute, offload, compile, FSDP and DDP treat it like gpt and
llama: `embed_tokens` (first stage), `layers` (transformers' decoder layers, keyed by index),
`norm` and `lm_head` (last stage). The rotary embedding's tables are computed on the host, outside
the module tree, so the meta build never leaves them uninitialised. Around the layers it does what
transformers' own forward does: per layer type (`layer_types`: full or sliding attention) its
rotary tables and mask (a window, by transformers' `create_sliding_window_causal_mask`; none for
full attention, which SDPA runs causal), the embeddings' multiplier and the logits' scale or
softcap. `hf_layout.layout_problem` refuses, at the recipe check, the layouts it cannot run.

Tensor parallel follows the model's own `base_model_tp_plan`, translated to DTensor
`parallelize_module` (colwise -> ColwiseParallel, rowwise -> RowwiseParallel); the embedding and
the output are split over the vocabulary, and the loss is the vocabulary-parallel cross entropy.
"""

from __future__ import annotations

import inspect
import json

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from tuner.models.hf import hf_config
from tuner.models.hf_layout import layer_types, sliding_mask
from tuner.models.layers import SDPA_BACKENDS, Decoder

TP_STYLES = ("colwise", "rowwise")


def unsupported_tp_styles(plan: dict[str, str]) -> list[str]:
    """The plan's styles the translation does not cover (plans of the decoder layers only)."""
    bad = {style for key, style in plan.items() if style not in TP_STYLES or not key.startswith("layers.*.")}
    return sorted(bad)


def build_hf(cfg) -> nn.Module:
    """transformers' causal LM for a config, in fp32 with SDPA attention, nothing downloaded."""
    from transformers import AutoModelForCausalLM

    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def _scope_kernel(attn: nn.Module, backend: str) -> None:
    """Run `attn` under the chosen SDPA kernel, also when recompute replays it in backward (an
    instance attribute, so parameter names and the tp plan's paths stay transformers')."""
    forward = attn.forward

    def scoped(*args, **kwargs):
        with sdpa_kernel(SDPA_BACKENDS[backend]):
            return forward(*args, **kwargs)

    attn.forward = scoped


class HFDecoder(Decoder):
    first_parts = ("embed_tokens",)
    last_parts = ("norm", "lm_head")

    def __init__(self, m, attention_backend: str = "math"):
        super().__init__(m)
        cfg = hf_config(m)
        hf = build_hf(cfg)
        self.backend = attention_backend
        self.embed_tokens: nn.Module | None = hf.model.embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(hf.model.layers)})
        for layer in self.layers.values():
            layer.ATTENTION = "self_attn"  # what selective recompute checkpoints
            _scope_kernel(layer.self_attn, attention_backend)
        self.norm: nn.Module | None = hf.model.norm
        self.lm_head: nn.Module | None = hf.lm_head
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self._hf_init = [hf._init_weights]  # a list: hf is not a submodule (`init_fixed`)
        with torch.device("cpu"):
            rotary = type(hf.model.rotary_emb)(config=cfg)
        self._rotary = [rotary]  # a list: not a submodule, so never on meta nor in the state
        # Per layer, as transformers' own model: "full_attention" or "sliding_attention" (its
        # mask and, where the rotary embedding takes a layer type, its own rotary tables).
        self.layer_types = layer_types(cfg)
        self._cfg = cfg  # read every step: the embeddings' and the logits' scales, the window
        self._typed_rotary = "layer_type" in inspect.signature(rotary.forward).parameters
        self._tables: dict[tuple, dict[str, tuple]] = {}  # (seq, device, dtype) -> rotary tables
        self.retie()

    def retie(self) -> None:
        if self.tied and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def init_fixed(self) -> None:
        """transformers' own init (`_init_weights`) for the modules that hold buffers (Gemma's and
        MiniCPM3's embedding scale, a router's score-correction bias, xIELU's constants: left
        as stray memory by `to_empty`, logits off by up to 16 against transformers) and for the
        norms, whose weights start where the model's rule says (zeros where the norm computes
        x * (1 + w), as Gemma's: ones had doubled every norm's output). Deterministic values,
        so every split gets the same; the drawn parameters are flagged as transformers flags
        loaded ones, and its init functions leave them as drawn."""
        from transformers import initialization

        for module in self.modules():
            norm = "LayerNorm" in type(module).__name__ or "RMSNorm" in type(module).__name__
            if not norm and next(module.buffers(recurse=False), None) is None:
                continue
            params = list(module.parameters(recurse=False))
            for p in params:
                p._is_hf_initialized = not norm
            try:
                with initialization.guard_torch_init_functions():
                    self._hf_init[0](module)
            finally:
                for p in params:
                    del p._is_hf_initialized

    def _position_embeddings(self, x: torch.Tensor) -> dict[str, tuple]:
        """(cos, sin) by layer type, from the host's tables, in the hidden states' dtype as
        transformers' own model has them (bf16 under amp=O2). Made once per sequence length,
        device and dtype: a copy to the device every step would wait for the device."""
        key = (x.shape[1], x.device, x.dtype)
        if key not in self._tables:
            cpu_x = torch.empty(1, device="cpu", dtype=torch.float32)
            positions = torch.arange(x.shape[1], device="cpu").unsqueeze(0)
            out = {}
            for kind in set(self.layer_types):
                extra = (kind,) if self._typed_rotary else ()
                cos, sin = self._rotary[0](cpu_x, positions, *extra)
                out[kind] = (cos.to(x.device, x.dtype), sin.to(x.device, x.dtype))
            self._tables[key] = out
        return self._tables[key]

    def _masks(self, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """The attention mask by layer type: None (causal, SDPA's is_causal) for full attention,
        and for sliding layers up to the window's length (`hf.sliding_mask`: transformers builds
        a mask there too, which keeps the kernels that take none from running it); beyond, the
        window, by transformers' own `create_sliding_window_causal_mask`."""
        masks: dict[str, torch.Tensor | None] = {"full_attention": None, "sliding_attention": None}
        if sliding_mask(self._cfg, x.shape[1]):
            from transformers.masking_utils import create_sliding_window_causal_mask

            # No position ids: with them transformers checks for packed sequences, reading a
            # device tensor on the host (a sync every step); these positions are 0..seq-1.
            masks["sliding_attention"] = create_sliding_window_causal_mask(
                config=self._cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=None
            )
        return masks

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = _scale_embeddings(self.embed_tokens(x), self._cfg)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rotary, masks = self._position_embeddings(x), self._masks(x)
        for i, layer in self.layers.items():
            kind = self.layer_types[int(i)]
            out = layer(
                x, attention_mask=masks[kind], position_ids=positions, position_embeddings=rotary[kind]
            )
            x = out[0] if isinstance(out, tuple) else out
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            x = _finish_logits(self.lm_head(x), self._cfg)
        return x


# What a model's own forward does around the modules the decoder takes, by model type: the
# embeddings' multiplier (before the first block), and the logits' scale (+1: times the config's
# value, -1: divided by it). Gemma's `final_logit_softcapping` is read from any config.
_EMBEDDING_SCALE = {
    "granite": "embedding_multiplier",
    "granite_swa": "embedding_multiplier",
    "hyperclovax": "embedding_multiplier",
    "hrm_text": "embedding_scale",
}
_LOGIT_SCALE = {
    "cohere": ("logit_scale", 1),
    "cohere2": ("logit_scale", 1),
    "cohere2_moe": ("logit_scale", 1),
    "cohere_compass_text": ("logit_scale", 1),
    "hyperclovax": ("logits_scaling", 1),
    "granite": ("logits_scaling", -1),
    "granite_swa": ("logits_scaling", -1),
    "minicpm3": ("logits_scaling", -1),
}


def _scale_embeddings(x: torch.Tensor, cfg) -> torch.Tensor:
    key = _EMBEDDING_SCALE.get(cfg.model_type)
    return x * getattr(cfg, key) if key and getattr(cfg, key, None) not in (None, 1) else x


def _finish_logits(logits: torch.Tensor, cfg) -> torch.Tensor:
    """What the model's causal-LM head does after its projection (`_LOGIT_SCALE`, softcapping)."""
    key, power = _LOGIT_SCALE.get(cfg.model_type, (None, 0))
    if key and getattr(cfg, key, None) not in (None, 1):
        logits = logits * getattr(cfg, key) if power > 0 else logits / getattr(cfg, key)
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def build(m, attention_backend: str = "math") -> HFDecoder:
    return HFDecoder(m, attention_backend)


def init_rule(m):
    """transformers' own scheme: normal(0, initializer_range) for Linears and embeddings, norms
    one, biases zero; then `HFDecoder.init_fixed` sets the norms and buffers by the model's own
    rule (zeros for Gemma's norms)."""
    std = float(getattr(hf_config(m), "initializer_range", 0.02))

    def rule(name: str) -> tuple[str, float]:
        if name.endswith("norm.weight"):
            return "ones", 0.0
        if name.endswith(".bias"):
            return "zeros", 0.0
        return "normal", std

    return rule


def parallelize(model: HFDecoder, tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tuner.models.hf_layout import tp_problem

    if sequence_parallel:
        raise ValueError("sequence_parallel is not supported for hf models")
    plan_in = getattr(hf_config(model.spec), "base_model_tp_plan", None) or {}
    if not plan_in or unsupported_tp_styles(plan_in):
        raise ValueError("this hf model has no tensor-parallel plan the tuner can translate")
    problem = tp_problem(json.dumps(model.spec.config, sort_keys=True))
    if problem:
        raise ValueError(f"this hf model's tensor-parallel plan is not usable: {problem}")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {key.removeprefix("layers.*."): styles[style]() for key, style in plan_in.items()}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)
    if model.embed_tokens is not None:
        embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        parallelize_module(model.embed_tokens, tp_mesh, embed)
    if model.lm_head is not None:
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1)))
    model.retie()
    model.vocab_group = tp_mesh.get_group()
