"""The baseline config a study measures first: what a careful user would try by hand."""

from __future__ import annotations

from typing import Any

from tuner.attention_kernels import compute_dtype, fp32_backends, kernel_reasons
from tuner.config import Config
from tuner.devices import DeviceInfo
from tuner.prune import verdict
from tuner.recipe import Recipe
from tuner.space import SearchSpace

# Attention kernels in order of preference: the fused, memory-efficient kernel of each family.
_FAST_ATTENTION = ("flash", "npu_fusion", "efficient", "cudnn")


def _pick(space: SearchSpace, name: str, preferred: list[Any]) -> Any:
    domain = space.domains[name] or ()
    for value in preferred:
        if value in domain:
            return value
    return domain[0] if domain else getattr(Config(), name)


def baseline_config(recipe: Recipe, device: DeviceInfo, space: SearchSpace) -> Config:
    """Largest micro-batch predicted to fit (the estimate times the device's reserved/allocated
    prior, within the budget), no recompute, flash attention where
    available, dp over all devices, other knobs at defaults; AMP O1 with the device's preferred
    fast dtype (bf16, then fp16) when the space has one, else fp32 (O0).

    Only a dtype the device runs natively counts (`DeviceInfo.fast_dtypes`): autocast to bf16 on
    a CPU without AVX512-BF16/AMX is several times slower than fp32, and no careful user picks it.
    """
    devices = recipe.hardware.devices
    splits = space.splits(devices)
    dp, tp, pp = (devices, 1, 1) if (devices, 1, 1) in splits else max(splits, default=(devices, 1, 1))
    default = Config()
    values = {
        name: _pick(space, name, [getattr(default, name)])
        for name in default.to_dict()
        if name not in ("dp", "tp", "pp")
    }
    values.update(dp=dp, tp=tp, pp=pp, recompute=_pick(space, "recompute", ["none"]))
    allowed = space.domains["amp_dtype"] or ()
    fast = [d for d in device.fast_dtypes if d in device.amp_dtypes and d in allowed]
    if fast:
        values.update(amp=_pick(space, "amp", ["O1"]), amp_dtype=fast[0])
    else:
        values.update(amp=_pick(space, "amp", ["O0"]))
    # The fused kernel that takes the dtype chosen above (flash cannot run an fp32 baseline on CUDA).
    from tuner.models import family_of

    dtype = compute_dtype(values["amp"], values["amp_dtype"])
    masked = family_of(recipe.model).masked_attention(recipe.model)
    attention = [
        a
        for a in (*_FAST_ATTENTION, "math")
        if a in device.attention_backends
        and not kernel_reasons(device.family, a, dtype, recipe.model.head_dim, masked)
    ]
    values["attention"] = _pick(space, "attention", attention)
    sizes = sorted(space.domains["micro_batch_size"] or (1,), reverse=True)
    candidates = [Config(**{**values, "micro_batch_size": m}) for m in sizes]
    for config in candidates:  # predicted to fit: the search's margin for estimator error is not for it
        if verdict(config, recipe, device, margin=0.0).reason is None:
            return config
    # Nothing fits: the smallest micro-batch is the honest baseline; the study prunes it.
    return candidates[-1]


def fp32_reference(base: Config, recipe: Recipe, device: DeviceInfo, space: SearchSpace) -> Config | None:
    """The fp32 (O0) run every low-precision config's losses are checked against: the baseline
    at O0, with an attention kernel that runs in fp32 (flash and cuDNN attention on CUDA, and
    npu_fusion_attention on Ascend, take fp16/bf16 only). None when the space has no O0.

    Its losses are all it is for, and they do not depend on the micro-batch (every micro-batch
    split runs the same global batch). fp32 activations are twice autocast's: where the
    reference is predicted not to fit at the baseline's micro-batch, the largest micro-batch at
    which it is, rather than a reference the study would drop."""
    if base.amp == "O0" or "O0" not in (space.domains["amp"] or ()):
        return None
    attention = base.attention
    if attention not in fp32_backends(device.family, device.attention_backends):
        attention = _pick(space, "attention", fp32_backends(device.family, device.attention_backends))
    fp32 = {**base.to_dict(), "amp": "O0", "attention": attention}
    smaller = sorted(
        (s for s in space.domains["micro_batch_size"] or () if s < base.micro_batch_size), reverse=True
    )
    candidates = [Config(**{**fp32, "micro_batch_size": m}) for m in (base.micro_batch_size, *smaller)]
    for config in candidates:
        if verdict(config, recipe, device, margin=0.0).reason is None:
            return config
    return candidates[-1]  # none predicted to fit: the study's own check decides
