"""Apply a config's knobs to a (stage of the) model with torch's own mechanisms.

`apply_all` is the contract: pipeline split, tensor parallel, recompute, offload, compile, FSDP,
materialise, DDP, in that order. The model arrives on the meta device. Each step needs the
module the previous one left:
- the pipeline split comes first so every later step only touches the layers this rank owns;
- tensor parallel must see the plain `nn.Linear`s (before any wrapper) and must turn weights
  into DTensors before DDP/FSDP register their hooks on them;
- recompute and offload wrap whole blocks (or attention) so they act on the TP-sharded compute;
- compile runs per block after the wrappers so checkpointing is traced into the compiled graph,
  and before data parallelism so gradient communication stays outside compiled regions;
- FSDP shards the final set of parameters, still on meta (it only needs shapes);
- only then are this rank's shards allocated on the device and initialised (`materialize`), so
  no rank ever holds more than its part of the model;
- DDP comes last: it broadcasts real weights when it wraps the module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import parallel as _tp  # noqa: F401 - see below
from torch.utils.checkpoint import checkpoint

from tuner.config import Config, recomputed_layers
from tuner.models import family_of
from tuner.models.layers import Decoder, let_compile_cache_the_kernel_switch
from tuner.workload.parallel import ParallelDims

# The DTensor stack (and the sympy it pulls in) loads with this module, before a rank takes its
# memory baseline, so a rank's measured peak never counts tens of MiB of code as model memory.


class Checkpointed(nn.Module):
    """Keeps only the wrapped module's inputs for backward and recomputes the rest."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor, **kwargs) -> torch.Tensor:
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class Offloaded(nn.Module):
    """Moves the tensors the wrapped module saves for backward to host memory."""

    def __init__(self, inner: nn.Module, pin_memory: bool):
        super().__init__()
        self.inner = inner
        self.pin_memory = pin_memory

    def forward(self, *args: torch.Tensor, **kwargs) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory):
            return self.inner(*args, **kwargs)


def apply_pipeline_split(model: Decoder, dims: ParallelDims, pp_rank: int) -> Decoder:
    if dims.pp_enabled:
        model.keep_stage(pp_rank, dims.pp)
    return model


def apply_tp(model: Decoder, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """The family's Megatron-style plan (`tuner.models.<family>_nn.parallelize`): column-wise
    into each block's attention and MLP, row-wise out of them (one all-reduce each, or a
    reduce-scatter and an all-gather under sequence parallelism), whole heads per rank, and the
    embedding and output split over the vocabulary with the loss on the sharded logits."""
    family_of(model.spec).parallelize(model, tp_mesh, sequence_parallel)


def apply_recompute(model: Decoder, mode: str, fraction: float = 1.0) -> None:
    """selective: checkpoint attention only; full: checkpoint the whole block. Only the first
    `recompute_layers` of this stage's blocks (Megatron's block method): they are the ones whose
    activations wait longest for their backward."""
    names = list(model.layers.keys())
    for name in names[: recomputed_layers(len(names), fraction)]:
        block = model.layers[name]
        if mode == "full":
            model.layers[name] = Checkpointed(block)
        elif mode == "selective":
            setattr(block, block.ATTENTION, Checkpointed(getattr(block, block.ATTENTION)))


def apply_offload(model: Decoder, pin_memory: bool) -> None:
    for name, block in list(model.layers.items()):
        model.layers[name] = Offloaded(block, pin_memory)


def apply_compile(model: Decoder, mode: str) -> None:
    let_compile_cache_the_kernel_switch()
    # Per block: every block has the same graph, so Inductor compiles it once and reuses it.
    for block in model.layers.values():
        block.compile(mode=mode)


# The training step (0-based) PowerSGD compresses from; before it, plain all-reduces. 2 is the
# least torch allows with error feedback: compress from the first steps, a short trial must
# measure it.
POWERSGD_START_ITER = 2


def first_steady_step(config: Config) -> int:
    """The first training step after the once-only work that a config's own mechanisms do at a
    fixed step, which warm-up must hold whatever the step times or its ceiling say (0: none).
    PowerSGD's first compressed step allocates its low-rank matrices and error buffers: on the test
    machine's gpt-tiny it took 1.4-3.4x a steady step, and with the recipe's 2 warm-up steps it was
    the first measured one in every PowerSGD run (BENCHMARKS section 8)."""
    return POWERSGD_START_ITER + 1 if config.normalized().grad_compression == "powersgd" else 0


def apply_ddp(model: nn.Module, dims: ParallelDims, config: Config, device: torch.device) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    if dims.tp_enabled:
        # DDP cannot bucket DTensors; this swaps them for their local shards and back.
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(model)
    group = dims.mesh["dp"].get_group()
    ddp = DistributedDataParallel(
        model,
        process_group=group,
        bucket_cap_mb=config.bucket_mb,
        device_ids=[device.index] if device.type != "cpu" else None,
    )
    if config.grad_compression == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif config.grad_compression == "bf16":
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif config.grad_compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=POWERSGD_START_ITER
        )
        hook = powerSGD_hook.powerSGD_hook
        if dist.get_backend(group) == "gloo":
            hook = _one_bucket_at_a_time(hook)
        ddp.register_comm_hook(state, hook)
    return ddp


def _one_bucket_at_a_time(hook: Callable) -> Callable:
    """A DDP comm hook that finishes each bucket before DDP hands it the next one.

    PowerSGD chains two more all-reduces per bucket from its future's callbacks, which gloo runs on
    its worker threads. With several buckets in flight those all-reduces reach gloo in a different
    order on each rank: gloo, which matches collectives by order, then aborts ("Received data size
    doesn't match expected size") or both ranks wait forever (a gpt-tiny study with bucket_mb=1
    lost 300 s to each such trial). Waiting here, on the backward thread, keeps every rank's
    collectives in DDP's bucket order, which DDP makes the same on every rank. The price: this
    hook's communication no longer overlaps the rest of the backward pass on gloo (a measured
    effect of the config like any other, which the study sees in its throughput)."""

    def ordered(state, bucket):
        done = torch.futures.Future()
        done.set_result(hook(state, bucket).wait())
        return done

    return ordered


def apply_fsdp(model: Decoder, dims: ParallelDims, param_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2: shard each block, then the rest. With amp=O2 the sharded fp32 parameters are the
    master weights and FSDP gathers them in `param_dtype` for compute."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    mesh = dims.mesh["dp"]
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def apply_all(
    model: Decoder,
    config: Config,
    dims: ParallelDims,
    pp_rank: int,
    device: torch.device,
    materialize: Callable[[nn.Module], None],
    fsdp_param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Every knob, in the order the module docstring explains. `materialize(module)` allocates
    and initialises the rank's parameters. Returns the module to train."""
    apply_pipeline_split(model, dims, pp_rank)
    if dims.tp_enabled:
        apply_tp(model, dims.mesh["tp"], config.sequence_parallel)
    if config.recompute != "none":
        apply_recompute(model, config.recompute, config.recompute_layers)
    if config.offload:
        apply_offload(model, config.pin_memory)
    if config.compile != "none":
        apply_compile(model, config.compile)
    fsdp = dims.dp_enabled and config.dp_shard == "fsdp"
    module: nn.Module = apply_fsdp(model, dims, fsdp_param_dtype) if fsdp else model
    materialize(module)
    if not dims.dp_enabled or fsdp:
        return module
    return apply_ddp(module, dims, config, device)
