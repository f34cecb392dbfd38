"""The recipe document: every bad input names its field, and the hash tracks only the measurement."""

from __future__ import annotations

import copy

import pytest
import yaml

from tuner.recipe import RecipeError, load_recipe, parse_recipe, recipe_from_dict

GOOD = {
    "name": "gpt-tiny",
    "model": {"family": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 2048},
    "train": {"global_batch_size": 16, "optimizer": "adamw", "lr": 3.0e-4},
    "hardware": {"device": "auto", "devices": 2, "memory_budget_gb": None},
    "search": {"space": "cpu", "trials": 30, "timeout_min": 30, "sampler": "tpe", "seed": 0},
    "measure": {"warmup_steps": 2, "steps": 5},
}


def with_(path: str, value, base=GOOD):
    """GOOD with one dotted field set (value DELETE removes it)."""
    doc = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = doc
    for p in parents:
        node = node[p]
    if value is DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return doc


DELETE = object()

# (case, document, field the message must name, words the message must contain)
BAD_DOCS = [
    ("unknown top-level field", with_("tunning", {}), "tunning", "unknown field"),
    ("unknown nested field", with_("model.layer", 4), "model.layer", "unknown field"),
    ("missing model", with_("model", DELETE), "model", "required"),
    ("missing name", with_("name", DELETE), "name", "required"),
    ("missing model size", with_("model.hidden", DELETE), "model.hidden", "required"),
    ("negative layers", with_("model.layers", -2), "model.layers", "greater than or equal to 1"),
    ("an ffn no memory holds", with_("model.ffn", 10**26), "model.ffn", "less than or equal to 1048576"),
    ("hidden not divisible by heads", with_("model.heads", 5), "model", "divisible by heads"),
    ("unknown family", with_("model.family", "llama-from-url"), "model.family", "'gpt'"),
    ("bad device", with_("hardware.device", "tpu"), "hardware.device", "'cpu'"),
    ("zero devices", with_("hardware.devices", 0), "hardware.devices", "greater than or equal to 1"),
    ("string for int", with_("model.layers", "four"), "model.layers", "integer"),
    ("unknown sampler", with_("search.sampler", "bayes"), "search.sampler", "'tpe'"),
    ("trials 0", with_("search.trials", 0), "search.trials", "greater than or equal to 1"),
    (
        "negative budget",
        with_("hardware.memory_budget_gb", -1),
        "hardware.memory_budget_gb",
        "greater than 0",
    ),
    ("zero steps", with_("measure.steps", 0), "measure.steps", "greater than or equal to 1"),
    ("unknown optimizer", with_("train.optimizer", "lion"), "train.optimizer", "'adamw'"),
    ("boolean for int", with_("measure.warmup_steps", False), "measure.warmup_steps", "integer"),
    ("quoted int", with_("hardware.devices", "2"), "hardware.devices", "integer"),
    ("boolean for number", with_("train.lr", True), "train.lr", "number"),
    ("section not a mapping", with_("train", [16]), "train", "dictionary"),
    ("zero nodes", with_("hardware.nodes", 0), "hardware.nodes", "greater than or equal to 1"),
    ("devices not split over nodes", with_("hardware.nodes", 3), "hardware", "multiple of nodes (3)"),
]


@pytest.mark.parametrize(("case", "doc", "field", "words"), BAD_DOCS, ids=[c[0] for c in BAD_DOCS])
def test_bad_recipe_names_the_field(case, doc, field, words):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(doc, source="r.yaml")
    fields = [f for f, _ in info.value.problems]
    assert field in fields, f"{case}: {info.value}"
    message = str(info.value)
    assert f"r.yaml: {field}:" in message
    assert words in message


def test_every_fault_is_reported_at_once():
    doc = with_("search.trials", 0, with_("model.layers", -1))
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(doc)
    assert {f for f, _ in info.value.problems} == {"model.layers", "search.trials"}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("name: x\nmodel: {layers: 4\n", "not valid YAML or JSON at line"),
        ("- name: x\n- model: {}\n", "must be a mapping"),
        ("just a string", "must be a mapping"),
        ("", "must be a mapping"),
    ],
    ids=["bad yaml", "a list", "a scalar", "empty"],
)
def test_unparseable_documents(text, words):
    with pytest.raises(RecipeError, match=words):
        parse_recipe(text, source="r.yaml")


def test_missing_file_says_so(tmp_path):
    with pytest.raises(RecipeError, match="cannot read recipe file"):
        load_recipe(tmp_path / "nope.yaml")


def test_exponent_floats_from_yaml_are_numbers():
    # PyYAML (YAML 1.1) reads 3e-4 as the string "3e-4"; users write it that way all the time.
    recipe = parse_recipe(
        "name: x\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 32, vocab: 256}\ntrain: {lr: 3e-4}\n"
    )
    assert recipe.train.lr == pytest.approx(3e-4)


def test_only_name_and_model_are_required():
    r = recipe_from_dict({"name": "m", "model": GOOD["model"]})
    assert r.train.global_batch_size == 16 and r.hardware.devices == 1 and r.search.trials == 30


def test_json_and_yaml_give_the_same_recipe(tmp_path):
    import json

    (tmp_path / "r.json").write_text(json.dumps(GOOD))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(GOOD))
    assert load_recipe(tmp_path / "r.json") == load_recipe(tmp_path / "r.yaml")


def test_shipped_recipes_load():
    for name in ("gpt-tiny", "gpt-small"):
        assert load_recipe(f"recipes/{name}.yaml").name == name


def test_hash_is_stable_and_ignores_name_and_budget():
    base = recipe_from_dict(GOOD)
    # A fixed value: a change here silently orphans every stored study keyed by the old hash.
    assert base.hash() == "54e6a326cb78ac5c"
    same = [
        with_("name", "renamed"),
        with_("search.trials", 500),
        with_("search.timeout_min", 5),
        with_("search.sampler", "random"),
        with_("measure.timeout_s", 30),
    ]
    for doc in same:
        assert recipe_from_dict(doc).hash() == base.hash(), doc
    different = [
        with_("model.layers", 8),
        with_("train.global_batch_size", 32),
        with_("hardware.devices", 1),
        with_("measure.steps", 10),
    ]
    for doc in different:
        assert recipe_from_dict(doc).hash() != base.hash(), doc


def test_hash_ignores_key_order():
    reordered = dict(reversed(list(GOOD.items())))
    reordered["model"] = dict(reversed(list(GOOD["model"].items())))
    assert recipe_from_dict(reordered).hash() == recipe_from_dict(GOOD).hash()


def test_a_single_node_recipe_hashes_as_before_nodes_existed():
    """Studies are found by recipe hash: adding `hardware.nodes` must not orphan them."""
    assert recipe_from_dict(GOOD).hash() == recipe_from_dict(with_("hardware.nodes", 1)).hash()
    assert recipe_from_dict(GOOD).hash() != recipe_from_dict(with_("hardware.nodes", 2)).hash()
    assert recipe_from_dict(with_("hardware.nodes", 2)).hardware.devices_per_node == 1
