"""Where the performance model starts before anything was measured: per device family, the peak
FLOP/s of each dtype (the device table, or the measured matmul on CPUs and unknown devices), a
link bandwidth, a latency per collective and per point-to-point message, and a host cost per
kernel-ish unit."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from tuner.devices import DeviceInfo, peak_tflops

# Autocast on a CPU: log of the speed its matmuls reach against the low dtype's one-thread peak.
# That peak is a lone F.linear, which the bf16 units of the tables' CPUs run at 2.3-8.5x fp32;
# autocast's training steps (casts, small per-op kernels) reach about half of it: fitted to each
# of the four gpt tables whole, -0.43, -0.61, -0.64 and -2.0 (the last a Sapphire Rapids, whose
# AMX matmul is 8.5x fp32); with each table left out in turn, the other three's median is -0.61
# to -0.64 (BENCHMARKS section 11). A CPU without bf16 units measures the same lone F.linear,
# its conversions through fp32 included (`device_priors`): on a Zen 3 its O1/O2 gpt-tiny steps
# reach an MFU of 0.32 against that peak where fp32 steps reach 0.49 of theirs (-0.45 in log),
# close to the same prior. Accelerators' autocast runs the tensor cores their datasheet's peak
# is for: 0, the efficiency covers the rest.
CPU_LOG_AUTOCAST = -0.6
# ... but at most this multiple of the fp32 peak, however fast the low dtype's lone matmul: a
# 1024-square F.linear keeps AMX tiles or bf16 dot-product units busy, a training step's small
# matmuls do not (one thread of an Emerald Rapids, fwd+bwd in bf16 against fp32: 5.4x at 1024
# cubed, 3.2x at 1024 x 128 x 512, 1.9x at 128 x 128 x 512, 0.8x at 128 cubed). Fitted whole,
# five gpt tables from five CPUs put autocast's matmuls (O2) at 0.93, 0.99, 1.21, 1.51 and 1.60x
# fp32, whether the lone bf16 peak was 2.3x fp32 (a Zen 4), 4.5x (Zen 4 and 5) or 6.8-8.4x
# (Sapphire and Emerald Rapids, whose fitted `log_autocast` was -2.0 against the -0.6 start):
# the cap is their median. The median of the other four, each table left out in turn, is 1.1-1.36
# (BENCHMARKS section 11, 2026-12-05).
CPU_AUTOCAST_MAX_OVER_FP32 = 1.2

# (efficiency, half-efficiency tokens, bandwidth bytes/s, latency s per collective, host s per
# unit, cross-node share, memory bandwidth bytes/s that memory-bound kernels reach: CPU per
# thread, accelerators per device, latency s per point-to-point message).
# cpu: the peak is a measured F.linear of the size class the models use, so training matmuls reach
# most of it, and a few dozen rows per matmul already keep a core's vector units busy
# (accelerators need thousands to fill their SMs or cubes). gloo over loopback between ranks that
# each hold one of a few shared cores: an all-reduce costs milliseconds (measured on a 2-core AMD
# EPYC: 0.7-3.6 ms for 1-256 KiB, 3.4-5.3 ms for 4 MiB; 2-4 ms with both ranks computing in
# between), and inside a trial, where DTensor, autograd and the ranks' skew add to it, five full
# fits of measured tables on two CPUs (BENCHMARKS section 11) put it at 1.9-7.3 ms and 0.09-2.6
# GB/s (median 0.15); a send/receive pair costs 0.04 ms. Memory-bound kernels (norms,
# activations, softmax, the optimizer) reach a few GB/s per CPU thread in eager PyTorch.
# cuda/npu: datasheet peaks; NVLink / HCCS inside a node, InfiniBand-class (100-400 Gb/s)
# across nodes; most of an HBM's datasheet bandwidth (H100 3.35 TB/s, Ascend 910B 1.6 TB/s);
# NCCL/HCCL point-to-point in about 10 us. A large bf16 matmul on an H200 ran at 0.8 of the
# datasheet peak (8192 cubed); a training layer's at less. CUDA's efficiency and half-efficiency
# tokens were 0.45 and 1024, which put a step's matmuls alone above whole measured steps: on
# fifteen configs of Llama-3 8B's layers measured on an H200 (BENCHMARKS section 13) the priors
# alone predicted 15-53% low, median 28%; with 0.6 and 512 the median is 4.5% (the fp32 matmuls
# without TF32, which ran at 0.77 of their peak, still 24-31% low). One GPU and one model: the
# fit moves them to what this machine measures. Ascend's are not measured here.
_PRIORS = {
    "cpu": (0.75, 32.0, 2e8, 3e-3, 2e-4, 1.0, 5e9, 5e-5),
    "cuda": (0.6, 512.0, 150e9, 2e-5, 6e-5, 0.15, 2e12, 1e-5),
    "npu": (0.45, 1024.0, 100e9, 3e-5, 8e-5, 0.15, 1e12, 1.5e-5),
}


HOST_LINK = (20e9, 10e9)  # bytes/s pinned, pageable: `DevicePriors.host_link`


@dataclass(frozen=True)
class DevicePriors:
    """Prior means of the model's physical coefficients for one device family on one machine."""

    family: str
    efficiency: float  # share of the peak a large training matmul reaches
    half_tokens: float  # tokens per micro-batch and rank at which matmuls reach half of that
    # per dtype name (fp32, tf32, bf16, fp16): FLOP/s of one device (CPU: of one thread)
    peak_flops: dict[str, float]
    bandwidth: float  # bytes/s of one rank's link inside a node
    latency: float  # s per collective message (all-reduce, gather, scatter)
    host_unit_s: float  # s of host work per layer pass (dispatch, launches, autograd)
    node_devices: int  # devices of one node: larger groups cross nodes
    cross_node_share: float  # cross-node bandwidth as a share of the in-node one
    cores: int = 0  # CPU: cores the ranks share (0: not a CPU)
    mem_bandwidth: float = 5e9  # bytes/s of memory-bound kernels: one device (CPU: one thread)
    p2p_latency: float = 5e-5  # s per pipeline send or receive
    log_autocast: float = 0.0  # log speed of autocast's matmuls against the low dtype's peak
    autocast_max: float = 0.0  # the most autocast's matmuls start at, over the fp32 peak (0: no cap)
    # bytes/s between a device and host memory for offloaded activations (pinned, pageable):
    # PCIe Gen4 x16 copies run at about 25 GB/s from pinned buffers and half that from pageable
    # ones. Not fitted: no trial here has offloaded (CPU has nothing to offload to).
    host_link: tuple[float, float] = HOST_LINK

    def to_dict(self) -> dict[str, Any]:
        """For a study attribute (`keys.DEVICE_PRIORS`): what the devices a study ran on measured
        of themselves, which a server elsewhere cannot measure (`recorded_priors` reads it)."""
        return dataclasses.asdict(self)

    def peak(self, dtype: str, ranks: int = 1) -> float:
        """FLOP/s of one rank: a device, or on CPU its share of the cores (as the ranks set it)."""
        one = self.peak_flops.get(dtype) or self.peak_flops["fp32"]
        return one * self.threads(ranks)

    def autocast_offset(self, dtype: str) -> float:
        """Log correction on top of `log_autocast` for `dtype`'s matmuls: 0, or what takes a
        start above `autocast_max` times the fp32 peak down to it."""
        if self.autocast_max <= 0:
            return 0.0
        start = self.peak(dtype) / self.peak("fp32") * math.exp(self.log_autocast)
        return min(0.0, math.log(self.autocast_max / start))

    def threads(self, ranks: int = 1) -> float:
        """How many devices' (CPU: threads') worth of memory bandwidth one rank has."""
        if self.family == "cpu" and self.cores > 0:
            return float(max(1, self.cores // max(1, ranks)))
        return 1.0

    def oversubscription(self, ranks: int) -> float:
        """How many ranks share one core's worth of compute (1 when each has its own)."""
        if self.family != "cpu" or self.cores <= 0:
            return 1.0
        return max(1.0, ranks / self.cores)


def device_priors(device: DeviceInfo) -> DevicePriors:
    """Priors for `device` (on CPU, one thread's peak: ranks split the cores between them)."""
    eff, half, bw, lat, host, cross, mem_bw, p2p = _PRIORS.get(device.family, _PRIORS["cuda"])
    # The datasheet's peak, or one thread's measured matmul (cached per machine and torch). On a
    # CPU every dtype autocast runs is measured, native units or not: without them (no
    # AVX512-BF16/AMX, `DeviceInfo.fast_dtypes`) the lone F.linear converts through fp32 as
    # autocast's training matmuls do, and sets their speed (a Zen 3: bf16 linear 0.19x fp32, an
    # O1 or O2 gpt-tiny step 0.09-0.12x; started at the fp32 peak the model put that step at
    # 0.63-0.67x, BENCHMARKS section 11). An accelerator without native units has no datasheet
    # figure for the dtype and starts it at the fp32 peak.
    measured = device.amp_dtypes if device.family == "cpu" else device.fast_dtypes
    dtypes = ("fp32", *measured, *(("tf32",) if device.supports_tf32 else ()))
    peaks = {d: peak_tflops(device, d, 1) * 1e12 for d in dtypes}
    for dtype in device.amp_dtypes:
        peaks.setdefault(dtype, peaks["fp32"])
    cores = device.count if device.family == "cpu" else 0
    # One CPU machine holds every rank (ranks beyond its cores share them); on accelerators a
    # group larger than this machine's devices crosses nodes.
    node = device.count if device.family != "cpu" else 1 << 30
    return DevicePriors(
        device.family,
        eff,
        half,
        peaks,
        bw,
        lat,
        host,
        node,
        cross,
        cores,
        mem_bw,
        p2p_latency=p2p,
        log_autocast=CPU_LOG_AUTOCAST if device.family == "cpu" else 0.0,
        autocast_max=CPU_AUTOCAST_MAX_OVER_FP32 if device.family == "cpu" else 0.0,
    )


def recorded_priors(value: Any, family: str) -> DevicePriors | None:
    """`DevicePriors.to_dict` read back from a study attribute; None when it is absent, of another
    family, or not one this version can read (missing fields, or numbers that are not: the caller
    falls back to its own machine's priors, as before the attribute existed)."""
    if not isinstance(value, dict) or value.get("family") != family:
        return None
    fields = {f.name for f in dataclasses.fields(DevicePriors)}
    kept = {k: v for k, v in value.items() if k in fields}
    peaks, link = kept.get("peak_flops"), kept.get("host_link", HOST_LINK)
    numbers = [v for k, v in kept.items() if k not in ("family", "peak_flops", "host_link")]
    if not isinstance(peaks, dict) or not isinstance(link, list | tuple) or len(link) != 2:
        return None
    if not all(_finite(v) for v in (*numbers, *peaks.values(), *link)) or not _finite(peaks.get("fp32"), 0):
        return None
    try:
        return DevicePriors(**{**kept, "host_link": tuple(link)})
    except TypeError:  # a field this version needs is missing
        return None


def _finite(v: Any, above: float | None = None) -> bool:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    return ok and (above is None or v > above)
