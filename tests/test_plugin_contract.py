"""The plugin contract (`tuner.models.plugins`) held at the recipe check and the meta build: real
plugins installed as a distribution (tests/plugins/contract-plugins, a dist-info on sys.path), each
breaking one rule, are refused with a message naming the plugin and the fix, not met with a
traceback or a message that blames the recipe."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from plugin_env import install_test_plugin

from tuner.config import Config, shape_reasons
from tuner.models import family_of, plugins
from tuner.recipe import RecipeError, recipe_from_dict

CONTRACT_PLUGINS = Path(__file__).parent / "plugins" / "contract-plugins"
OPTIONS = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256}


@pytest.fixture(scope="module", autouse=True)
def contract_plugins():
    install_test_plugin()
    sys.path.insert(0, str(CONTRACT_PLUGINS))
    importlib.invalidate_caches()
    plugins.installed.cache_clear()
    plugins.load_plugin.cache_clear()
    yield
    sys.path.remove(str(CONTRACT_PLUGINS))
    plugins.installed.cache_clear()
    plugins.load_plugin.cache_clear()


def model(plugin: str, **options) -> dict:
    return {"family": "plugin", "plugin": plugin, "seq_len": 32, "options": OPTIONS | options}


def problem(section: dict) -> tuple[str, str]:
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({"name": "p", "model": section})
    (field, message), *_ = err.value.problems
    return field, message


def test_a_plugins_kv_heads_from_sizes_is_taken_and_checked():
    m = recipe_from_dict({"name": "p", "model": model("gqa")}).model
    assert (m.kv_heads, m.kv_heads_count, family_of(m).kv_heads(m)) == (2, 2, 2)
    rec = recipe_from_dict({"name": "p", "model": model("gqa", heads=8, hidden=64, kv_heads=4)})
    assert rec.model.kv_heads_count == 4
    assert shape_reasons(Config.from_params({"tp": 1}), rec) == []
    field, message = problem(model("gqa", kv_heads=3))
    assert field == "model.plugin"
    assert message.startswith("plugin 'gqa' sizes() returned kv_heads (3) must divide heads (4)")
    assert problem(model("gqa") | {"kv_heads": 4}) == (
        "model.kv_heads",
        "4 differs from the plugin's 2; remove it",
    )
    field, message = problem(model("tiny-moe") | {"kv_heads": 2})
    assert field == "model.kv_heads" and "plugin 'tiny-moe' does not take it; remove it" in message


@pytest.mark.parametrize(
    ("plugin", "said"),
    [
        ("no-return", "sizes() returned None, not a mapping of int layers, hidden, heads, vocab"),
        ("no-vocab", "sizes() returned no vocab; it must return a mapping of int layers, hidden"),
    ],
)
def test_a_plugin_whose_sizes_are_wrong_is_named_not_the_recipe(plugin, said):
    field, message = problem(model(plugin))
    assert field == "model.plugin"
    assert message.startswith(f"plugin {plugin!r} {said}")
    assert message.endswith("fix its package 'tuner-contract-plugins'")


@pytest.mark.parametrize(
    ("plugin", "said"),
    [
        ("no-attention-formula", "does not implement attention_matmul_params"),
        ("no-build", "names no nn_module and does not override build, parallelize, init_rule"),
    ],
)
def test_a_plugin_that_leaves_out_part_of_the_contract_is_refused_naming_it(plugin, said):
    field, message = problem(model(plugin))
    assert field == "model.plugin" and message.startswith(f"plugin {plugin!r} {said}")
    listed = {p["name"]: p for p in plugins.catalog()}
    assert said in listed[plugin]["error"]
    assert "error" not in listed["gqa"]


@pytest.mark.parametrize(
    ("plugin", "said"),
    [
        ("not-a-decoder", "build() returned a Sequential, not a tuner.models.layers.Decoder"),
        ("no-attention-name", "block 0 (PlainBlock) does not name its attention submodule in ATTENTION"),
    ],
)
def test_a_built_model_that_breaks_the_module_contract_fails_naming_the_fix(plugin, said):
    """Without the check: an `'Block' object has no attribute 'ATTENTION'` in every
    recompute=selective trial, or an error from deep inside the workload."""
    from tuner.workload.model import build_meta

    m = recipe_from_dict({"name": "p", "model": model(plugin)}).model
    with pytest.raises(ValueError) as err:
        build_meta(m, "math")
    assert str(err.value).startswith(f"plugin {plugin!r} (package 'tuner-contract-plugins'): {said}")
    assert len(build_meta(recipe_from_dict({"name": "p", "model": model("gqa")}).model, "math").layers) == 2
