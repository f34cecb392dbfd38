"""Torch pieces every family shares: the attention kernel switch, the decoder skeleton that
pipeline stages cut, split-invariant initialisation of (sharded) parameters, and the
vocabulary-parallel cross entropy used when tp > 1."""

from __future__ import annotations

import contextlib
import hashlib
import math
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}

# npu_fusion_attention's documented causal mode (sparse_mode=2) takes a fixed 2048x2048
# upper-triangular mask whatever the sequence length.
_NPU_CAUSAL_MASK_SIZE = 2048


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    """Causal attention over [batch, heads, seq, head_dim] tensors with the named kernel."""
    if backend == "npu_fusion":
        return _npu_fusion_attention(q, k, v)
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# What the kernel switch puts in a traced graph: calls to these two private functions, with the
# kernel's name as a constant argument. AOTAutograd's cache refuses a graph with an unlisted private
# call, so every compiled trial traced and partitioned its joint graph again (about 1.4 s of a
# gpt-tiny warm-up on the test machine). The name is in the graph, hence in the cache key: a graph
# traced under one kernel is never reused under another. Keyed by torch's version too.
SDPA_GRAPH_CALLS = ("torch.nn.attention._backend_from_string", "torch.nn.attention._sdpa_kernel")


def let_compile_cache_the_kernel_switch() -> None:
    """Mark the kernel switch's in-graph calls cacheable (before compiling a model that uses
    `attention`); entries someone else marked stay."""
    import torch._inductor.config as inductor

    for name in SDPA_GRAPH_CALLS:
        inductor.unsafe_marked_cacheable_functions.setdefault(name, torch.__version__)


def _npu_fusion_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    import torch_npu  # only reachable on Ascend, where the feasibility rules allow npu_fusion

    n = _NPU_CAUSAL_MASK_SIZE
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), diagonal=1)
    out = torch_npu.npu_fusion_attention(
        q, k, v, q.shape[1], "BNSD", atten_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]),
        keep_prob=1.0, sparse_mode=2,
    )  # fmt: skip
    return out[0]


class Decoder(nn.Module):
    """What every family's model is: `layers` (a ModuleDict keyed by global layer index, so names
    survive slicing) between the parts the first stage owns (`first_parts`) and the parts the
    last stage owns (`last_parts`). A pipeline stage is the same class with the rest removed."""

    first_parts: tuple[str, ...] = ()
    last_parts: tuple[str, ...] = ()

    def __init__(self, m):
        super().__init__()
        self.spec = m
        # amp=O1: (device type, dtype) to autocast the forward in. The model owns it so a
        # pipeline stage, DDP and FSDP all run their forward under it and no backward does.
        self.autocast: tuple[str, torch.dtype] | None = None
        # Set by the family's `parallelize` when tp > 1: the logits are then sharded over the
        # vocabulary and `loss` is the vocabulary-parallel cross entropy over this group.
        self.vocab_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] -> logits [batch, seq, vocab/tp] (a middle stage: hidden -> hidden)."""
        if self.autocast is None:
            return self._forward(x)
        device_type, dtype = self.autocast
        with torch.autocast(device_type, dtype=dtype):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def keep_stage(self, stage: int, stages: int) -> Decoder:
        """Drop everything pipeline stage `stage` of `stages` does not own (in place)."""
        from tuner.models import family_of

        owned = family_of(self.spec).stage_layers(self.spec, stage, stages)
        for name in list(self.layers.keys()):
            if int(name) not in owned:
                del self.layers[name]
        for part in () if stage == 0 else self.first_parts:
            setattr(self, part, None)
        for part in () if stage == stages - 1 else self.last_parts:
            setattr(self, part, None)
        return self

    def retie(self) -> None:
        """Share weights that the family ties (after a step that may have replaced them)."""

    def init_fixed(self) -> None:
        """After the parameters are drawn (`init_parameters`): what the family's own modules set to
        fixed values, the same on every rank whatever the split (buffers a meta build leaves
        empty); nothing for the built-in families, whose modules hold no buffers."""

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over tokens, in fp32, on whole or vocabulary-sharded logits."""
        if self.vocab_group is None:
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_group)


# Wrappers the workload puts around blocks before the weights exist; their attribute names are
# not part of a parameter's identity, so initialisation does not see them.
WRAPPER_NAMES = frozenset({"inner", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def canonical_name(name: str) -> str:
    """A parameter's name in the plain single-process model."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _local_slices(p: torch.Tensor) -> tuple[slice, ...] | None:
    """Where this rank's shard of a DTensor sits in the full tensor (None: not a DTensor)."""
    if "torch.distributed.tensor" not in sys.modules:
        # No DTensor exists yet. Importing the package would page in tens of MiB of code that a
        # single rank's measured peak (RSS growth) would then count.
        return None
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


# A rule maps a canonical parameter name to ("normal", std), ("ones", 0) or ("zeros", 0).
InitRule = Callable[[str], tuple[str, float]]


# Tensors are drawn in blocks of this many elements, each from its own generator, so the blocks
# of a large tensor are drawn in parallel (one thread per core the rank has; torch's normal_
# on CPU runs on one core). The numbers depend on the block size, never on the split.
DRAW_BLOCK = 1 << 22


def _draw_normal(
    out: torch.Tensor, std: float, seed: int, name: str, pool: ThreadPoolExecutor | None
) -> None:
    """Fill contiguous fp32 `out` with N(0, std) from (seed, name)'s generators, block by block."""
    flat = out.view(-1)
    starts = range(0, flat.numel(), DRAW_BLOCK)

    @torch.no_grad()  # grad mode is per thread: the pool's threads need it too
    def draw(i: int) -> None:
        gen = torch.Generator(device=out.device).manual_seed(_param_seed(seed, f"{name}#{i}"))
        flat[starts[i] : starts[i] + DRAW_BLOCK].normal_(0.0, std, generator=gen)

    if pool is None or len(starts) == 1:
        for i in range(len(starts)):
            draw(i)
    else:
        list(pool.map(draw, range(len(starts))))


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, rule: InitRule) -> None:
    """Draw every parameter from generators keyed by (seed, its canonical name), on the device
    the parameter lives on, and keep this rank's shard of it: every split starts from the same
    function. A sharded parameter draws its full tensor (one tensor at a time) and keeps its
    slice; an unsharded fp32 one is drawn in place."""
    seen: set[int] = set()
    threads = torch.get_num_threads()
    with ThreadPoolExecutor(threads) if threads > 1 else contextlib.nullcontext() as pool:
        for name, p in model.named_parameters(remove_duplicate=True):
            if id(p) in seen:
                continue
            seen.add(id(p))
            canon = canonical_name(name)
            kind, std = rule(canon)
            where = _local_slices(p)
            local = p.to_local() if where is not None else p
            if kind == "ones":
                local.fill_(1.0)
            elif kind == "zeros":
                local.zero_()
            elif where is None and local.dtype == torch.float32 and local.is_contiguous():
                _draw_normal(local, std, seed, canon, pool)
            else:
                full = torch.empty(p.shape, device=local.device)
                _draw_normal(full, std, seed, canon, pool)
                local.copy_(full if where is None else full[where])


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's cross entropy over logits sharded on the vocabulary: each rank holds
    vocab/tp columns; three all-reduces (max, sum of exponentials, target logit) give every rank
    the exact loss, and the gradient (softmax minus one-hot) is local."""

    @staticmethod
    def forward(ctx, logits, targets, group):  # type: ignore[override]
        x = logits.float()
        width = x.shape[-1]
        start = dist.get_rank(group) * width
        peak = x.amax(-1, keepdim=True)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = x - peak
        exp = shifted.exp()
        total = exp.sum(-1, keepdim=True)
        dist.all_reduce(total, group=group)
        local = targets - start
        inside = (local >= 0) & (local < width)
        index = local.clamp(0, width - 1).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1) * inside
        dist.all_reduce(target_logit, group=group)
        loss = total.squeeze(-1).log() - target_logit
        ctx.save_for_backward(exp.div_(total), index, inside)
        ctx.dtype = logits.dtype
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        softmax, index, inside = ctx.saved_tensors
        g = softmax.scatter_add_(-1, index, -inside.unsqueeze(-1).to(softmax.dtype))
        g.mul_(grad / inside.numel())
        return g.to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Mean token loss of [batch, seq, vocab/tp] logits against [batch, seq] global targets."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group)
