"""A recipe's hf config is refused the same way on every entry point: CLI (exit 2), REST (422)
and the nightly folder, each naming the field, before transformers sees the config."""

from __future__ import annotations

import pytest
from test_api import _fields, _submit, auth, client, url  # noqa: F401 - fixtures
from typer.testing import CliRunner

from tuner.cli.main import app

GOOD = (
    "{model_type: qwen2, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, intermediate_size: 96, vocab_size: 256"
)


def recipe(extra: str) -> str:
    return (
        "name: hf-bad\n"
        f"model: {{family: hf, seq_len: 32, config: {GOOD}{extra}}}}}\n"
        "hardware: {device: cpu, devices: 1}\nsearch: {trials: 3, timeout_min: 5}\n"
    )


BAD = {
    "auto_map": (", auto_map: {AutoModelForCausalLM: evil.Model}", "model.config.auto_map", "code or a file"),
    "trust_remote_code": (", trust_remote_code: true", "model.config.trust_remote_code", "code or a file"),
    "undeclared": (", expert_count: 8", "model.config.expert_count", "declares no 'expert_count'"),
    "model_type": (", model_type: bert", "model.config.model_type", "use one of"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_the_cli_exits_2_naming_the_field(tmp_path, case):
    extra, field, says = BAD[case]
    path = tmp_path / "r.yaml"
    path.write_text(recipe(extra).replace("model_type: qwen2, " if case == "model_type" else "@", ""))
    result = CliRunner().invoke(app, ["tune", str(path)])
    out = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"{field}:" in out and says in out
    assert "Traceback" not in out


@pytest.mark.parametrize("case", list(BAD))
def test_rest_answers_422_naming_the_field(client, auth, case):  # noqa: F811
    extra, field, says = BAD[case]
    text = recipe(extra).replace("model_type: qwen2, " if case == "model_type" else "@", "")
    resp = _submit(client, auth, text)
    assert resp.status_code == 422, resp.text
    assert says in _fields(resp)[field]


def test_the_nightly_folder_refuses_it_before_anything_runs(tmp_path):
    (tmp_path / "a.yaml").write_text(recipe(BAD["auto_map"][0]))
    result = CliRunner().invoke(app, ["nightly", str(tmp_path), "--local"])
    out = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "a.yaml: model.config.auto_map: names code or a file" in out
