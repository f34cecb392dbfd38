"""Device layer: family selection (including the Ascend path through a stand-in torch_npu),
capabilities, peak FLOP/s and the CPU peak-memory reading."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tuner import devices


@pytest.fixture
def fake_npu(monkeypatch):
    """A stand-in torch_npu module and torch.npu namespace, as the real plugin installs them.

    This only exercises our selection logic; the real NPU path is not verified on hardware here.
    """
    mod = types.ModuleType("torch_npu")
    mod.__version__ = "2.6.0.post-test"
    npu = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 8,
        get_device_name=lambda i=0: "Ascend910B2",
        get_device_properties=lambda i=0: types.SimpleNamespace(total_memory=64 * 2**30),
    )
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    devices.describe.cache_clear()
    yield npu
    devices.describe.cache_clear()


def test_cpu_is_always_available_and_auto_picks_it_without_accelerators():
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    assert devices.available_families() == ["cpu"]
    assert devices.resolve_family("auto") == "cpu"
    info = devices.describe("cpu")
    assert info.backend == "gloo"
    assert info.count >= 1 and info.memory_bytes > 2**30
    assert "flash" in info.attention_backends and "cudnn" not in info.attention_backends
    assert not info.supports_tf32


def test_missing_family_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    with pytest.raises(ValueError, match=r"hardware.device: cuda requested but not available.*cpu"):
        devices.resolve_family("cuda")


def test_npu_selected_when_torch_npu_imports(fake_npu):
    assert "npu" in devices.available_families()
    assert devices.resolve_family("auto") == "npu"
    info = devices.describe("npu")
    assert info.backend == "hccl"
    assert info.name == "Ascend910B2" and info.count == 8
    assert "npu_fusion" in info.attention_backends
    assert info.compile_modes == ("none",)
    # MFU uses the datasheet table for known Ascend parts.
    assert devices.peak_tflops(info, "bf16") == pytest.approx(353.0)


def test_npu_not_selected_when_plugin_sees_no_device(fake_npu):
    fake_npu.is_available = lambda: False
    assert "npu" not in devices.available_families()
    with pytest.raises(ValueError, match="npu"):
        devices.resolve_family("npu")


def test_peak_table_matches_by_name():
    assert devices.table_peak_tflops("NVIDIA H200", "bf16") == pytest.approx(989.4)
    assert devices.table_peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156.0)
    assert devices.table_peak_tflops("Some Unknown GPU", "bf16") is None


def test_cpu_peak_is_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNER_CACHE_DIR", str(tmp_path))
    info = devices.describe("cpu")
    first = devices.peak_tflops(info, "fp32", threads=1)
    assert 0.001 < first < 50  # a real matmul on one core: GFLOP/s to a few TFLOP/s
    assert (tmp_path / "peak_tflops.json").exists()
    assert devices.peak_tflops(info, "fp32", threads=1) == first  # cached, not re-measured


def test_cpu_peak_memory_counts_resident_growth():
    base = devices.reset_peak_memory("cpu")
    buf = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    alloc, reserved = devices.peak_memory("cpu", base)
    del buf
    assert alloc >= 60 * 2**20
    assert alloc == reserved
