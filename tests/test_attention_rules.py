"""The GPU paths are right by rule: on an H100, an H200 and an Ascend 910B from the device table,
the baseline, the fp32 reference and every config the feasibility rules accept respect the
attention kernels' documented limits. The oracle below restates those limits from the docs
(torch.nn.attention.SDPBackend / sdp_utils, torch_npu.npu_fusion_attention), independently of
`tuner.attention_kernels`, so a rule that drifts from them fails here."""

from __future__ import annotations

import itertools
import random

import pytest

from tuner.baseline import baseline_config, fp32_reference
from tuner.config import Config, infeasible_reasons
from tuner.devices import known_device
from tuner.recipe import recipe_from_dict
from tuner.space import load_space

DEVICES = {"H100": "cuda", "H200": "cuda", "910B": "npu", "V100": "cuda"}
HEAD_DIMS = (64, 128, 256, 320)  # 256: beyond cuDNN; 320: beyond flash too


def documented_ok(family: str, capability: str, attention: str, dtype: str, head_dim: int) -> bool:
    """PyTorch's and torch_npu's documented kernel limits, written out once more for the test."""
    half = dtype in ("fp16", "bf16")
    sm80 = family == "cuda" and float(capability) >= 8.0
    if attention == "math":
        return True
    if family == "cuda" and attention == "flash":
        return sm80 and half and head_dim <= 256
    if family == "cuda" and attention == "cudnn":
        return sm80 and half and head_dim <= 128 and head_dim % 8 == 0
    if family == "cuda" and attention == "efficient":
        return head_dim % (8 if half else 4) == 0 and (dtype != "bf16" or sm80)
    if family == "npu" and attention == "npu_fusion":
        return half and head_dim <= 512
    return False  # a kernel this family does not have


def recipe(family: str, head_dim: int, devices: int = 8):
    heads = 8
    return recipe_from_dict(
        {
            "name": "rules",
            "model": {"layers": 8, "hidden": heads * head_dim, "heads": heads, "seq_len": 256, "vocab": 8192},
            "train": {"global_batch_size": 64},
            "hardware": {"device": family, "devices": devices},
            "search": {"space": family},
        }
    )


def attention_dtype(config: Config) -> str:
    return "fp32" if config.amp == "O0" else config.amp_dtype


def sampled_configs(space, devices: int, n: int, seed: int = 0):
    """Uniform samples of the whole space (every knob), plus the full product of the knobs that
    decide the attention kernel's dtype."""
    rng = random.Random(seed)
    splits = space.splits(devices)
    names = [k for k, d in space.domains.items() if d and k not in ("dp", "tp", "pp")]
    for _ in range(n):
        dp, tp, pp = rng.choice(splits)
        yield Config(dp=dp, tp=tp, pp=pp, **{k: rng.choice(space.domains[k]) for k in names})
    for attention, amp, dtype in itertools.product(
        space.domains["attention"], space.domains["amp"], space.domains["amp_dtype"]
    ):
        yield Config(dp=devices, attention=attention, amp=amp, amp_dtype=dtype)


@pytest.mark.parametrize("name", DEVICES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_accepted_config_respects_the_documented_kernel_limits(name, head_dim):
    family = DEVICES[name]
    device = known_device(name)
    capability = device.extra.get("capability", "0")
    r = recipe(family, head_dim)
    space = load_space(family)
    accepted = refused_for_kernel = 0
    for config in sampled_configs(space, 8, 1500):
        reasons = infeasible_reasons(config, r, device)
        ok = documented_ok(family, capability, config.attention, attention_dtype(config), head_dim)
        if not reasons:
            accepted += 1
            assert ok, (
                f"{name}: the rules accept {config.attention} in {attention_dtype(config)}, head_dim {head_dim}"
            )
        # Refused for the kernel, or for the dtype itself (bf16 on a V100).
        kernel = [x for x in reasons if x.startswith((f"attention={config.attention}", "amp_dtype="))]
        if not ok:
            refused_for_kernel += 1
            assert kernel, (
                f"{name}: {config.attention} in {attention_dtype(config)} should be refused: {reasons}"
            )
    assert accepted > 50 and refused_for_kernel > 0


@pytest.mark.parametrize("name", DEVICES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_baseline_and_the_fp32_reference_run_on_documented_kernels(name, head_dim):
    family = DEVICES[name]
    device = known_device(name)
    r = recipe(family, head_dim)
    space = load_space(family)
    base = baseline_config(r, device, space)
    capability = device.extra.get("capability", "0")
    assert documented_ok(family, capability, base.attention, attention_dtype(base), head_dim), base
    reference = fp32_reference(base, r, device, space)
    if base.amp == "O0":
        assert reference is None  # the baseline already is the fp32 run
        return
    assert reference.amp == "O0"
    assert documented_ok(family, capability, reference.attention, "fp32", head_dim), reference
    assert not [x for x in infeasible_reasons(reference, r, device) if x.startswith("attention=")]
    # Only the precision (and, where it must, the kernel) differs from the baseline.
    changed = {k for k, v in reference.to_dict().items() if base.to_dict()[k] != v}
    assert changed <= {"amp", "attention"}


def test_a_modern_gpu_baseline_uses_a_fused_kernel_and_its_reference_a_fp32_one():
    device = known_device("H100")
    space = load_space("cuda")
    base = baseline_config(recipe("cuda", 128), device, space)
    assert (base.amp, base.amp_dtype, base.attention) == ("O1", "bf16", "flash")
    assert fp32_reference(base, recipe("cuda", 128), device, space).attention == "efficient"


def test_an_fp32_config_with_flash_on_cuda_is_refused_with_the_fix():
    reasons = infeasible_reasons(
        Config(dp=8, attention="flash", amp="O0"), recipe("cuda", 128), known_device("H200")
    )
    assert reasons == [
        "attention=flash cannot run in fp32 on cuda (FlashAttention takes fp16/bf16 only); "
        "use amp=O1 or O2, or attention=math or efficient"
    ]


def test_the_cpu_flash_kernel_takes_fp32():
    from tuner.devices import describe

    cpu = describe("cpu")
    r = recipe("cpu", 32, devices=1)
    assert not infeasible_reasons(Config(attention="flash", amp="O0"), r, cpu)


def test_the_cuda_benchmark_sweep_goes_through_the_same_rules(capsys):
    """benchmarks/cuda_measure.py runs on a GPU machine in one prepared run; its dry run checks
    here that every config it would measure passes the rules, except the one meant to be refused."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "cuda_measure.py"
    main = runpy.run_path(str(script))["main"]
    assert (
        main([str(script.parent.parent / "recipes" / "gpt-tiny.yaml"), "--layers", "2", "--dry-run", "H200"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    refused = [line for line in lines if "infeasible" in line]
    assert refused == [
        "precision: amp=O0, attention=flash: infeasible: attention=flash cannot run in fp32 on cuda "
        "(FlashAttention takes fp16/bf16 only); use amp=O1 or O2, or attention=math or efficient"
    ]
    assert len(lines) >= 15


def mistral(seq_len: int, window: int):
    config = {"model_type": "mistral", "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 8, "intermediate_size": 2048, "vocab_size": 8192, "sliding_window": window}  # fmt: skip
    return recipe_from_dict({"name": "sw", "model": {"family": "hf", "seq_len": seq_len, "config": config},
                             "train": {"global_batch_size": 64}, "hardware": {"device": "cuda", "devices": 8},
                             "search": {"space": "cuda"}})  # fmt: skip


def test_a_sliding_window_shorter_than_the_sequence_rules_out_the_kernels_that_take_no_mask():
    """The window is an explicit mask, which PyTorch's flash and cuDNN kernels refuse at run time
    ("No available kernel"): such a config, the baseline included, would end in an error."""
    h100 = known_device("H100")
    config = Config(dp=8, attention="flash", amp="O1", amp_dtype="bf16")
    assert infeasible_reasons(config, mistral(4096, 1024), h100) == [
        "attention=flash takes no attention mask on cuda, and this model's sliding-window layers need "
        "one at this seq_len; use attention=efficient or math"
    ]
    assert not infeasible_reasons(config, mistral(1024, 1024), h100)  # within the window: plain causal
    assert not infeasible_reasons(
        Config(**{**config.to_dict(), "attention": "efficient"}), mistral(4096, 1024), h100
    )
    assert baseline_config(mistral(4096, 1024), h100, load_space("cuda")).attention == "efficient"
