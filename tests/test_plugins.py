"""Operator-installed model plugins (`model.family: plugin`): the test plugin package under
tests/plugins is installed into the environment, named by recipes, its options checked by its own
schema, listed by `tuner models` and GET /v1/models, trained like a built-in family, and tuned end
to end through a real `tuner serve`."""

from __future__ import annotations

import pytest
import torch
from plugin_env import install_test_plugin
from test_api import _fields, _submit, auth, client, url  # noqa: F401 - fixtures
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.config import Config, shape_reasons
from tuner.models import family_of
from tuner.recipe import RecipeError, recipe_from_dict
from tuner.workload.model import build_model

MODEL = {
    "family": "plugin",
    "plugin": "tiny-moe",
    "seq_len": 32,
    "options": {"experts": 4, "expert_hidden": 64},
}


@pytest.fixture(scope="module", autouse=True)
def installed_plugin():
    install_test_plugin()


def recipe_text(model: str) -> str:
    return f"name: moe\nmodel: {model}\nhardware: {{device: cpu, devices: 1}}\nsearch: {{trials: 3, timeout_min: 5}}\n"


def test_a_plugin_recipe_builds_what_its_formulas_count():
    m = recipe_from_dict({"name": "moe", "model": MODEL}).model
    assert (m.layers, m.hidden, m.heads, m.vocab) == (2, 64, 4, 256)  # the plugin's defaults
    family = family_of(m)
    model = build_model(m, "math", seed=0, device=torch.device("cpu"))
    assert family.param_count(m) == sum(p.numel() for p in model.parameters())
    batch = torch.randint(0, 256, (2, 32))
    loss = model.loss(model(batch), batch)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # a fresh model: ~uniform
    reasons = dict(
        shape_reasons(Config.from_params({"tp": 2}), recipe_from_dict({"name": "m", "model": MODEL}))
    )
    assert "no tensor-parallel plan" in reasons["model.plugin"]


@pytest.mark.slow
def test_a_trial_rank_of_a_plugin_that_builds_its_own_model_starts(tmp_path):
    """tiny-moe overrides `build` and names no `nn_module`: the rank's preload before its memory
    baseline once imported '' and every trial of it ended 'Empty module name'."""
    from tuner.executors.local import run_trial
    from tuner.result import TrialSpec

    rec = recipe_from_dict({"name": "moe", "model": MODEL, "train": {"global_batch_size": 2},
                            "hardware": {"device": "cpu", "devices": 1},
                            "measure": {"warmup_steps": 1, "steps": 1}})  # fmt: skip
    family_of(rec.model).preload(rec.model)
    spec = TrialSpec(recipe=rec.to_dict(), config=Config().to_dict(), family="cpu", workdir=str(tmp_path))
    result = run_trial(spec)
    assert result.status == "ok", result.error


def test_unknown_plugins_and_bad_options_are_field_errors():
    with pytest.raises(
        RecipeError, match=r"model.plugin: 'nope' is not an installed model plugin; installed: .*tiny-moe"
    ):
        recipe_from_dict({"name": "m", "model": MODEL | {"plugin": "nope"}})
    with pytest.raises(
        RecipeError, match=r"model.options.experts: Input should be greater than or equal to 1"
    ):
        recipe_from_dict({"name": "m", "model": MODEL | {"options": {"experts": 0}}})
    with pytest.raises(RecipeError, match=r"model.options.routing: Extra inputs are not permitted"):
        recipe_from_dict({"name": "m", "model": MODEL | {"options": {"routing": "top2"}}})
    with pytest.raises(RecipeError, match=r"model.plugin: only the plugin family has plugin"):
        recipe_from_dict({"name": "m", "model": {"family": "gpt", "layers": 2, "hidden": 64, "heads": 4,
                                                 "seq_len": 32, "vocab": 256, "plugin": "tiny-moe"}})  # fmt: skip


def test_a_plugin_that_fails_to_load_is_a_field_error_naming_it(monkeypatch):
    """An installed entry point whose module is gone (a half-uninstalled package) raised through
    every recipe parse: a 500 over REST, a traceback from the CLI."""
    from importlib.metadata import EntryPoint

    import tuner.models.plugins as plugins

    broken = EntryPoint(name="broken", value="broken_plugin_missing:Family", group=plugins.GROUP)
    monkeypatch.setattr(plugins, "installed", lambda: {"broken": broken})
    plugins.load_plugin.cache_clear()
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({"name": "p", "model": {"family": "plugin", "plugin": "broken", "seq_len": 16}})
    (field, message), = err.value.problems  # fmt: skip
    assert field == "model.plugin" and "failed to load (ModuleNotFoundError" in message


def test_unknown_plugin_on_the_cli_rest_and_nightly_folder(tmp_path, client, auth):  # noqa: F811
    text = recipe_text("{family: plugin, plugin: nope, seq_len: 32}")
    path = tmp_path / "a.yaml"
    path.write_text(text)
    for args in (["tune", str(path)], ["nightly", str(tmp_path), "--local"]):
        result = CliRunner().invoke(app, args)
        out = " ".join(result.output.split())
        assert result.exit_code == 2, result.output
        assert "model.plugin: 'nope' is not an installed model plugin" in out and "tiny-moe" in out
    resp = _submit(client, auth, text)
    assert resp.status_code == 422
    assert "installed: tiny-moe" in _fields(resp)["model.plugin"]


def test_models_are_listed_with_option_schemas(client, auth):  # noqa: F811
    resp = client.get("/v1/models", headers=auth)
    assert resp.status_code == 200
    body = resp.json()
    assert {f["name"] for f in body["families"]} >= {"gpt", "llama", "hf", "plugin"}
    hf = next(f for f in body["families"] if f["name"] == "hf")
    assert {"llama", "qwen2", "mistral"} <= set(hf["model_types"])
    moe = next(p for p in body["plugins"] if p["name"] == "tiny-moe")
    assert moe["options"]["properties"]["experts"]["minimum"] == 1
    assert (moe["package"], moe["version"]) == ("tuner-test-plugin", "0.1.0")
    # Each example (the dashboard's "Start from") is a model section that validates as it is.
    examples = [f["example"] for f in body["families"] if "example" in f]
    examples += [p["example"] for p in body["plugins"]]
    assert {e["family"] for e in examples} == {"gpt", "llama", "hf", "plugin"}
    for example in examples:
        assert recipe_from_dict({"name": "x", "model": example}).model.family == example["family"]
    out = " ".join(CliRunner().invoke(app, ["models"]).output.split())
    assert "tiny-moe:" in out and "options.experts: integer Expert MLPs per block. (default 4)" in out


@pytest.mark.slow
def test_the_plugin_is_tuned_end_to_end_through_rest(tmp_path):
    import httpx
    from test_api_server import Server, follow

    server = Server(tmp_path, None, workers=1)
    try:
        token = server.tuner("token", "create", "--name", "plugin")
        auth = {"Authorization": f"Bearer {token}"}
        server.start()
        text = (
            "name: moe-e2e\nmodel: {family: plugin, plugin: tiny-moe, seq_len: 32, options: {experts: 2}}\n"
            "train: {global_batch_size: 4}\nhardware: {device: cpu, devices: 1}\n"
            "search: {trials: 2, timeout_min: 10, overrides: {compile: [none]}}\n"
            "measure: {warmup_steps: 1, steps: 2, timeout_s: 120}\n"
        )
        resp = httpx.post(
            f"{server.base}/v1/jobs", content=text, headers={**auth, "Content-Type": "application/yaml"}
        )
        assert resp.status_code == 202, resp.text
        job = resp.json()["id"]
        done = follow(server, token, job, {"done"}, timeout=400)[-1]
        assert done["data"]["state"] == "succeeded", f"{done}\n{server.log()}"
        best = httpx.get(f"{server.base}/v1/jobs/{job}/best", headers=auth, timeout=60)
        assert best.status_code == 200 and best.json()["tokens_per_s"] > 0, best.text
    finally:
        server.stop()
