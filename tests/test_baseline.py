"""The baseline a study measures first is what a careful user would pick on that device: AMP with
a dtype the device runs natively, fp32 where low precision would only be emulated."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tuner import devices
from tuner.baseline import baseline_config
from tuner.recipe import recipe_from_dict
from tuner.space import load_space

AVX512_ONLY = {"architecture": "x86_64", "avx2": True, "avx512_f": True, "avx512_bw": True}


@pytest.fixture
def describe(monkeypatch):
    """`devices.describe` of a made-up machine, fed through the same torch reports it reads."""

    def _describe(family, *, cpu=None, gpu=None):
        if family == "cpu":
            monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**AVX512_ONLY, **(cpu or {})})
        if family == "cuda":
            name, major, minor = gpu
            props = types.SimpleNamespace(name=name, major=major, minor=minor, total_memory=32 * 2**30)
            monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
            monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
        if family == "npu":
            monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
            npu = types.SimpleNamespace(
                is_available=lambda: True,
                device_count=lambda: 8,
                get_device_name=lambda i=0: "Ascend910B2",
                get_device_properties=lambda i=0: types.SimpleNamespace(total_memory=64 * 2**30),
            )
            monkeypatch.setattr(torch, "npu", npu, raising=False)
        devices.describe.cache_clear()
        return devices.describe(family)

    yield _describe
    devices.describe.cache_clear()


def tiny(family: str, overrides: dict | None = None):
    return recipe_from_dict(
        {
            "name": "tiny",
            "model": {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 2048},
            "train": {"global_batch_size": 16},
            "hardware": {"device": family, "devices": 1},
            "search": {"space": family, "overrides": overrides or {}},
        }
    )


def precision(recipe, device) -> tuple[str, str | None]:
    space = load_space(recipe.search.space).narrow(recipe.search.overrides)
    base = baseline_config(recipe, device, space)
    return base.amp, base.amp_dtype if base.amp != "O0" else None


def test_cpu_without_bf16_units_gets_an_fp32_baseline(describe):
    # AVX-512 but no AVX512-BF16/AMX (this CI machine): bf16 autocast measured ~10x slower.
    assert precision(tiny("cpu"), describe("cpu")) == ("O0", None)


@pytest.mark.parametrize("isa", [{"avx512_bf16": True}, {"amx_tile": True, "amx_bf16": True}])
def test_cpu_with_bf16_units_gets_bf16_autocast(describe, isa):
    assert precision(tiny("cpu"), describe("cpu", cpu=isa)) == ("O1", "bf16")


@pytest.mark.parametrize("gpu", [("NVIDIA A100-SXM4-80GB", 8, 0), ("NVIDIA H100 80GB HBM3", 9, 0)])
def test_ampere_and_later_get_bf16_autocast(describe, gpu):
    assert precision(tiny("cuda"), describe("cuda", gpu=gpu)) == ("O1", "bf16")


@pytest.mark.parametrize("gpu", [("Tesla V100-SXM2-32GB", 7, 0), ("Tesla T4", 7, 5)])
def test_volta_and_turing_get_fp16_autocast_where_the_space_has_it(describe, gpu):
    device = describe("cuda", gpu=gpu)
    assert precision(tiny("cuda"), device) == ("O1", "fp16")
    # A space narrowed to bf16 has no fast dtype left for these cards: fp32.
    assert precision(tiny("cuda", {"amp_dtype": ["bf16"]}), device) == ("O0", None)


def test_ascend_gets_bf16_autocast(describe):
    assert precision(tiny("npu"), describe("npu")) == ("O1", "bf16")


def test_a_space_without_amp_keeps_the_fp32_baseline_even_on_fast_hardware(describe):
    device = describe("cuda", gpu=("NVIDIA H100 80GB HBM3", 9, 0))
    assert precision(tiny("cuda", {"amp": ["O0"]}), device) == ("O0", None)


def test_baseline_micro_batch_is_predicted_to_fit_not_merely_within_the_search_margin():
    """A study's pruning lets a config 15% over the budget run (the estimator may over-predict);
    the baseline must fit outright, its estimate scaled by the device's reserved/allocated
    prior, so it does not open a study with an out-of-memory run."""
    from tuner.config import Config
    from tuner.estimate import OOM_MARGIN, estimate, reserved_ratio_prior

    doc = {"name": "b", "model": {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 2048},
           "train": {"global_batch_size": 16}, "hardware": {"device": "cpu", "devices": 2}}  # fmt: skip
    cpu = devices.describe("cpu")
    space = load_space("cpu").narrow({"micro_batch_size": [2, 8]})
    free = baseline_config(recipe_from_dict(doc), cpu, space)
    scaled = estimate(recipe_from_dict(doc), free, cpu).peak_mem_bytes * reserved_ratio_prior("cpu")
    # Micro-batch 8 is within the search's margin of this budget, but over the budget itself.
    doc["hardware"]["memory_budget_gb"] = scaled / (1 + OOM_MARGIN / 2) / 2**30
    base = baseline_config(recipe_from_dict(doc), cpu, space)
    assert free.micro_batch_size == 8 and base.micro_batch_size == 2
    assert Config(**{**base.to_dict(), "micro_batch_size": 8}) == free


def test_an_fp32_reference_that_would_not_fit_at_the_baselines_micro_batch_runs_at_one_that_does():
    """The reference is only for its losses, which every micro-batch split of the global batch
    shares: where fp32 (twice the activations) is predicted not to fit at the baseline's
    micro-batch, a smaller one, not no reference."""
    from tuner.baseline import fp32_reference
    from tuner.config import Config
    from tuner.estimate import estimate, reserved_ratio_prior

    doc = {"name": "r", "model": {"layers": 4, "hidden": 1024, "heads": 8, "seq_len": 2048, "vocab": 32000},
           "train": {"global_batch_size": 16}, "hardware": {"device": "cuda", "devices": 1}}  # fmt: skip
    h100 = devices.known_device("H100", count=1)
    space = load_space("cuda").narrow({"micro_batch_size": [2, 4, 8]})

    def fits(config, budget):
        scaled = estimate(recipe_from_dict(doc), config, h100).peak_mem_bytes * reserved_ratio_prior("cuda")
        return scaled <= budget

    base = baseline_config(recipe_from_dict(doc), h100, space)
    assert base.micro_batch_size == 8 and base.amp == "O1"
    fp32_at_8 = Config(**{**base.to_dict(), "amp": "O0", "attention": "efficient"})
    # A budget that holds the baseline but not fp32 at its micro-batch.
    low = estimate(recipe_from_dict(doc), base, h100).peak_mem_bytes * reserved_ratio_prior("cuda")
    doc["hardware"]["memory_budget_gb"] = low * 1.02 / 2**30
    budget = low * 1.02
    assert not fits(fp32_at_8, budget)
    reference = fp32_reference(base, recipe_from_dict(doc), h100, space)
    assert reference.amp == "O0" and reference.micro_batch_size < 8
    assert fits(reference, budget)
    assert {k for k, v in reference.to_dict().items() if base.to_dict()[k] != v} == {
        "amp",
        "attention",
        "micro_batch_size",
    }
    # With room, the reference keeps the baseline's micro-batch.
    doc["hardware"]["memory_budget_gb"] = None
    assert fp32_reference(base, recipe_from_dict(doc), h100, space).micro_batch_size == 8
