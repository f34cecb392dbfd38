"""An hf (transformers) qwen2 as real groups of gloo ranks: dp2, tp2 (from the model's own
base_model_tp_plan), pp2 (by the decoder layer list) and FSDP2 over dp2 (transformers' modules
sharded by `fully_shard`) train the same model as one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_workload_ranks import launch_ranks

pytestmark = pytest.mark.slow

QWEN2 = {
    "family": "hf",
    "seq_len": 32,
    "config": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 256},
}  # fmt: skip


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tuner-cache")


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache_dir) -> dict[str, Any]:
    run = launch_ranks(tmp_path_factory.mktemp("single-hf"), 1, cache_dir=cache_dir, model=QWEN2)
    assert run.exit_codes == [0], run.log
    return run.result


SPLITS = {
    "dp2": {"dp": 2},
    "tp2": {"tp": 2, "recompute": "selective", "recompute_layers": 0.5},
    "pp2": {"pp": 2, "recompute": "full"},
    "fsdp2": {"dp": 2, "dp_shard": "fsdp"},
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_every_split_trains_the_same_hf_model_as_one_process(tmp_path, cache_dir, single, split):
    knobs = SPLITS[split]
    run = launch_ranks(tmp_path, 2, knobs, cache_dir=cache_dir, model=QWEN2)
    result = run.result
    assert result["status"] == "ok", run.log[-3000:]
    assert result["losses"] == pytest.approx(single["losses"], rel=1e-4)
    if split == "tp2":
        total = single["extra"]["ranks"][0]["params"]
        # The Linears of the blocks and the vocabulary-sized embedding and head are halved.
        assert all(total / 2 < r["params"] < 0.55 * total for r in run.ranks()), [
            r["params"] for r in run.ranks()
        ]
    if split == "fsdp2":
        # Each rank holds half of every parameter (FSDP2 shards dim 0; odd sizes pad a little).
        total = single["extra"]["ranks"][0]["params"]
        assert all(r["fsdp"] and r["params"] == pytest.approx(total / 2, rel=0.02) for r in run.ranks())
