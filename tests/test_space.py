"""Search spaces: every shipped YAML loads, the CPU space is feasible and large enough, errors name
the file and key, and sampling records only the knobs that apply."""

from __future__ import annotations

import random
from pathlib import Path

import optuna
import pytest
from plugin_env import install_test_plugin

from tuner.config import KNOBS, infeasible_reasons
from tuner.devices import describe
from tuner.recipe import load_recipe
from tuner.space import SPACES_DIR, SpaceError, config_from_params, load_space

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(ROOT.glob("recipes/**/*.yaml"))
CPU = describe("cpu")


def cpu_recipe(path: Path):
    recipe = load_recipe(path)
    # The example recipes say device: auto; the CPU space is checked for a CPU run of each.
    hw = recipe.hardware.model_copy(
        update={"device": "cpu", "devices": min(recipe.hardware.devices, CPU.count)}
    )
    return recipe.model_copy(update={"hardware": hw})


@pytest.mark.parametrize("path", sorted(SPACES_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_space_loads_with_values_its_family_supports(path):
    space = load_space(path.stem)
    assert space.family == path.stem
    assert set(space.domains) == set(KNOBS)
    if space.family == "cpu":
        assert set(space.domains["attention"]) <= set(CPU.attention_backends)
        assert set(space.domains["compile"]) <= set(CPU.compile_modes)
        assert space.domains["tf32"] == (False,) and space.domains["offload"] == (False,)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cpu_space_yields_only_feasible_configs_for_the_example_recipes(path):
    install_test_plugin()  # recipes/plugin-tiny-moe.yaml names the test plugin
    recipe = cpu_recipe(path)
    configs = list(load_space("cpu").configs(recipe, CPU))
    assert configs
    # The enumeration checks every config itself; re-checking a fixed sample keeps this test
    # seconds long on spaces of 60,000 configs (the hf recipe's).
    sample = random.Random(0).sample(configs, min(len(configs), 3000))
    assert all(not infeasible_reasons(c, recipe, CPU) for c in sample)
    assert len({c.key() for c in configs}) == len(configs), "the enumeration repeats a config"


def test_cpu_space_for_gpt_tiny_is_large_and_has_no_dead_values():
    recipe = cpu_recipe(ROOT / "recipes/gpt-tiny.yaml")
    space = load_space("cpu")
    configs = list(space.configs(recipe, CPU))
    assert len(configs) >= 200
    # Every value the space lists shows up in some feasible config: nothing there is unreachable.
    for name, domain in space.domains.items():
        if domain is not None:
            seen = {getattr(c, name) for c in configs}
            assert set(domain) <= seen, f"{name}: values {set(domain) - seen} never feasible"


def test_space_is_found_by_name_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_space("cpu").source == str(SPACES_DIR / "cpu.yaml")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("family: cpu\nknobs: {recompute: [none, sometimes]}\n", "knobs.recompute: recompute: 'sometimes'"),
        ("family: cpu\nknobs: {warp_speed: [1]}\n", "knobs.warp_speed: unknown knob"),
        (
            "family: cpu\nknobs: {micro_batch_size: [3]}\n",
            "knobs.micro_batch_size: micro_batch_size: 3 is not a power",
        ),
        ("family: cpu\nknobs: {amp: []}\n", "knobs.amp: expected a non-empty list"),
        ("family: cpu\nknobs: {tp: all}\n", "knobs.tp: expected a non-empty list of values or 'divisors'"),
        ("family: tpu\nknobs: {}\n", "family: 'tpu' is not a device family"),
        ("family: cpu\nknob: {}\n", "knob: unknown key"),
        ("family: cpu\nknobs: {amp: [O0, O0]}\n", "knobs.amp: 'O0' is listed twice"),
    ],
)
def test_loader_errors_name_the_file_and_the_key(tmp_path, text, expected):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(SpaceError) as err:
        load_space(path)
    assert str(err.value).startswith(str(path))
    assert expected in str(err.value)


def test_unknown_space_name_lists_the_known_ones():
    with pytest.raises(SpaceError, match="known spaces: cpu, cuda, npu"):
        load_space("gpu")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"recompute": ["none", "sometimes"]}, "search.overrides.recompute: recompute: 'sometimes'"),
        ({"attention": ["cudnn"]}, "search.overrides.attention: 'cudnn' is not in the cpu space"),
        ({"warp": [1]}, "search.overrides.warp: unknown knob"),
        ({"amp": []}, "search.overrides.amp: give a non-empty list"),
    ],
)
def test_override_errors_name_the_override(overrides, expected):
    with pytest.raises(SpaceError) as err:
        load_space("cpu").narrow(overrides)
    assert expected in str(err.value)


def test_narrow_keeps_only_the_listed_values():
    space = load_space("cpu").narrow({"recompute": ["full", "none"], "compile": ["none"], "tp": [1]})
    recipe = cpu_recipe(ROOT / "recipes/gpt-tiny.yaml")
    configs = list(space.configs(recipe, CPU))
    assert {c.recompute for c in configs} == {"full", "none"}
    assert {c.compile for c in configs} == {"none"}
    assert {(c.dp, c.tp, c.pp) for c in configs} == {(2, 1, 1), (1, 1, 2)}


def test_suggest_samples_a_valid_split_and_only_the_knobs_that_apply():
    recipe = cpu_recipe(ROOT / "recipes/gpt-tiny.yaml")
    space = load_space("cpu")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen_splits = set()
    for _ in range(40):
        trial = study.ask()
        config = space.suggest(trial, recipe, CPU)
        p = trial.params
        assert config.world_size == 2
        assert (p["dp"], p["tp"], p["pp"]) == (config.dp, config.tp, config.pp)
        assert ("pp_schedule" in p) == (config.pp > 1)
        assert ("dp_shard" in p) == (config.dp > 1)
        assert ("bucket_mb" in p) == ("grad_compression" in p) == (config.dp > 1 and config.dp_shard == "ddp")
        assert ("amp_dtype" in p) == (config.amp != "O0")
        assert config_from_params(p) == config
        assert space.contains(config, 2)
        seen_splits.add((config.dp, config.tp, config.pp))
        study.tell(trial, 1.0)
    assert seen_splits == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
