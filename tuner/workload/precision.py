"""Mixed precision (the `amp`, `amp_dtype` and `optimizer_impl` knobs): which dtype the matmuls
run in, the optimizer, fp32 master weights for amp=O2, and the fp16 grad scaler."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

from tuner.config import Config

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def low_dtype(config: Config) -> torch.dtype | None:
    """The low-precision dtype of this config, None for amp=O0."""
    return None if config.amp == "O0" else LOW_DTYPES[config.amp_dtype]


def matmul_dtype_name(config: Config) -> str:
    """The dtype matmuls actually run in, as `tuner.devices.peak_tflops` names it."""
    if config.amp != "O0":
        return config.amp_dtype
    return "tf32" if config.tf32 else "fp32"


class ShardAwareGradScaler(torch.amp.GradScaler):
    """torch's GradScaler, except that tensor-parallel (DTensor) gradients are unscaled and
    inf-checked through their local shards: torch's version refuses lists mixing DTensors and
    tensors. Agreeing on the verdict across ranks is the caller's job (`Training`)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        from torch.distributed.tensor import DTensor

        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if not allow_fp16 and g.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                grads[(g.device, g.dtype)].append(g)
        found_per_device: dict[torch.device, torch.Tensor] = {}
        for (device, _), group_grads in grads.items():
            found = found_per_device.setdefault(device, found_inf.to(device, copy=True))
            torch._amp_foreach_non_finite_check_and_unscale_(group_grads, found, inv_scale.to(device))
        return found_per_device


def make_scaler(config: Config, device_type: str) -> torch.amp.GradScaler | None:
    """fp16 has too little range for small gradients; bf16 and fp32 need no scaling."""
    if config.amp != "O0" and config.amp_dtype == "fp16":
        return ShardAwareGradScaler(device_type)
    return None


def make_optimizer(
    params: Iterable[torch.Tensor], optimizer: str, lr: float, impl: str
) -> torch.optim.Optimizer:
    """`optimizer_impl`: for_loop (one kernel per tensor), foreach (batched), fused (one kernel)."""
    from torch.distributed.tensor import DTensor

    kwargs = {"foreach": impl == "foreach", "fused": impl == "fused"}
    params = list(params)
    # A foreach/fused kernel cannot mix DTensors (tensor-parallel weights) with plain tensors
    # (replicated norms, embeddings); one param group each keeps them in separate launches.
    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    groups = [{"params": g} for g in (plain, sharded) if g]
    if optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, **kwargs)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.0, **kwargs)


class MasterWeights:
    """amp=O2 done honestly: the model's parameters are low precision, the optimizer steps fp32
    copies of them, and the updated copies are written back after each step.

    `optimizer` is the inner optimizer over the fp32 copies; the GradScaler unscales and
    inf-checks their (upcast) gradients.
    """

    def __init__(self, params: Iterable[torch.Tensor], make: Callable[[list], torch.optim.Optimizer]):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().clone().float().requires_grad_(True) for p in self.params]
        self.optimizer = make(self.master)

    def grads_to_master(self) -> None:
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def master_to_params(self) -> None:
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)
