"""Knob parsing and the feasibility rules: each rule rejects its case and says why."""

from __future__ import annotations

import dataclasses

import pytest

from tuner.config import KNOBS, Config, ConfigError, infeasible_reasons, microbatches
from tuner.devices import DeviceInfo, describe
from tuner.recipe import recipe_from_dict

CPU = DeviceInfo(
    family="cpu",
    name="test cpu",
    count=8,
    memory_bytes=16 * 2**30,
    backend="gloo",
    attention_backends=("math", "flash"),
    amp_dtypes=("bf16", "fp16"),
    compile_modes=("none", "default", "max-autotune"),
)
OLD_GPU = DeviceInfo(
    family="cuda",
    name="Tesla V100",
    count=8,
    memory_bytes=32 * 2**30,
    backend="nccl",
    attention_backends=("math", "efficient"),
    amp_dtypes=("fp16",),
    compile_modes=("none", "default", "max-autotune", "reduce-overhead"),
    supports_pin_memory=True,
    supports_offload=True,
)
ASCEND = dataclasses.replace(OLD_GPU, family="npu", name="Ascend910B2", backend="hccl", amp_dtypes=("bf16",))


def recipe(devices=4, layers=4, heads=4, hidden=128, vocab=2048, gbs=16, ffn=None):
    model = {"layers": layers, "hidden": hidden, "heads": heads, "seq_len": 64, "vocab": vocab}
    if ffn:
        model["ffn"] = ffn
    return recipe_from_dict(
        {"name": "t", "model": model, "train": {"global_batch_size": gbs}, "hardware": {"devices": devices}}
    )


# ---- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"recompute": "sometimes"}, "valid values: none, selective, full"),
        ({"attention": "fast"}, "valid values: math, flash, efficient, cudnn, npu_fusion"),
        ({"amp": "O3"}, "valid values: O0, O1, O2"),
        ({"compile": "yes"}, "valid values: none, default, max-autotune, reduce-overhead"),
        ({"offload": "maybe"}, "offload: 'maybe' is not a boolean; use true or false"),
        ({"tp": "two"}, "tp: 'two' is not an integer"),
        ({"dp": 0}, "dp: must be an integer >= 1"),
        ({"micro_batch_size": 3}, "micro_batch_size: 3 is not a power of two"),
        ({"loader_workers": -1}, "loader_workers: must be an integer >= 0"),
        ({"bucket_mb": 2.5}, "bucket_mb: 2.5 is not an integer"),
        # accepted, then a torch Reducer dump in the trial; a process per worker
        ({"bucket_mb": 10**14}, "bucket_mb: must be at most 1,048,576"),
        ({"loader_workers": 100_000}, "loader_workers: must be at most 256"),
        ({"tp": 2**40}, "tp: must be at most 2,147,483,647"),
    ],
)
def test_bad_knob_value_lists_what_is_valid(params, words):
    with pytest.raises(ConfigError) as info:
        Config.from_params(params)
    assert words in str(info.value)


def test_unknown_knob_lists_every_knob():
    with pytest.raises(ConfigError) as info:
        Config.from_params({"microbatch": 2})
    message = str(info.value)
    assert "unknown knob 'microbatch'" in message
    assert all(name in message for name in KNOBS)


def test_strings_from_the_cli_parse_to_typed_values():
    c = Config.from_params({"micro_batch_size": "4", "offload": "true", "tf32": "0", "tp": "2"})
    assert (c.micro_batch_size, c.offload, c.tf32, c.tp) == (4, True, False, 2)
    assert Config.from_params({"amp": "O1"}, base=c).micro_batch_size == 4


def test_knobs_that_do_not_apply_do_not_make_configs_different():
    a = Config(dp=1, bucket_mb=5, dp_shard="fsdp", pp_schedule="gpipe", amp_dtype="fp16")
    assert a.key() == Config().key()
    assert "bucket_mb" not in a.active_params() and "pp_schedule" not in a.active_params()
    assert Config(dp=2, bucket_mb=5).key() != Config(dp=2).key()


# ---- feasibility ----------------------------------------------------------------------------------


def test_default_split_is_feasible():
    assert infeasible_reasons(Config(dp=4), recipe(), CPU) == []
    assert microbatches(Config(dp=4, micro_batch_size=2), recipe()) == 2


# (case, config, recipe, device, words every reason list must contain)
RULES = [
    ("world size", Config(dp=2), recipe(devices=4), CPU, "dp*tp*pp = 2*1*1 = 2, but hardware.devices is 4"),
    ("machine too small", Config(dp=16), recipe(devices=16), CPU, "this machine has 8 cpu devices"),
    ("heads % tp", Config(dp=1, tp=4), recipe(heads=2, hidden=128), CPU, "heads (2) not divisible by tp (4)"),
    (
        "ffn % tp",
        Config(dp=1, tp=4),
        recipe(ffn=30, hidden=128),
        CPU,
        "ffn size (30) not divisible by tp (4)",
    ),
    ("vocab % tp", Config(dp=1, tp=4), recipe(vocab=2050), CPU, "vocab (2050) not divisible by tp (4)"),
    ("layers % pp", Config(dp=1, pp=4), recipe(layers=6), CPU, "layers (6) not divisible by pp (4)"),
    (
        "gbs % (mbs*dp)",
        Config(dp=4, micro_batch_size=8),
        recipe(gbs=16),
        CPU,
        "global batch (16) not divisible by micro_batch_size*dp (8*4 = 32)",
    ),
    (
        "pp microbatches",
        Config(dp=1, pp=4, micro_batch_size=8),
        recipe(gbs=16),
        CPU,
        "pp=4 needs at least 4 microbatches per step, but global batch 16 / (micro_batch_size*dp) gives 2",
    ),
    (
        "flash absent",
        Config(dp=4, attention="flash"),
        recipe(),
        OLD_GPU,
        "attention=flash is not available on cuda",
    ),
    ("cudnn on cpu", Config(dp=4, attention="cudnn"), recipe(), CPU, "(available: math, flash)"),
    ("tf32 on cpu", Config(dp=4, tf32=True), recipe(), CPU, "tf32 is not supported on cpu"),
    (
        "bf16 on V100",
        Config(dp=4, amp="O1", amp_dtype="bf16"),
        recipe(),
        OLD_GPU,
        "amp_dtype=bf16 is not supported",
    ),
    (
        "cuda graphs on cpu",
        Config(dp=4, compile="reduce-overhead"),
        recipe(),
        CPU,
        "compile=reduce-overhead is not available",
    ),
    ("offload on cpu", Config(dp=4, offload=True), recipe(), CPU, "on cpu they already are there"),
    ("pin_memory on cpu", Config(dp=4, pin_memory=True), recipe(), CPU, "pin_memory needs an accelerator"),
    (
        "bf16 hook on V100",
        Config(dp=4, grad_compression="bf16"),
        recipe(),
        OLD_GPU,
        "grad_compression=bf16 is not supported on cuda",
    ),
    (
        "powersgd on hccl",
        Config(dp=4, grad_compression="powersgd"),
        recipe(),
        ASCEND,
        "powersgd is not supported with hccl",
    ),
    ("fsdp with pp", Config(dp=2, pp=2, dp_shard="fsdp"), recipe(), CPU, "dp_shard=fsdp with pp > 1"),
    (
        "fp16 O2 fsdp",
        Config(dp=4, dp_shard="fsdp", amp="O2", amp_dtype="fp16"),
        recipe(),
        CPU,
        "needs a sharded grad scaler",
    ),
    (
        "cuda graphs with tp",
        Config(dp=2, tp=2, compile="reduce-overhead"),
        recipe(),
        OLD_GPU,
        "does not support tp or pp",
    ),
    (
        "cuda graphs of the layers",
        Config(dp=4, compile="reduce-overhead"),
        recipe(),
        OLD_GPU,
        "a replay overwrites a layer's output still in use",
    ),
    (
        "offload with compile",
        Config(dp=4, offload=True, compile="default"),
        recipe(),
        OLD_GPU,
        "cannot be traced",
    ),
]


@pytest.mark.parametrize(("case", "config", "rec", "device", "words"), RULES, ids=[r[0] for r in RULES])
def test_each_rule_rejects_and_explains(case, config, rec, device, words):
    reasons = infeasible_reasons(config, rec, device)
    assert any(words in r for r in reasons), f"{case}: {reasons}"


def test_every_reason_is_reported_at_once():
    bad = Config(dp=1, tp=4, pp=2, tf32=True, attention="cudnn")
    reasons = infeasible_reasons(bad, recipe(devices=4, heads=2, layers=3), CPU)
    assert len(reasons) >= 5, reasons


def test_this_machines_cpu_runs_the_plain_config():
    assert infeasible_reasons(Config(dp=1), recipe(devices=1), describe("cpu")) == []


def test_tensor_parallel_groups_stay_inside_a_node():
    two_nodes = recipe_from_dict(
        {"name": "n", "model": {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 2048},
         "train": {"global_batch_size": 16}, "hardware": {"devices": 4, "nodes": 2}}
    )  # fmt: skip
    cpu = describe("cpu")
    assert any(
        "tp (4) must divide the devices per node (2)" in r
        for r in infeasible_reasons(Config(tp=4), two_nodes, cpu)
    )
    inside = [r for r in infeasible_reasons(Config(dp=2, tp=2), two_nodes, cpu) if "per node" in r]
    assert not inside  # tp=2 within each node of 2, dp=2 across the nodes
