"""The hf family's model matches the model transformers builds from the same config, and a split
the decoder cannot run as counted is refused with its reason: a head width the config class does
not declare but the model reads, parameters the tensor-parallel plan leaves whole, a decoder with
fewer layers than `num_hidden_layers`, multi-head latent attention's FLOPs. Tiny configs as data,
nothing downloaded."""

from __future__ import annotations

import pytest
import torch

from tuner.config import Config, shape_reasons
from tuner.models import family_of
from tuner.models.hf import hf_config
from tuner.models.hf_nn import build_hf
from tuner.recipe import RecipeError, recipe_from_dict


def _recipe(config: dict, seq_len: int = 32):
    return recipe_from_dict({"name": "hf", "model": {"family": "hf", "seq_len": seq_len, "config": config},
                             "train": {"global_batch_size": 2}})  # fmt: skip


def test_a_head_width_the_model_reads_but_its_config_class_does_not_declare_is_taken():
    """Qwen3-MoE's config class declares no `head_dim`, but its attention reads one
    (`getattr(config, "head_dim", hidden / heads)`): Qwen3-30B-A3B's 128 was refused with "remove
    it", and without it the model was built with 64 (30.08B parameters instead of 30.53B)."""
    config = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "moe_intermediate_size": 32,
              "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256}  # fmt: skip
    m = _recipe(config).model
    family = family_of(m)
    with torch.device("meta"):
        theirs = build_hf(hf_config(m))
    assert tuple(theirs.model.layers[0].self_attn.q_proj.weight.shape) == (4 * 32, 64)
    ours = family.build(m, "math")
    assert (
        ours.layers["0"].self_attn.q_proj.weight.shape == theirs.model.layers[0].self_attn.q_proj.weight.shape
    )
    assert family.head_dim(m) == 32
    assert family.param_count(m) == sum(p.numel() for p in theirs.parameters())


SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 256}  # fmt: skip


def _tp_reasons(config: dict) -> dict[str, str]:
    return dict(shape_reasons(Config.from_params({"tp": 2}), _recipe(config)))


def test_tensor_parallel_is_refused_where_the_plan_leaves_per_head_weights_whole():
    """Cohere's `use_qk_norm` adds q/k norm weights shaped (heads, head_dim), which its plan does
    not split: every tp > 1 trial crashed with a size mismatch against the rank's heads."""
    assert _tp_reasons({"model_type": "cohere"} | SMALL) == {}
    reason = _tp_reasons({"model_type": "cohere", "use_qk_norm": True} | SMALL)["model.config"]
    assert "self_attn.q_norm.weight (4, 16)" in reason and "use tp = 1" in reason


def test_tensor_parallel_is_refused_where_the_plan_leaves_projections_whole():
    """Youtu's plan lists only its MLP: its latent-attention projections stayed whole on every
    rank, while the estimator divided the whole block by tp."""
    reason = _tp_reasons({"model_type": "youtu"} | SMALL | {"num_key_value_heads": 4})["model.config"]
    assert "self_attn." in reason and "whole on every rank" in reason and "use tp = 1" in reason


LONGCAT = {"model_type": "longcat_flash", "hidden_size": 64, "num_layers": 3, "num_attention_heads": 4,
           "vocab_size": 256, "n_routed_experts": 8, "zero_expert_num": 4, "moe_topk": 2,
           "expert_ffn_hidden_size": 32, "ffn_hidden_size": 128}  # fmt: skip


def test_a_model_with_fewer_decoder_layers_than_num_hidden_layers_is_refused(monkeypatch):
    """LongCat-Flash's config sets num_hidden_layers = 2 x num_layers but builds num_layers decoder
    layers: pipeline stages held no layers and the parameters were counted twice. The type is not
    listed, and any model whose built layers differ from num_hidden_layers is refused."""
    from tuner.models import hf_layout
    from tuner.models.hf import listed_types

    assert "longcat_flash" not in listed_types() and "hrm_text" not in listed_types()
    monkeypatch.delitem(hf_layout.UNFOLLOWED, "longcat_flash")
    with pytest.raises(RecipeError, match="it builds 3 decoder layers for num_hidden_layers 6"):
        _recipe(LONGCAT)
