"""Analytic memory and FLOPs of one config before it touches a device, so the study can skip
configs that would run out of memory. Counts what `tuner.workload` actually allocates, per rank.

The model: weights, gradients and optimizer state by dtype and sharding; the tensors autograd
saves for backward by micro-batch, recompute, tensor/pipeline split and dtype; the fp32 loss over
the logits; plus a constant per device family for what no formula sees (allocator caching,
framework scratch, kernel code paged in on first use), calibrated from measured trials below.

The peak is the larger of two moments of a step, because not everything lives at once:
- backward of the last microbatch: weights, optimizer state, DDP's buckets, what the split
  gathers (FSDP), the gradients of the earlier microbatches, the saved activations, and the
  larger of the loss's temporaries (when the loss's backward starts) and one block's backward
  workspace (after the loss's temporaries are freed);
- the optimizer step: weights, state, buckets, every gradient, and what only the step allocates
  (foreach's temporaries, amp=O2's fp32 gradient copies); the activations are gone by then.
Gradients of the last microbatch itself grow while its activations are freed, so the first
moment counts none of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from tuner.config import Config, microbatches, recomputed_layers
from tuner.devices import DeviceInfo
from tuner.models import family_of
from tuner.recipe import Recipe
from tuner.workload.flops import flops_per_step, stage_flops_per_token

GiB = 2**30
MiB = 2**20

# What the formulas cannot see, per family: measured peak minus the tensors' peak.
# cpu: 50 MiB, measured as a trial rank's resident-set growth in exact host memory
# (`tuner.memory.exact_host_memory`) minus its tensors' peak by torch's profiler on five fp32
# llama-tiny configs (dp ddp/fsdp, tp; 47 to 56 MiB). Most of it is library code: a rank forked
# from the warm helper starts without the helper's file-backed pages mapped and faults in every
# code page it runs (a forked child re-faulted 23 MiB of code to repeat a step its parent had
# run); the rest is gloo's buffers, Python objects and thread stacks. It was 30 MiB when the
# measured peak was the default RSS, whose glibc heap retention hid part of it.
# tests/test_estimate.py re-measures three configs and prints the errors (`pytest -s`).
# cuda/npu: not calibrated on hardware yet; cuBLAS/cuDNN (or CANN) workspaces and the caching
# allocator's rounding are typically tens of MiB, so a conservative 256 MiB is assumed.
FAMILY_OVERHEAD_BYTES = {"cpu": 50 * MiB, "cuda": 256 * MiB, "npu": 256 * MiB}
# Low-precision matmuls on CPU run through oneDNN, which JIT-compiles and caches a kernel per
# shape. The same eight Linear forward/backward passes grew a fresh process by 39 MiB in bf16
# against 15 MiB in fp32 (tensors freed, exact host memory): 24 MiB. In trial ranks (forked from
# the warm helper, allocated peaks read by `tuner.memory.HeldMemory`) a gpt-tiny bf16 config's
# estimate exceeded what it took by 10-12 MiB more than its split's fp32 config's did, on each of
# the five 2-rank splits (benchmarks/results/estimator_splits_gpt_held.txt): 13 MiB.
LOW_PRECISION_KERNEL_BYTES = {"cpu": 13 * MiB}

_OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}  # fp32 tensors per parameter


@dataclass(frozen=True)
class Estimate:
    """Predicted memory of the busiest rank (bytes) and the step's model FLOPs (all ranks)."""

    peak_mem_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int  # optimizer states, fp32 master weights and their gradients (amp=O2)
    activation_bytes: int  # saved for backward, all microbatches in flight, plus one layer's workspace
    logits_bytes: int  # fp32 log-probabilities and their gradient at the loss
    comm_bytes: int  # DDP gradient buckets, FSDP's unsharded parameters
    overhead_bytes: int  # the family's calibrated constant
    flops_per_step: float  # model FLOPs of one optimizer step over the global batch
    hardware_flops_per_step: float  # including recompute
    stage: int  # the pipeline stage the peak belongs to
    accumulated_grads_bytes: int = 0  # gradients of earlier microbatches, alive in the last one's backward
    optimizer_step_bytes: int = 0  # the part of optimizer_bytes that exists only while stepping
    peak_phase: str = "backward"  # the moment that sets the peak: backward | optimizer
    offloaded_bytes: int = 0  # saved tensors of one microbatch that offload keeps in host memory

    def breakdown(self) -> dict[str, float | str]:
        """Every term in GiB (and the FLOPs in TFLOP), for tables and trial evidence."""
        out = {k: v / GiB for k, v in asdict(self).items() if k.endswith("_bytes")}
        out["flops_per_step_tflop"] = self.flops_per_step / 1e12
        out["hardware_flops_per_step_tflop"] = self.hardware_flops_per_step / 1e12
        out["stage"] = self.stage
        out["peak_phase"] = self.peak_phase
        return out


def budget_bytes(recipe: Recipe, device: DeviceInfo) -> int:
    """Peak memory one rank may use: the recipe's budget, else the device's memory.

    On CPU every rank shares the machine's RAM, so each gets an equal part of it.
    """
    if recipe.hardware.memory_budget_gb is not None:
        return int(recipe.hardware.memory_budget_gb * GiB)
    if device.family == "cpu":
        return device.memory_bytes // recipe.hardware.devices
    return device.memory_bytes


# The estimator may under-predict; a config predicted within this fraction over the budget is
# still tried on the device rather than pruned (the study) or warned about (`tuner measure`).
OOM_MARGIN = 0.15

# The estimator predicts the allocated peak; the budget is checked against the reserved one (what
# the allocator's pool, or a CPU rank's process with glibc's retained heap, holds). Their ratio
# before a study has measured any: on CPU the median over the 27 two-rank trials of
# benchmarks/estimator_splits.py (gpt-tiny and llama-tiny, every split; BENCHMARKS.md section 9):
# 1.28 to 1.34 in three runs, single trials 1.10 to 1.85; on CUDA the median over six configs of
# Llama-3 8B's layers on an H200 (benchmarks/cuda_check.sh, BENCHMARKS "CUDA"): 1.01 to 1.16.
# Ascend is not measured here, so its prior claims no slack.
RESERVED_OVER_ALLOCATED = {"cpu": 1.29, "cuda": 1.06}


def reserved_ratio_prior(family: str) -> float:
    """The reserved/allocated peak ratio a study starts from (`RESERVED_OVER_ALLOCATED`)."""
    return RESERVED_OVER_ALLOCATED.get(family, 1.0)


def predicts_oom(est: Estimate, budget: int, margin: float = OOM_MARGIN, calibration: float = 1.0) -> bool:
    """True when the estimate, scaled by `calibration` (measured/estimated peaks seen so far),
    exceeds the budget by more than `margin` (the estimator's error)."""
    return est.peak_mem_bytes * calibration > budget * (1 + margin)


def estimate(recipe: Recipe, config: Config, device: DeviceInfo) -> Estimate:
    """Memory of the busiest rank (the pipeline stage with the largest peak) and the step's FLOPs."""
    stages = [_stage(recipe, config, device, s) for s in range(config.pp)]
    worst = max(stages, key=lambda e: e.peak_mem_bytes)
    model_flops = flops_per_step(recipe)
    hardware = sum(stage_flops_per_token(recipe.model, config)) * recipe.tokens_per_step
    return replace(worst, flops_per_step=model_flops, hardware_flops_per_step=hardware)


def _stage(recipe: Recipe, config: Config, device: DeviceInfo, stage: int) -> Estimate:
    state = _state_bytes(recipe, config, stage)
    activations, logits, workspace, offloaded = _activation_bytes(recipe, config, device, stage)
    overhead = FAMILY_OVERHEAD_BYTES.get(device.family, 256 * MiB)
    if config.amp != "O0":
        overhead += LOW_PRECISION_KERNEL_BYTES.get(device.family, 0)
    held = state.params + state.states + state.buckets  # alive through the whole step
    # The loss's temporaries are freed before the first block's backward, where one block's
    # workspace (its recomputed activations, its activation gradients) appears: never both.
    saved = activations - workspace
    backward = held + state.gathered + state.accumulated + saved + max(logits, workspace)
    optimizer = held + state.grads + state.step
    return Estimate(
        peak_mem_bytes=int(max(backward, optimizer) + overhead),
        params_bytes=int(state.params),
        grads_bytes=int(state.grads),
        optimizer_bytes=int(state.states + state.step),
        activation_bytes=int(activations),
        logits_bytes=int(logits),
        comm_bytes=int(state.buckets + state.gathered),
        overhead_bytes=int(overhead),
        flops_per_step=0.0,
        hardware_flops_per_step=0.0,
        stage=stage,
        accumulated_grads_bytes=int(state.accumulated),
        optimizer_step_bytes=int(state.step),
        peak_phase="backward" if backward >= optimizer else "optimizer",
        offloaded_bytes=int(offloaded),
    )


def _stage_params(recipe: Recipe, config: Config, stage: int) -> tuple[int, int]:
    """(parameters of one rank of `stage`, those outside the blocks). Under tp the blocks' Linear
    weights and the vocabulary-sized embedding and output are split; norms (and gpt's position
    embedding) are whole on every rank."""
    m, c = recipe.model, config
    family = family_of(m)
    first, last = stage == 0, stage == c.pp - 1
    matmul = family.block_matmul_params(m)
    block = matmul // c.tp + (family.block_params(m) - matmul)
    root = (family.embedding_params(m) if first else 0) + (family.head_params(m) if last else 0)
    vocab = family.vocab_params(m, first, last)
    root = root - vocab + vocab // c.tp
    return (m.layers // c.pp) * block + root, root


@dataclass(frozen=True)
class _State:
    """Bytes of one rank's weights, gradients and optimizer, by when they are alive."""

    params: int
    grads: int  # all of this rank's gradients, as the optimizer steps on them
    states: int  # optimizer states (and amp=O2's fp32 master weights): always alive
    step: int  # alive only while the optimizer steps
    buckets: int  # DDP's bucket buffers: always alive
    gathered: int  # FSDP's unsharded parameters during forward and backward
    accumulated: int  # gradients of earlier microbatches during the last one's backward


def _state_bytes(recipe: Recipe, config: Config, stage: int) -> _State:
    m, c = recipe.model, config
    fsdp = c.dp > 1 and c.dp_shard == "fsdp"
    n_params, root = _stage_params(recipe, c, stage)
    family = family_of(m)
    matmul = family.block_matmul_params(m)
    block = matmul // c.tp + (family.block_params(m) - matmul)  # what FSDP gathers at a time
    shard = c.dp if fsdp else 1
    p_bytes = 2 if (c.amp == "O2" and not fsdp) else 4  # O2 casts the model; FSDP keeps fp32 shards
    params = n_params * p_bytes // shard
    grads = params
    states = _OPTIMIZER_STATES[recipe.train.optimizer] * 4 * n_params // shard
    step = 0
    if c.amp == "O2" and not fsdp:
        states += 4 * n_params  # fp32 master weights
        step += 4 * n_params  # the upcast gradients they step on (freed by the next zero_grad)
    if c.optimizer_impl == "foreach":
        step += 4 * n_params // shard  # foreach's batched temporaries while stepping
    buckets = grads if c.dp > 1 and not fsdp else 0  # DDP's buckets are a second copy of the gradients
    gathered = 0
    if fsdp:
        # The root (embedding, final norm, output) stays gathered from the first forward to the
        # end of backward; a block is gathered for its backward while the next one is prefetched.
        gathered = (root + 2 * block) * (2 if c.amp == "O2" else 4)
    accumulated = 0
    if microbatches(c, recipe) > 1:
        # FSDP2 without gradient sync keeps every unsharded gradient, in fp32 (its reduce dtype),
        # until the last microbatch's reduce-scatter; DDP accumulates into the gradients it has.
        accumulated = 4 * n_params if fsdp else grads
    return _State(params, grads, states, step, buckets, gathered, accumulated)


def _layer_bytes(recipe: Recipe, config: Config, device: DeviceInfo) -> dict[str, int]:
    """Bytes one block saves for backward, per recompute mode, by the family's kind of block
    (`gated_mlp`, `rms_norm`) and the widths its module saves (`saved_widths`: its norms, and
    q, k, v and the attention's outputs at the heads' widths). Measured against autograd's saved
    tensors (tests/test_estimate.py, `benchmarks/saved_activations.py`) on torch 2.13: RMSNorm
    keeps fp32 copies of its input and normalised input whatever the dtype; LayerNorm keeps its
    input."""
    m, c = recipe.model, config
    low = c.amp != "O0"
    h, f = m.hidden, m.ffn_size
    b, s = c.micro_batch_size, m.seq_len
    heads = m.heads // c.tp
    comp = 2 if low else 4  # matmul inputs are cast (O1) or already low precision (O2)
    resid = 2 if c.amp == "O2" else 4  # the residual stream stays fp32 under autocast
    bsh = b * s * h
    # Sequence parallelism shards the norms and the residual stream over tp; the gathered inputs
    # of the column-parallel matmuls stay whole.
    seq = c.tp if (c.sequence_parallel and c.tp > 1) else 1
    family = family_of(m)
    qk, v = family.attention_widths(m)
    attn = _attention_matrix(c.attention, b, heads, s, comp, device.family, b * s * heads * (2 * qk + v))
    if c.attention != "math":  # a fused kernel's backward keeps an explicit mask (the math term has it)
        attn += int(family.masked_share(m) * b * s * s * comp)
    widths = family.saved_widths(m, fused=c.attention != "math")
    if family.rms_norm(m):
        per_width = 2 * 4  # input and normalised input, fp32
        kept = 2 * bsh * comp  # what selective keeps of the attention's inputs and output
    else:
        per_width = resid  # LayerNorm's input
        kept = bsh * 4 + bsh * comp
    norms = b * s * widths.block_norms * per_width // seq
    # The queries' and keys' norms sit inside attention: selective recompute repeats them.
    head_norms = b * s * widths.head_norms // c.tp * per_width
    attention = int(b * s * widths.attention) // c.tp * comp
    if routed := family.routed_experts(m):
        ffn = _routed_ffn_bytes(routed, b * s, h, comp) // c.tp
    elif family.gated_mlp(m):
        ffn = 4 * b * s * f // c.tp * comp  # gate and up outputs, the activation's output, down's input
    else:
        ffn = 2 * b * s * f // c.tp * comp  # the activation's input, down's input
    full = norms + head_norms + 2 * bsh * comp + attention + ffn + attn
    return {"none": full, "full": bsh * resid // seq, "selective": norms + kept + ffn}


def _routed_ffn_bytes(routed: tuple[int, int, int, int], tokens: int, h: int, comp: int) -> int:
    """What an MoE block's MLP saves: per token and expert it is routed to, the expert's input and
    output and its gated MLP's four inner-width tensors; the router's fp32 logits and
    probabilities; a shared expert as a gated MLP (`benchmarks/saved_activations.py`: Mixtral and
    Qwen3-MoE at width 64, 8 experts, top 2)."""
    experts, top_k, width, shared = routed
    return tokens * (top_k * (2 * h + 4 * width) + 4 * shared) * comp + tokens * experts * 4 * 2


def _activation_bytes(
    recipe: Recipe, config: Config, device: DeviceInfo, stage: int
) -> tuple[int, int, int, int]:
    """(tensors saved for backward with every microbatch in flight plus one block's workspace,
    the loss's temporaries over the logits, that workspace, the saved tensors of one microbatch
    that offload keeps in host memory instead)."""
    m, c = recipe.model, config
    family = family_of(m)
    last = stage == c.pp - 1
    b, s, h = c.micro_batch_size, m.seq_len, m.hidden
    resid = 2 if c.amp == "O2" else 4
    per_layer = _layer_bytes(recipe, c, device)
    layers = m.layers // c.pp
    k = recomputed_layers(layers, c.recompute_layers) if c.recompute != "none" else 0
    saved = k * per_layer[c.recompute] + (layers - k) * per_layer["none"]
    offloaded = saved if c.offload else 0
    if c.offload:
        saved = 0  # saved tensors live in host memory
    n_micro = microbatches(c, recipe)
    in_flight = 1 if c.pp == 1 else (n_micro if c.pp_schedule == "gpipe" else min(c.pp - stage, n_micro))
    edge = 2 * b * s * h * resid if last else 0  # final norm input and output
    workspace = per_layer["none"]  # one layer recomputed, or its gradients, during its backward
    activations = in_flight * (saved + edge) + workspace
    if c.amp == "O1":  # autocast's low-precision weight cache
        activations += 2 * family.block_matmul_params(m) * layers // c.tp
    logits = 0
    if last:
        # Bytes per logit at the loss's peak, sharded over tp. Whole logits (F.cross_entropy on
        # an fp32 copy): the log-softmax output, its incoming gradient and the gradient it
        # produces, when backward starts; the low-precision logits (amp) and their fp32 copy are
        # freed by then, and the gradient cast back comes after. A pipeline stage also keeps its
        # output (the logits) in its forward cache until that microbatch's backward.
        # Vocabulary-parallel (tp > 1): the forward holds the logits, their fp32 copy (amp),
        # the shifted logits and their exponentials; backward works in place.
        low = 0 if c.amp == "O0" else 2
        if c.tp > 1:
            per_token = 12 + low
        else:
            per_token = 12 + ((low or 4) if c.pp > 1 else 0)
        gpipe = n_micro if c.pp > 1 and c.pp_schedule == "gpipe" else 1
        logits = per_token * b * s * m.vocab // c.tp * gpipe
    return activations, logits, workspace, offloaded


def _attention_matrix(backend: str, b: int, heads: int, s: int, comp: int, family: str, qkv: int) -> int:
    """The math kernel saves the softmax probabilities; fused kernels only a log-sum-exp row.
    `qkv`: the elements of q, k and v together, at every head."""
    if backend != "math":
        return b * heads * s * 4
    if family in ("cpu", "cuda") and comp < 4:
        # The math kernel upcasts low-precision q, k, v to fp32 and keeps fp32 copies (torch's
        # default, allow_fp16_bf16_reduction_math_sdp off). On an H200, Llama-3 8B's layers at
        # 4096 tokens under bf16 autocast held 49.04 GiB; at 2 bytes a score this gave 44.22
        # (benchmarks/cuda_check.sh, BENCHMARKS "CUDA").
        return b * heads * s * s * 4 + qkv * 4 + s * s
    return b * heads * s * s * comp + s * s  # + the causal mask
