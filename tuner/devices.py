"""The device layer: which family runs a trial (cpu, cuda, npu) and what that family offers.

Everything device-specific lives here: the distributed backend, synchronisation, peak-memory
readings, peak FLOP/s for MFU, which attention backends and dtypes exist, and which of those
dtypes are fast. Ascend NPUs are used through `torch_npu` only when it imports.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tuner.cgroup import memory_limit
from tuner.device_table import CATALOG, PEAK_TFLOPS

FAMILIES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class DeviceInfo:
    """What one device family offers a trial, on this machine or (described by a Ray node) on the
    machines a study's trials run on: `where` says which, in the words an error message uses."""

    family: str  # cpu | cuda | npu
    name: str  # e.g. "NVIDIA H200", "Ascend910B2", or the CPU model
    count: int  # devices available for ranks (CPU: cores)
    memory_bytes: int  # per device (CPU: total RAM)
    backend: str  # torch.distributed backend
    attention_backends: tuple[str, ...]
    amp_dtypes: tuple[str, ...]  # low-precision dtypes autocast supports here
    compile_modes: tuple[str, ...]  # torch.compile modes that work here
    # The subset of amp_dtypes whose matmuls run faster than fp32 here (native units: tensor cores,
    # AMX, AVX512-BF16), best first; see `fast_dtypes`. Empty means low precision only emulates.
    fast_dtypes: tuple[str, ...] = ()
    supports_tf32: bool = False
    supports_pin_memory: bool = False
    supports_offload: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    where: str = "this machine"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def npu_module():
    """Return the imported torch_npu module, or None when it is not installed or has no device."""
    try:
        mod = importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - any import failure means "no NPU here"
        return None
    npu = getattr(torch, "npu", None)
    try:
        if npu is None or not npu.is_available():
            return None
    except Exception:  # noqa: BLE001
        return None
    return mod


def available_families() -> list[str]:
    fams = ["cpu"]
    if torch.cuda.is_available():
        fams.append("cuda")
    if npu_module() is not None:
        fams.append("npu")
    return fams


class UnavailableDevice(ValueError):
    """A recipe's `hardware.device` names a family that is not where the trials would run. The
    message names the field and the way out for a command line; `explain` words the same with
    another entry point's way out (REST's)."""

    def __init__(self, requested: str, available: list[str], where: str):
        self.requested, self.available, self.where = requested, list(available), where
        super().__init__(
            "hardware.device: "
            + self.explain(
                f"run this on a machine that has {requested} (tuner tune, plan and show reach a Ray "
                f"cluster's {requested} nodes from any of its machines with --executor ray)"
            )
        )

    def explain(self, way_out: str) -> str:
        return (
            f"{self.requested} requested but not available on {self.where} "
            f"(available: {', '.join(self.available) or 'none'}); set hardware.device to auto or "
            f"one of those, or {way_out}"
        )


def resolve_family(
    requested: str = "auto", available: list[str] | None = None, where: str = "this machine"
) -> str:
    """Map a recipe's `hardware.device` to a family present `where` (`available`, by default this
    machine's `available_families`); raise, naming the field and the fix, if it is absent. One
    rule for this machine and for a Ray cluster's nodes (`RayExecutor.describe`)."""
    fams = available_families() if available is None else available
    if requested == "auto":
        for fam in ("npu", "cuda", "cpu"):
            if fam in fams:
                return fam
    if requested not in FAMILIES:
        raise ValueError(f"hardware.device: unknown device {requested!r}; use one of auto, cpu, cuda, npu")
    if requested not in fams:
        raise UnavailableDevice(requested, fams, where)
    return requested


@functools.cache
def _cpuinfo() -> str:
    """/proc/cpuinfo, read once per process ("" where there is none): the CPU cannot change."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_name() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_model_id(cpuinfo: str | None = None) -> str:
    """The CPU's model as the kernel numbers it (x86: vendor, family, model and stepping; Arm:
    implementer and part), from `cpuinfo` (default: /proc/cpuinfo), or "" where it does not say.
    Virtual machines often report a generic model name ("AMD EPYC"): two such hosts of this
    project ran one thread's bf16 matmul at 210 and 473 GFLOP/s and the same pp=2 config 1.5x
    apart, so the name alone must not key measurements or the cached peak."""
    keys = ("vendor_id", "cpu family", "model", "stepping", "CPU implementer", "CPU part")
    found: dict[str, str] = {}
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if not line.strip() and found:
            break  # the first processor's block is enough: the others are the same model
        key, sep, value = line.partition(":")
        if sep and key.strip() in keys:
            found.setdefault(key.strip(), value.strip())
    return " ".join(f"{k.replace(' ', '_')}={found[k]}" for k in keys if k in found)


def same_cpu(fingerprint: Mapping[str, Any], here: DeviceInfo) -> bool:
    """Whether the CPU a fingerprint (`tuner.fingerprint.fingerprint`) records is this machine's
    CPU `here`: the same name and the same model id. The name alone does not say (one name
    covers several generations, `cpu_model_id`), so a record without the model id is not taken
    for this CPU."""
    model = fingerprint.get("cpu_model")
    return fingerprint.get("device") == here.name and bool(model) and model == cpu_model_id()


def _total_ram() -> int:
    """The memory CPU trials may use: the machine's, or less where this process's memory cgroup
    (a container's, a batch job's) is limited to less: its ranks share that limit, and the
    kernel's out-of-memory killer ends them at it, not at the machine's size."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = memory_limit()
    return ram if limit is None else min(ram, limit)


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


# Preference order among fast dtypes: bf16 needs no loss scaling, fp16 does.
_LOW_DTYPES = ("bf16", "fp16")


def cpu_features() -> dict[str, bool]:
    """The CPU's instruction-set features as torch reports them (`torch.cpu.get_capabilities`)."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        return {k: v for k, v in caps().items() if isinstance(v, bool)}
    # Older torch has only the private probes; every AMX part so far has AMX-BF16 with its tiles.
    probe = {
        "avx512_f": "_is_avx512_supported",
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_bf16": "_is_amx_tile_supported",
        "amx_fp16": "_is_amx_fp16_supported",
    }
    return {k: bool(getattr(torch.cpu, fn, lambda: False)()) for k, fn in probe.items()}


def fast_dtypes(family: str, *, cpu: dict[str, bool] | None = None, capability: int = 0) -> tuple[str, ...]:
    """The low-precision dtypes whose matmuls beat fp32 on a device, in order of preference.

    The one rule: CPU by ISA (`cpu`, from `cpu_features`), CUDA by compute capability (major,
    e.g. 8 for sm_80), Ascend always both. Without native units autocast still runs bf16/fp16,
    but by converting to fp32 and back, which is slower than fp32 itself.
    """
    if family == "cpu":
        cpu = cpu or {}
        # ARM bf16 (BFMMLA) is not counted: unmeasured by us; such CPUs get an fp32 baseline and
        # the search still tries bf16.
        native = {
            "bf16": cpu.get("avx512_bf16") or cpu.get("amx_bf16"),
            "fp16": cpu.get("avx512_fp16") or cpu.get("amx_fp16"),
        }
    elif family == "cuda":
        # Tensor cores: fp16 from Volta (7.0), bf16 from Ampere (8.0).
        native = {"bf16": capability >= 8, "fp16": capability >= 7}
    elif family == "npu":
        native = {"bf16": True, "fp16": True}  # the cube unit (910B) does both natively
    else:
        raise ValueError(f"unknown device family {family!r}")
    return tuple(d for d in _LOW_DTYPES if native[d])


@functools.cache
def describe(family: str) -> DeviceInfo:
    if family == "cpu":
        return DeviceInfo(
            family="cpu",
            name=_cpu_name(),
            count=usable_cpus(),
            memory_bytes=_total_ram(),
            backend="gloo",
            attention_backends=("math", "flash"),
            amp_dtypes=("bf16", "fp16"),
            compile_modes=("none", "default", "max-autotune"),
            fast_dtypes=fast_dtypes("cpu", cpu=cpu_features()),
        )
    if family == "cuda":
        props = torch.cuda.get_device_properties(0)
        return cuda_info(
            props.name, (props.major, props.minor), torch.cuda.device_count(), props.total_memory,
            torch.version.cuda or "",
        )  # fmt: skip
    if family == "npu":
        mod = npu_module()
        if mod is None:
            raise ValueError("npu requested but torch_npu is not importable or sees no device")
        npu = torch.npu
        return npu_info(
            npu.get_device_name(0), npu.device_count(), npu.get_device_properties(0).total_memory,
            getattr(mod, "__version__", "unknown"),
        )  # fmt: skip
    raise ValueError(f"unknown device family {family!r}")


def cuda_info(name: str, capability: tuple[int, int], count: int, memory_bytes: int, cuda: str) -> DeviceInfo:
    """What an NVIDIA GPU of this compute capability offers (one rule for real and catalogued GPUs)."""
    major, minor = capability
    attn = ["math", "efficient"]
    if major >= 8:  # flash and cuDNN attention need Ampere (sm_80) or newer
        attn += ["flash", "cudnn"]
    return DeviceInfo(
        family="cuda",
        name=name,
        count=count,
        memory_bytes=memory_bytes,
        backend="nccl",
        attention_backends=tuple(attn),
        amp_dtypes=("bf16", "fp16") if major >= 8 else ("fp16",),
        compile_modes=("none", "default", "max-autotune", "reduce-overhead"),
        fast_dtypes=fast_dtypes("cuda", capability=major),
        supports_tf32=major >= 8,
        supports_pin_memory=True,
        supports_offload=True,
        extra={"capability": f"{major}.{minor}", "cuda": cuda},
    )


def npu_info(name: str, count: int, memory_bytes: int, torch_npu_version: str) -> DeviceInfo:
    """What an Ascend NPU offers through torch_npu."""
    return DeviceInfo(
        family="npu",
        name=name,
        count=count,
        memory_bytes=memory_bytes,
        backend="hccl",
        attention_backends=("math", "npu_fusion"),
        amp_dtypes=("bf16", "fp16"),
        # torch.compile on Ascend needs torchair, which we do not drive; eager only.
        compile_modes=("none",),
        fast_dtypes=fast_dtypes("npu"),
        supports_pin_memory=True,
        supports_offload=True,
        extra={"torch_npu": torch_npu_version},
    )


def known_device(key: str, count: int = 8) -> DeviceInfo:
    """A device of the catalogue (`tuner.device_table.CATALOG`, e.g. "H100", "910B"), described
    without the hardware: for rule checks and plans of machines this one is not."""
    entry = CATALOG.get(key)
    if entry is None:
        raise ValueError(f"unknown device {key!r}; known: {', '.join(CATALOG)}")
    gib = entry.memory_gib * 2**30
    if entry.family == "cuda":
        return cuda_info(entry.name, entry.capability, count, int(gib), "")
    return npu_info(entry.name, count, int(gib), "")


def table_peak_tflops(name: str, dtype: str) -> float | None:
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return peaks.get(dtype)
    return None


def _cache_dir() -> Path:
    root = os.environ.get("TUNER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tuner"
    )
    return Path(root)


def measure_matmul_tflops(
    dtype: torch.dtype, threads: int, device: str = "cpu", n: int = 1024, reps: int = 5
) -> float:
    """Best-of-`reps` square matmul throughput on `device` (CPU: with `threads` threads).

    Uses `F.linear`, the op the model's matmuls go through: on CPUs without native fp16 `torch.mm`
    takes a naive fp16 path about 10x slower than `linear`'s, which would put MFU above 100%.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    family = device.split(":")[0]
    if family != "cpu":
        n = 8192
    try:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        torch.nn.functional.linear(a, b)  # warm-up
        synchronize(family)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.nn.functional.linear(a, b)
            synchronize(family)
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best / 1e12
    finally:
        torch.set_num_threads(old)


_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def peak_tflops(info: DeviceInfo, dtype: str, threads: int = 1) -> float:
    """Peak TFLOP/s of one device (one CPU rank with `threads` threads) for MFU.

    Known accelerators use the datasheet table; the CPU and unknown accelerators use a measured
    matmul, cached on disk per device name, torch version, dtype and thread count.
    """
    if info.family != "cpu":
        val = table_peak_tflops(info.name, dtype)
        if val is not None:
            return val
    model = f"|{cpu_model_id()}" if info.family == "cpu" else ""
    key = f"linear|{info.family}|{info.name}{model}|{torch.__version__}|{dtype}|{threads}"
    path = _cache_dir() / "peak_tflops.json"
    cache: dict[str, float] = {}
    with contextlib.suppress(OSError, ValueError):  # no cache yet, or a torn one: measure
        cache = json.loads(path.read_text())
    if key in cache:
        return cache[key]
    device = "cpu" if info.family == "cpu" else f"{info.family}:0"
    val = measure_matmul_tflops(_DTYPES[dtype], threads, device)
    cache[key] = val
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass
    return val


# ---- runtime helpers used inside trial processes ---------------------------------------------


def torch_device(family: str, local_rank: int) -> torch.device:
    if family == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if family == "npu":
        npu_module()
        torch.npu.set_device(local_rank)
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def synchronize(family: str) -> None:
    if family == "cuda":
        torch.cuda.synchronize()
    elif family == "npu":
        torch.npu.synchronize()


# The allocator's environment variable per family, and what each `alloc_conf` knob value adds.
ALLOC_CONF_ENV = {"cuda": "PYTORCH_CUDA_ALLOC_CONF", "npu": "PYTORCH_NPU_ALLOC_CONF"}
_ALLOC_CONF = {"default": "", "expandable_segments": "expandable_segments:True"}


def alloc_env(family: str, alloc_conf: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a trial's ranks need for the `alloc_conf` knob, set before the device's
    allocator starts. Options the user already set in that variable are kept, but not their own
    `expandable_segments`: the knob decides it, or `default` would inherit the user's
    `expandable_segments:True` and measure the same allocator as the other value under another name."""
    var, option = ALLOC_CONF_ENV.get(family), _ALLOC_CONF[alloc_conf]
    if var is None:
        return {}
    current = (os.environ if environ is None else environ).get(var, "")
    kept = [o for o in current.split(",") if o and not o.startswith("expandable_segments")]
    if not option and kept == [o for o in current.split(",") if o]:
        return {}  # `default`, and nothing of the user's to take out
    return {var: ",".join([*kept, option] if option else kept)}


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` means memory ran out: a device's, or the host's (torch's CPU allocator raises a
    plain RuntimeError, the OS an ENOMEM OSError)."""
    import errno

    from tuner.record.status import is_oom_text

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    return is_oom_text(str(exc))
