"""A llama-only model field given to another family: the message names where that family takes the
same setting (hf: its config's key; a plugin: its options), not "set model.family", which would
send an hf or plugin user to the wrong fix."""

from __future__ import annotations

import pytest

from tuner.recipe import RecipeError, recipe_from_dict

HF = {"family": "hf", "seq_len": 32,
      "config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}}  # fmt: skip
GPT = {"family": "gpt", "layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32}


def problems(section: dict) -> list[tuple[str, str]]:
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({"name": "m", "model": section})
    return err.value.problems


@pytest.mark.parametrize(
    ("field", "value", "key"),
    [
        ("kv_heads", 2, "num_key_value_heads"),
        ("tie_embeddings", True, "tie_word_embeddings"),
        ("rope_theta", 10000.0, "rope_theta"),
        ("ffn_multiple_of", 64, "intermediate_size"),
    ],
)
def test_an_hf_recipe_is_told_the_config_key_that_sets_it(field, value, key):
    assert problems(HF | {field: value}) == [
        (f"model.{field}", f"the hf family does not read it; set model.config.{key} instead and remove it")
    ]
    # ... which the config takes.
    assert recipe_from_dict({"name": "m", "model": HF | {"config": HF["config"] | {key: value}}})
    # A built-in family is still told which family has the field.
    assert problems(GPT | {field: value}) == [
        (f"model.{field}", f"only the llama family has {field}; remove it or set model.family")
    ]


def test_a_plugin_recipe_is_told_to_use_the_plugins_options():
    from plugin_env import install_test_plugin

    install_test_plugin()
    section = {"family": "plugin", "plugin": "tiny-moe", "seq_len": 32, "rope_theta": 10000.0}
    ((field, message),) = problems(section)
    assert field == "model.rope_theta"
    assert message.startswith("the plugin family does not read it; remove it and set the plugin's own option")
