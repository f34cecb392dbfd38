"""`model.family: hf`: transformers' own decoder-only models built from a config that is data.
The tuner's module computes what transformers' computes, its counts are the built model's, and
code-loading or undeclared config keys are refused before transformers sees them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml

from tuner.config import Config, shape_reasons
from tuner.models import family_of
from tuner.models.hf import hf_config, supported_types
from tuner.models.hf_nn import build_hf
from tuner.recipe import RecipeError, parse_recipe, recipe_from_dict
from tuner.workload.model import build_model

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 256}  # fmt: skip
CONFIGS = {t: {"model_type": t} | SMALL for t in ("llama", "qwen2", "mistral")}


def _recipe(config: dict, **model):
    return recipe_from_dict(
        {"name": "hf", "model": {"family": "hf", "seq_len": 16, "config": config} | model}
    )


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_forward_equals_transformers_own_on_the_same_weights(model_type):
    m = _recipe(CONFIGS[model_type]).model
    ours = build_model(m, "math", seed=3, device=torch.device("cpu"))
    theirs = build_hf(hf_config(m))
    # Same names under transformers' `model.` prefix (the head keeps its own): a strict load.
    theirs.load_state_dict(
        {(k if k.startswith("lm_head.") else "model." + k): v for k, v in ours.state_dict().items()}
    )
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(input_ids=batch).logits
        got = ours(batch)
    assert got.shape == (2, 16, 256)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# Models whose modules hold buffers, or whose norms start elsewhere than at one.
FIXED = {"gemma3_text": {"head_dim": 16}, "minicpm3": {"num_key_value_heads": 4}}


@pytest.mark.parametrize("model_type", list(FIXED))
def test_buffers_and_norms_start_where_transformers_own_init_puts_them(model_type):
    """A meta build materialised by `to_empty` left buffers as stray memory (Gemma's embedding
    scale read -5.8e-18 or 9.4e13 instead of 8: logits off by up to 16 against transformers on the
    same weights), and set Gemma's norms, which compute x * (1 + w), to ones instead of zeros."""
    m = _recipe({"model_type": model_type} | SMALL | FIXED[model_type]).model
    ours = build_model(m, "math", seed=3, device=torch.device("cpu"))
    theirs = build_hf(hf_config(m))  # built on the CPU: transformers' own init
    their_buffers = dict(theirs.named_buffers())
    buffers = dict(ours.named_buffers())
    assert buffers, "the model holds no buffer: the test checks nothing"
    for name, value in buffers.items():
        torch.testing.assert_close(value, their_buffers["model." + name], msg=name)
    their_params = dict(theirs.named_parameters())
    norms = [n for n, _ in ours.named_parameters() if "norm" in n]
    for name in norms:
        torch.testing.assert_close(
            dict(ours.named_parameters())[name], their_params["model." + name], msg=name
        )
    # With the drawn parameters loaded (and nothing else), the same logits.
    params = {(k if k.startswith("lm_head.") else "model." + k): v for k, v in ours.named_parameters()}
    theirs.load_state_dict(params, strict=False)
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(batch), theirs(input_ids=batch).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_sizes_and_counts_are_the_built_models(model_type):
    m = _recipe(CONFIGS[model_type]).model
    assert (m.layers, m.hidden, m.heads, m.vocab, m.ffn) == (2, 64, 4, 256, 96)
    assert m.kv_heads_count == 2
    family = family_of(m)
    with torch.device("meta"):
        built = build_hf(hf_config(m))
    assert family.param_count(m) == sum(p.numel() for p in built.parameters())
    linears = sum(p.numel() for n, p in built.model.layers.named_parameters() if p.dim() == 2)
    assert family.matmul_params(m) == linears + 64 * 256
    assert family.flops_per_token(m) > 6 * family.matmul_params(m)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("auto_map", {"AutoModelForCausalLM": "evil.Model"}),
        ("trust_remote_code", True),
        ("tokenizer_class", "X"),
        ("architectures", ["Qwen2ForCausalLM"]),
        ("rope_parameters", {"rope_type": "default", "loader_module": "os"}),
    ],
)
def test_code_loading_keys_are_field_errors(key, value):
    with pytest.raises(RecipeError) as err:
        _recipe(CONFIGS["qwen2"] | {key: value})
    assert f"model.config.{key}" in str(err.value)
    assert "code or a file" in str(err.value)


def test_unknown_keys_types_and_sizes_are_field_errors():
    with pytest.raises(RecipeError, match=r"model.config.hiden_size: qwen2's config declares no"):
        _recipe(CONFIGS["qwen2"] | {"hiden_size": 3})
    with pytest.raises(RecipeError) as err:
        _recipe({"model_type": "bert"} | SMALL)
    assert (
        "model.config.model_type" in str(err.value)
        and "qwen2" in str(err.value)
        and "llama" in str(err.value)
    )
    with pytest.raises(RecipeError, match=r"model.layers: 3 differs from model.config.num_hidden_layers"):
        _recipe(CONFIGS["qwen2"], layers=3)
    with pytest.raises(RecipeError, match=r"model.config: must be a mapping"):
        recipe_from_dict({"name": "x", "model": {"family": "hf", "seq_len": 16}})
    with pytest.raises(RecipeError, match=r"model.config: only the hf family has config"):
        recipe_from_dict({"name": "x", "model": {"family": "llama", "layers": 2, "hidden": 64, "heads": 4,
                                                 "seq_len": 16, "vocab": 256, "config": {}}})  # fmt: skip


def test_supported_types_are_decoder_only():
    types = supported_types()
    assert {"llama", "qwen2", "mistral"} <= set(types)
    assert not {"bert", "t5", "bart", "gpt2"} & set(types)


def test_a_model_transformers_runs_with_eager_attention_only_is_neither_listed_nor_taken():
    """Gemma 2 and gpt-oss were listed by `tuner models` and then refused with transformers' advice
    to pass attn_implementation="eager", a key the tuner refuses."""
    from tuner.models.catalog import models_catalog

    (hf,) = [f for f in models_catalog()["families"] if f["name"] == "hf"]
    assert "llama" in hf["model_types"] and not {"gemma2", "gpt_oss"} & set(hf["model_types"])
    with pytest.raises(RecipeError) as err:
        _recipe({"model_type": "gemma2", "head_dim": 16} | SMALL)
    assert err.value.problems == [("model.config.model_type", "transformers runs gemma2 with eager attention "
                                   "only, and the tuner drives SDPA's kernels; this model_type is not supported")]  # fmt: skip


def test_a_model_whose_forward_the_decoder_does_not_follow_is_not_listed():
    """doge and phi4_multimodal were listed by `tuner models` and offered to a wrong model_type,
    then refused ("the tuner's decoder cannot run it yet")."""
    from tuner.models.catalog import models_catalog
    from tuner.models.hf_layout import UNFOLLOWED

    (hf,) = [f for f in models_catalog()["families"] if f["name"] == "hf"]
    assert set(UNFOLLOWED) and not set(UNFOLLOWED) & set(hf["model_types"])


def test_splits_the_model_cannot_run_are_infeasible_with_the_reason():
    recipe = _recipe(CONFIGS["qwen2"])
    assert shape_reasons(Config.from_params({"tp": 2}), recipe) == []
    reasons = dict(shape_reasons(Config.from_params({"tp": 2, "sequence_parallel": True}), recipe))
    assert "sequence_parallel is not supported" in reasons["model.config"]
    tied = _recipe(CONFIGS["qwen2"] | {"tie_word_embeddings": True})
    reasons = dict(shape_reasons(Config.from_params({"pp": 2}), tied))
    assert "use pp = 1" in reasons["model.config.tie_word_embeddings"]


def test_the_recipe_hash_of_other_families_is_unchanged_by_the_config_field():
    llama = {"family": "llama", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 16, "vocab": 256}
    assert "config" not in recipe_from_dict({"name": "x", "model": llama}).model.hash_fields()


def test_a_bf16_model_runs_as_amp_o2_does():
    """amp=O2 keeps the parameters in bf16: the rotary tables follow the hidden states' dtype."""
    m = _recipe(CONFIGS["qwen2"]).model
    model = build_model(m, "math", seed=0, device=torch.device("cpu")).to(torch.bfloat16)
    batch = torch.randint(0, 256, (2, 16))
    logits = model(batch)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(model.loss(logits, batch))


# ---- bad config values: one (field, message) pair, the same on every entry point ---------------

TINY = Path(__file__).resolve().parent.parent / "recipes" / "hf-qwen2-tiny.yaml"


def _tiny(**config) -> dict:
    """recipes/hf-qwen2-tiny.yaml on the cpu (8 heads, 2 key/value heads) with config changed."""
    doc = yaml.safe_load(TINY.read_text())
    doc["hardware"]["device"] = "cpu"
    doc["model"]["config"].update(config)
    return doc


BAD_VALUES = {
    "kv_heads_zero": ({"num_key_value_heads": 0}, "model.config.num_key_value_heads", "integer from 1 to 1024"),
    "unknown_activation": ({"hidden_act": "bogus"}, "model.config.hidden_act", "use one of gelu"),
    "a_billion_layers": ({"num_hidden_layers": 10**9}, "model.config.num_hidden_layers", "integer from 1 to 512"),
    "kv_heads_not_dividing": ({"num_key_value_heads": 3}, "model.config.num_key_value_heads", "divisor of 8"),
    "size_as_text": ({"hidden_size": "256"}, "model.config.hidden_size", "not a whole number"),
    "size_as_bool": ({"vocab_size": True}, "model.config.vocab_size", "true is not a whole number"),
    "negative_eps": ({"rms_norm_eps": -1}, "model.config.rms_norm_eps", "set rms_norm_eps to a small positive"),
    "eps_as_yaml_text": ({"rms_norm_eps": "1e-6"}, "model.config.rms_norm_eps", "write it as a float"),
    "heads_not_dividing_width": ({"num_attention_heads": 6, "num_key_value_heads": 2},
                                 "model.config.num_attention_heads", "divisor of hidden_size"),
    # transformers' own refusal, its whole reason on one line (the second line used to be cut off)
    "int_eps": ({"rms_norm_eps": 1}, "model.config.rms_norm_eps", "transformers refused it: Validation error "
                "for field 'rms_norm_eps': TypeError: Field 'rms_norm_eps' expected float, got int"),
    # transformers reads 0 as a window in some models and as none in others
    "window_zero": ({"sliding_window": 0}, "model.config.sliding_window", "positive whole number"),
    # was accepted, then stored as null (YAML .inf, JSON 1e400)
    "infinite_float": ({"initializer_range": float("inf")}, "model.config.initializer_range", "not a finite number"),
    # was accepted; every trial then failed with torch's "dropout probability has to be between 0 and 1"
    "dropout_over_one": ({"attention_dropout": 2.5}, "model.config.attention_dropout", "a number from 0 to 1"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_bad_config_value_is_one_problem_naming_its_key(case):
    """Through parse_recipe, what `tuner plan/tune` (a file) and POST /v1/jobs, /v1/plans parse."""
    config, field, says = BAD_VALUES[case]
    supported_types()  # the one-off import of transformers' table is not the check's time
    start = time.process_time()
    with pytest.raises(RecipeError) as err:
        parse_recipe(yaml.safe_dump(_tiny(**config)))
    assert time.process_time() - start < 10  # a billion layers spun tens of CPU-seconds
    assert len(err.value.problems) == 1, err.value.problems
    (got_field, message), = err.value.problems  # fmt: skip
    assert got_field == field and says in message and "\n" not in message, message


def test_a_model_whose_layers_differ_is_refused_and_one_without_an_ffn_width_is_read():
    """glm4_moe_lite's first layers are dense and the rest experts: one block times the layers
    counted 12% of its parameters, so no config was pruned and the trials ran out of memory. A
    type without intermediate_size (solar_open) raised an AttributeError through every entry point."""
    from tuner.models.hf import _config_class, _declared

    def config(model_type):
        return {"model_type": model_type} | {
            k: v for k, v in SMALL.items() if k in _declared(_config_class(model_type))
        }

    with pytest.raises(RecipeError) as err:
        _recipe(config("glm4_moe_lite") | {"num_hidden_layers": 4})
    (field, message), = err.value.problems  # fmt: skip
    assert field == "model.config" and "layers differ in size" in message
    assert _recipe(config("solar_open")).model.ffn is None


def test_a_model_transformers_cannot_build_is_a_problem_not_a_traceback(monkeypatch):
    # A rope type the config lets through and the model's rotary embedding does not know.
    with pytest.raises(RecipeError) as err:
        parse_recipe(yaml.safe_dump(_tiny(rope_parameters={"rope_type": "bogus", "rope_theta": 1e4})))
    (field, message), = err.value.problems  # fmt: skip
    assert field.startswith("model.config") and "bogus" in message and "Traceback" not in message

    import tuner.models.hf_nn

    def broken(cfg):
        raise ZeroDivisionError("integer division or modulo by zero\n  while building layer 0")

    monkeypatch.setattr(tuner.models.hf_nn, "build_hf", broken)
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(_tiny(vocab_size=8200))  # a config the counts have not cached
    assert err.value.problems == [
        (
            "model.config",
            "transformers could not build the model: ZeroDivisionError: integer division or modulo "
            "by zero while building layer 0",
        )
    ]


def test_rest_answers_422_not_500_for_configs_that_used_to_crash(tmp_path):
    from fastapi.testclient import TestClient

    from api import Settings, create_app
    from api.auth import create_token
    from tuner.db import session_scope

    url = f"sqlite:///{tmp_path}/t.db"
    app = create_app(Settings(database_url=url, max_trials=50, max_timeout_min=60, max_body_bytes=65536))
    with TestClient(app) as client:
        with session_scope(url) as s:
            client.headers["Authorization"] = f"Bearer {create_token(s, 'tester')}"
        for route in ("/v1/jobs", "/v1/plans"):
            for key, value in (("num_key_value_heads", 0), ("hidden_act", "bogus")):
                r = client.post(route, json=_tiny(**{key: value}))
                assert r.status_code == 422, (route, key, r.text)
                fields = {e["field"]: e["message"] for e in r.json()["errors"]}
                assert f"model.config.{key}" in fields, r.text


def test_the_cli_plan_exits_2_naming_the_key(tmp_path):
    from typer.testing import CliRunner

    from tuner.cli.main import app

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_tiny(hidden_act="bogus")))
    result = CliRunner().invoke(app, ["plan", str(path)])
    out = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "model.config.hidden_act: 'bogus' is not an activation" in out and "Traceback" not in out


def test_the_keys_of_shipped_config_files_are_taken_as_transformers_takes_them():
    """`rope_theta` and `rope_scaling` are in every shipped Llama, Qwen2, Mistral and Gemma
    config.json, and Gemma 3's carry `rope_local_base_freq` and `sliding_window_pattern`: their
    config classes no longer declare them but read them. They were refused with "remove it",
    which left the model on the default rotary base without its scaling."""
    llama31 = {"model_type": "llama", "rope_theta": 500000.0, "max_position_embeddings": 16384,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}} | SMALL  # fmt: skip
    m = _recipe(llama31).model
    assert hf_config(m).rope_parameters["rope_theta"] == 500000.0
    assert hf_config(m).rope_parameters["rope_type"] == "llama3"
    gemma3 = {"model_type": "gemma3_text", "head_dim": 16, "rope_theta": 1e6, "rope_local_base_freq": 2e4,
              "sliding_window": 8, "sliding_window_pattern": 2} | SMALL  # fmt: skip
    cfg = hf_config(_recipe(gemma3).model)
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 2e4
    assert cfg.layer_types == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("seq_len", [8, 16])
def test_up_to_the_window_sliding_layers_run_causal_without_a_mask(seq_len):
    """transformers builds a mask for a sequence as long as the window, though it masks nothing
    causal attention does not: the decoder passes none there, so the kernels that take no mask
    (CUDA flash, cuDNN) may run it, and the feasibility rule agrees; beyond the window, the mask."""
    config = {"model_type": "mistral", "sliding_window": 8} | SMALL
    m = _recipe(config, seq_len=seq_len).model
    ours = build_model(m, "math", seed=3, device=torch.device("cpu"))
    batch = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(0))
    masked = ours._masks(ours.embed_tokens(batch))["sliding_attention"] is not None
    assert masked == family_of(m).masked_attention(m) == (seq_len > 8)
    theirs = build_hf(hf_config(m))
    theirs.load_state_dict(
        {(k if k.startswith("lm_head.") else "model." + k): v for k, v in ours.state_dict().items()}
    )
    with torch.no_grad():
        torch.testing.assert_close(ours(batch), theirs(input_ids=batch).logits, rtol=1e-5, atol=1e-5)


def test_an_aria_block_routes_each_token_to_moe_topk_experts():
    """Aria names its routed experts per token `moe_topk`: read as all eight, its FLOPs and MFU
    were about 4x too high."""
    from test_hf_types import tiny_config

    m = _recipe(tiny_config("aria_text", None)).model
    experts, top_k, _, _ = family_of(m).routed_experts(m)
    assert (experts, top_k) == (hf_config(m).moe_num_experts, hf_config(m).moe_topk) and top_k < experts
