"""Which scaled-dot-product-attention kernel takes which compute dtype and head size, per device
family: the limits PyTorch documents for `torch.nn.attention.SDPBackend` (and enforces in
`sdp_utils`), and torch_npu documents for `npu_fusion_attention`. The feasibility rules
(`tuner.config`) and the fp32 reference (`tuner.baseline`) both read this table.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_DTYPES = ("fp32", "bf16", "fp16")
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class KernelLimits:
    dtypes: tuple[str, ...]  # compute dtypes the kernel accepts
    max_head_dim: int | None = None
    align_bytes: int = 0  # head_dim * element size must be a multiple of this (0: any)
    note: str = ""  # where the limit comes from, shown in the refusal
    takes_mask: bool = True  # whether it runs attention with an explicit mask (a sliding window)


_LIMITS: dict[tuple[str, str], KernelLimits] = {
    # CPU: the math path and the CPU flash kernel take float, bfloat16 and half.
    ("cpu", "math"): KernelLimits(ALL_DTYPES),
    ("cpu", "flash"): KernelLimits(ALL_DTYPES),
    ("cuda", "math"): KernelLimits(ALL_DTYPES),
    # FlashAttention-2: fp16/bf16 only, head_dim <= 256 (sm_80+, which DeviceInfo already says).
    ("cuda", "flash"): KernelLimits(("bf16", "fp16"), 256, 0, "FlashAttention takes fp16/bf16 only", False),
    # Memory-efficient (cutlass) kernel: every dtype, 16-byte aligned head_dim.
    ("cuda", "efficient"): KernelLimits(ALL_DTYPES, None, 16),
    # cuDNN fused attention: fp16/bf16, head_dim a multiple of 8 and at most 128.
    # Neither takes an attn_mask in PyTorch's SDPA dispatch (sdp_utils: check_for_attn_mask).
    ("cuda", "cudnn"): KernelLimits(("bf16", "fp16"), 128, 16, "cuDNN attention takes fp16/bf16 only", False),
    ("npu", "math"): KernelLimits(ALL_DTYPES),
    # torch_npu.npu_fusion_attention: query/key/value fp16 or bf16, head_dim at most 512.
    ("npu", "npu_fusion"): KernelLimits(
        ("bf16", "fp16"), 512, 0, "npu_fusion_attention takes fp16/bf16 only"
    ),
}


def limits(family: str, backend: str) -> KernelLimits | None:
    """The kernel's limits on this family; None when the family has no such kernel."""
    return _LIMITS.get((family, backend))


def compute_dtype(amp: str, amp_dtype: str) -> str:
    """The dtype attention runs in: fp32 at O0; autocast (O1) and low-precision params (O2) feed
    SDPA in the low dtype (it is on autocast's lower-precision list)."""
    return "fp32" if amp == "O0" else amp_dtype


def kernel_reasons(family: str, backend: str, dtype: str, head_dim: int, masked: bool = False) -> list[str]:
    """Why `backend` cannot run attention in `dtype` with this head size on `family`, with an
    explicit mask where `masked` (`ModelFamily.masked_attention`); [] if it can."""
    lim = limits(family, backend)
    if lim is None:
        return []  # DeviceInfo.attention_backends already refuses a kernel the family lacks
    r: list[str] = []
    if dtype not in lim.dtypes:
        fix = "amp=O1 or O2" if dtype == "fp32" else f"amp_dtype in {', '.join(lim.dtypes)}"
        r.append(
            f"attention={backend} cannot run in {dtype} on {family} ({lim.note or 'PyTorch limit'}); "
            f"use {fix}, or attention=math"
            + (" or efficient" if family == "cuda" and backend != "efficient" else "")
        )
    if lim.max_head_dim is not None and head_dim > lim.max_head_dim:
        r.append(f"attention={backend} supports head_dim <= {lim.max_head_dim} on {family}, got {head_dim}")
    if lim.align_bytes and (head_dim * _BYTES[dtype]) % lim.align_bytes:
        multiple = lim.align_bytes // _BYTES[dtype]
        r.append(f"attention={backend} needs head_dim a multiple of {multiple} in {dtype}, got {head_dim}")
    if masked and not lim.takes_mask:
        r.append(f"attention={backend} takes no attention mask on {family}, and this model's sliding-window "
                 "layers need one at this seq_len; use attention=efficient or math")  # fmt: skip
    return r


def fp32_backends(family: str, offered: tuple[str, ...]) -> list[str]:
    """The attention kernels of `offered` that run in fp32 on `family`, fastest first."""
    preference = ("flash", "efficient", "math")  # CPU flash takes fp32; on CUDA efficient does
    return [b for b in preference if b in offered and (lim := limits(family, b)) and "fp32" in lim.dtypes]
