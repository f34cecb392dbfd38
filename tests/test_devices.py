"""Device layer: family selection (including the Ascend path through a stand-in torch_npu),
capabilities, peak FLOP/s and the CPU peak-memory reading."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from tuner import devices, memory
from tuner.fingerprint import fingerprint


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
    with pytest.raises(ValueError, match=r"hardware.device: cuda requested but not available.*cpu") as err:
        devices.resolve_family("cuda")
    assert "--executor ray" in str(err.value)  # a Ray cluster's GPU nodes describe themselves


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


ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nstepping\t: 1\n\nprocessor\t: 1\nmodel\t\t: 99\n"
ZEN5 = ZEN4.replace("cpu family\t: 25", "cpu family\t: 26").replace("model\t\t: 17", "model\t\t: 2")
NEOVERSE = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n"


def test_cpu_model_id_tells_hosts_apart_that_share_a_generic_name():
    assert devices.cpu_model_id(ZEN4) == "vendor_id=AuthenticAMD cpu_family=25 model=17 stepping=1"
    assert devices.cpu_model_id(ZEN5) != devices.cpu_model_id(ZEN4)  # both say "AMD EPYC"
    assert devices.cpu_model_id(NEOVERSE) == "CPU_implementer=0x41 CPU_part=0xd0c"
    assert devices.cpu_model_id("") == ""


def test_cpu_peak_cached_by_another_cpu_model_of_the_same_name_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNER_CACHE_DIR", str(tmp_path))
    info = devices.describe("cpu")
    cache = tmp_path / "peak_tflops.json"
    with monkeypatch.context() as other_host:
        other_host.setattr(devices, "cpu_model_id", lambda: "vendor_id=AuthenticAMD cpu_family=26 model=2")
        devices.peak_tflops(info, "fp32", threads=1)
        # That host's reading, made one no CPU core reaches, stays that host's.
        cache.write_text(json.dumps({key: 99.0 for key in json.loads(cache.read_text())}))
        assert devices.peak_tflops(info, "fp32", threads=1) == 99.0
    assert devices.peak_tflops(info, "fp32", threads=1) < 50  # this machine's model: measured
    assert len(json.loads(cache.read_text())) == 2
    assert fingerprint("cpu")["cpu_model"] == devices.cpu_model_id()


def test_cpu_peak_memory_counts_resident_growth():
    base = memory.reset_peak_memory("cpu")
    buf = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    alloc, reserved = memory.peak_memory("cpu", base)
    del buf
    assert alloc >= 60 * 2**20
    assert alloc == reserved


# ---- which low-precision dtypes are fast (the baseline's choice depends on it) ----------------

# What torch.cpu.get_capabilities reports on an AVX-512 Xeon (Ice Lake) with no bf16 units.
AVX512_ONLY = {"architecture": "x86_64", "avx2": True, "avx512_f": True, "avx512_bw": True}


@pytest.fixture
def fake_cpu(monkeypatch):
    """Describe a CPU with the given instruction-set features, through torch's own report."""

    def _describe(**features):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**AVX512_ONLY, **features})
        devices.describe.cache_clear()
        return devices.describe("cpu")

    yield _describe
    devices.describe.cache_clear()


@pytest.fixture
def fake_cuda(monkeypatch):
    """Describe a CUDA device by name and compute capability (no GPU needed)."""

    def _describe(name, major, minor=0, memory_gb=80):
        props = types.SimpleNamespace(name=name, major=major, minor=minor, total_memory=memory_gb * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
        devices.describe.cache_clear()
        return devices.describe("cuda")

    yield _describe
    devices.describe.cache_clear()


@pytest.mark.parametrize(
    ("features", "fast"),
    [
        ({}, ()),  # AVX-512 alone: bf16 autocast only converts to fp32 and back
        ({"avx512_bf16": True}, ("bf16",)),  # Cooper Lake, Zen 4
        ({"avx512_bf16": True, "amx_tile": True, "amx_bf16": True, "avx512_fp16": True}, ("bf16", "fp16")),
        ({"amx_tile": True, "amx_bf16": True, "amx_fp16": True}, ("bf16", "fp16")),  # Granite Rapids
    ],
    ids=["avx512", "avx512_bf16", "sapphire_rapids", "amx_fp16"],
)
def test_cpu_fast_dtypes_follow_the_isa(fake_cpu, features, fast):
    info = fake_cpu(**features)
    assert info.fast_dtypes == fast
    # Autocast support is unchanged: bf16 stays a legal knob value even where it is slow.
    assert info.amp_dtypes == ("bf16", "fp16")


@pytest.mark.parametrize(
    ("name", "major", "minor", "fast"),
    [
        ("NVIDIA A100-SXM4-80GB", 8, 0, ("bf16", "fp16")),
        ("NVIDIA H100 80GB HBM3", 9, 0, ("bf16", "fp16")),
        ("Tesla V100-SXM2-32GB", 7, 0, ("fp16",)),
        ("Tesla T4", 7, 5, ("fp16",)),
        ("Tesla P100-PCIE-16GB", 6, 0, ()),
    ],
)
def test_cuda_fast_dtypes_follow_the_compute_capability(fake_cuda, name, major, minor, fast):
    info = fake_cuda(name, major, minor)
    assert info.fast_dtypes == fast
    assert set(info.fast_dtypes) <= set(info.amp_dtypes)


def test_ascend_runs_bf16_and_fp16_natively(fake_npu):
    assert devices.describe("npu").fast_dtypes == ("bf16", "fp16")


def _cpuinfo_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), None)
    return set(line.split(":", 1)[1].split()) if line else None


def test_this_cpus_fast_dtypes_agree_with_what_torch_and_the_kernel_report():
    devices.describe.cache_clear()
    info = devices.describe("cpu")
    bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert ("bf16" in info.fast_dtypes) == bf16
    if torch.cpu._is_amx_fp16_supported():
        assert "fp16" in info.fast_dtypes
    flags = _cpuinfo_flags()
    if flags is not None and torch.cpu._is_avx512_supported():  # x86 Linux: the kernel's view too
        assert ("bf16" in info.fast_dtypes) == bool({"avx512_bf16", "amx_bf16"} & flags)
        assert ("fp16" in info.fast_dtypes) == bool({"avx512_fp16", "amx_fp16"} & flags)


def test_cuda_memory_reports_fragmentation_from_the_allocator_peaks(monkeypatch):
    """A unit test of the arithmetic around torch.cuda.memory_stats (no GPU here); the real
    reading runs in benchmarks/cuda_measure.py."""
    stats = {"allocated_bytes.all.peak": 700, "reserved_bytes.all.peak": 1000, "active_bytes.all.peak": 760}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: stats)
    peak = memory.memory_peak("cuda")
    assert (peak.allocated, peak.reserved, peak.active, peak.fragmentation) == (700, 1000, 760, 300)


# In a fresh process: free a 24 MiB block (glibc then raises its mmap threshold to 24 MiB), then
# allocate, touch and free 16 MiB, and print how much of it stayed resident.
_KEPT_AFTER_FREE = """
import torch
from tuner import devices, memory
exact = memory.exact_host_memory("cpu")
x = torch.ones(24 * 2**20 // 4); del x
base = memory.reset_peak_memory("cpu")
y = torch.ones(16 * 2**20 // 4); del y
print(exact, memory._proc_status_kb("VmRSS") * 1024 - base)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc")
def test_exact_host_memory_hands_freed_tensors_back(tmp_path):
    """Why a CPU rank's default peak overstates its memory, and what exact mode changes: glibc's
    heap keeps a freed 16 MiB tensor resident; in exact mode it leaves the process."""
    import subprocess

    def kept(mode: str) -> tuple[str, int]:
        env = {**os.environ, memory.HOST_MEMORY_ENV: mode}
        out = subprocess.run([sys.executable, "-c", _KEPT_AFTER_FREE], env=env, capture_output=True,
                             text=True, check=True).stdout.split()  # fmt: skip
        return out[0], int(out[1])

    exact, exact_kept = kept("exact")
    default, default_kept = kept("default")
    assert (exact, default) == ("True", "False")
    assert default_kept > 12 * 2**20 and exact_kept < 4 * 2**20


# In a fresh process: hold 32 MiB and pass through a 24 MiB temporary (the timed steps' peak; glibc
# then serves blocks under 24 MiB from its heap), leave a 16 MiB hole freed under a live 1 MiB
# block, then read a held-memory step that holds a 20 MiB temporary for 50 ms.
_HELD_STEP = """
import time
import torch
from tuner import memory
base = memory.reset_peak_memory("cpu")
live = torch.ones(32 * 2**20 // 4)
x = torch.ones(24 * 2**20 // 4); del x
hole = torch.ones(16 * 2**20 // 4); above = torch.ones(2**20 // 4); del hole
timed = memory.memory_peak("cpu", base)
held = memory.held_memory("cpu", base)
with held:
    t = torch.ones(20 * 2**20 // 4); time.sleep(0.05); del t
peak = held.peak(timed)
print(timed.reserved, held.held, peak.allocated, peak.reserved, peak.fragmentation)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc")
def test_held_memory_reads_what_a_cpu_rank_holds_apart_from_the_heaps_slack():
    """A CPU rank's allocated peak is what it holds (32 + 1 MiB here, not the 16 MiB hole glibc
    kept resident after a free) plus its held step's transient (20 MiB): neither the timed steps'
    peak nor the resident set. Reserved keeps the timed peak; their difference is reported as
    fragmentation, as on CUDA."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _HELD_STEP], capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    timed, held, allocated, reserved, frag = (int(v) / 2**20 for v in out)
    assert 32 <= held <= 38, held  # 49+ if the hole had stayed resident
    assert 20 <= allocated - held <= 21, (allocated, held)
    assert reserved == timed >= 55
    assert frag == max(0, reserved - allocated)


def test_cpu_memory_has_no_allocator_view():
    peak = memory.memory_peak("cpu", memory.reset_peak_memory("cpu"))
    assert peak.allocated == peak.reserved and peak.active is None and peak.fragmentation is None


def test_alloc_conf_sets_the_allocator_variable_and_keeps_the_users_options():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8,expandable_segments:False"}
    assert devices.alloc_env("cuda", "expandable_segments", env) == {
        "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8,expandable_segments:True"
    }
    assert devices.alloc_env("npu", "expandable_segments", {}) == {
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"
    }
    # `default` is the allocator's default even where the user's environment turned segments on
    # (it inherited `expandable_segments:True`, so both values measured the same allocator).
    assert devices.alloc_env("cuda", "default", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == {
        "PYTORCH_CUDA_ALLOC_CONF": ""
    }
    assert devices.alloc_env("cuda", "default", env) == {
        "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8"
    }
    assert devices.alloc_env("cuda", "default", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    assert devices.alloc_env("cpu", "expandable_segments", {}) == {}


def test_alloc_conf_is_a_gpu_knob_refused_on_cpu_with_the_reason():
    from tuner.config import Config, infeasible_reasons
    from tuner.recipe import recipe_from_dict
    from tuner.space import load_space

    recipe = recipe_from_dict({"name": "t", "model": {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 32,
                               "vocab": 256}, "train": {"global_batch_size": 4}, "hardware": {"devices": 1}})  # fmt: skip
    reasons = infeasible_reasons(Config(alloc_conf="expandable_segments"), recipe, devices.describe("cpu"))
    assert any(
        r.startswith("alloc_conf=expandable_segments configures the CUDA/NPU caching allocator")
        for r in reasons
    )
    assert load_space("cuda").domains["alloc_conf"] == ("default", "expandable_segments")
    assert load_space("cpu").domains["alloc_conf"] == ("default",)


def test_the_host_running_out_of_memory_is_an_oom_not_an_error():
    """torch's CPU allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate
    memory"): a CPU trial that ran out of memory must count as oom, so the OOM floor learns."""
    import errno

    import torch

    from tuner.devices import is_oom

    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**50, dtype=torch.uint8)  # a PiB
    assert is_oom(caught.value)
    assert is_oom(OSError(errno.ENOMEM, "Cannot allocate memory")) and is_oom(MemoryError())
    assert not is_oom(RuntimeError("shape mismatch"))
