"""A build's `launch.sh` reproduces a config of the bring-your-own families (issue 17): written by
the build's own staging step (`write_launch`: spec.json and launch.sh, with the recipe inside), an
hf config's launch.sh trains transformers' model under torchrun, and a plugin config's launch.sh on
a Python without the plugin stops with one line naming the package to install.

Cheaper than tests/test_build.py: no study and no compile, just the staging and the launch of one
rank, which is what an hf or plugin config changes there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_env import install_test_plugin

from tuner.build.launch import write_launch
from tuner.config import Config
from tuner.models import family_of
from tuner.recipe import recipe_from_dict
from tuner.result import TrialSpec

pytestmark = pytest.mark.slow

HF = {
    "name": "hf-launch",
    "model": {
        "family": "hf",
        "seq_len": 32,
        "config": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 256},
    },
    "train": {"global_batch_size": 2},
    "hardware": {"device": "cpu", "devices": 1},
    "measure": {"warmup_steps": 1, "steps": 2, "timeout_s": 300},
}  # fmt: skip
PLUGIN = {**HF, "name": "moe-launch", "model": {"family": "plugin", "plugin": "tiny-moe", "seq_len": 32}}


def _stage(tmp_path: Path, data: dict) -> Path:
    """What `tuner build` stages for the recipe's config (micro-batch 2, one rank, eager)."""
    recipe = recipe_from_dict(data)
    config = Config.from_params({"micro_batch_size": 2})
    spec = TrialSpec(recipe=recipe.to_dict(), config=config.to_dict(), family="cpu", workdir="run",
                     timeout_s=recipe.measure.timeout_s, seed=0, tag="launch-0")  # fmt: skip
    stage = tmp_path / "build"
    stage.mkdir()
    write_launch(stage, spec, recipe, 0, f"{recipe.name}-study", 1000.0, "CPU")
    return stage


def _launch(stage: Path, **env: str) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        ["bash", str(stage / "launch.sh")], env={**os.environ, "PATH": path, **env},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_launch_sh_of_an_hf_config_trains_transformers_model(tmp_path):
    stage = _stage(tmp_path, HF)
    spec = json.loads((stage / "spec.json").read_text())
    assert spec["recipe"]["model"]["config"]["model_type"] == "qwen2"  # the recipe travels with the build
    assert "transformers" in (stage / "launch.sh").read_text()  # checked before any rank starts
    run = _launch(stage)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((stage / "run" / "result.json").read_text())
    assert result["status"] == "ok" and result["tokens_per_s"] > 0
    m = recipe_from_dict(HF).model
    assert result["extra"]["ranks"][0]["params"] == family_of(m).param_count(m)  # transformers' qwen2


def test_launch_sh_of_a_plugin_config_without_the_plugin_says_what_to_install(tmp_path):
    install_test_plugin()
    stage = _stage(tmp_path, PLUGIN)
    # A Python without the plugin: this interpreter with its site-packages left out (-S).
    bare = tmp_path / "python-without-plugins"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    run = _launch(stage, PYTHON=str(bare))
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"launch.sh: this config needs the model plugin 'tiny-moe' (package tuner-test-plugin 0.1.0 in the "
        f"measured run), which {bare} does not have; install it: pip install 'tuner-test-plugin==0.1.0'"
    ]
    assert not (stage / "run").exists()  # no rank started
