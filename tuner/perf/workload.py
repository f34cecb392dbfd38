"""What one optimizer step of a config asks of the devices (FLOPs, bytes per collective, tokens,
layers, host work), from the recipe and the knobs alone: the one adapter between the model family's
formulas (`tuner.estimate`, `tuner.workload.flops`) and the performance model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tuner.config import Config, microbatches, recomputed_layers
from tuner.devices import DeviceInfo
from tuner.estimate import Estimate, MiB, estimate
from tuner.models import family_of
from tuner.recipe import Recipe
from tuner.workload.flops import stage_flops_per_token

# Bytes per element moved by a gradient all-reduce under each DDP communication hook.
_COMPRESSED_BYTES = {"fp16": 2, "bf16": 2, "powersgd": 0.25}  # powersgd: a low-rank factor pair


def _summed_bytes(device: DeviceInfo, element_bytes: float) -> float:
    """What a reduction (all-reduce, reduce-scatter) costs per element of `element_bytes`:
    gloo, the CPU backend, sums 16-bit tensors element by element at about fp32's cost (on a
    2-core AMD EPYC a 1M-element bf16 all-reduce took 3.9 ms, fp32 3.4 ms), so a 16-bit gradient
    or activation saves it nothing; NCCL and HCCL move and sum half the bytes."""
    return 4.0 if device.family == "cpu" and element_bytes == 2 else element_bytes


@dataclass(frozen=True)
class StepWork:
    """One step of one config on its busiest rank. Counts are per step unless named per micro."""

    tokens: int  # global tokens per optimizer step
    microbatches: int  # forward/backward passes per step on a rank
    micro_tokens: int  # tokens of one micro-batch on one rank (what a matmul's rows are)
    flops_micro: float  # hardware FLOPs (recompute included) of one micro-batch on one rank
    units_micro: float  # kernel-ish host units of one micro-batch (layer passes, embed, head)
    # Bytes the memory-bound (elementwise, norm, softmax, loss) kernels of one micro-batch move
    # on the busiest rank, and the optimizer's once per step: what the FLOPs do not count.
    mem_bytes_micro: float
    opt_bytes: float
    tp_messages_micro: int  # tensor-parallel all-reduces per micro-batch
    tp_bytes_micro: float  # bytes each rank moves for them
    pp_messages: int  # point-to-point sends/receives per step on a stage
    pp_bytes: float
    dp_messages: int  # gradient buckets (DDP) or gathers/scatters (FSDP) per step
    dp_bytes: float
    pp: int
    ranks: int
    peak_mem_bytes: int  # the memory estimator's prediction
    busiest_share: float  # of the step's FLOPs, on the busiest pipeline stage (1 without a pipeline)
    estimate: Estimate = field(compare=False, repr=False)  # all of it (prune.verdict takes it)
    # Bytes one micro-batch's saved activations move to host memory and back (offload), else 0.
    offload_bytes_micro: float = 0.0

    @property
    def bubble_factor(self) -> float:
        """Pipeline schedule length in micro-batches of the busiest stage, over the microbatches:
        the busiest stage paces every microbatch but one, and the fill and drain pass once through
        every stage: ((m - 1) * busiest + 1) / (m * busiest), which is (m + pp - 1) / m when the
        stages are equal."""
        m, busiest = self.microbatches, self.busiest_share
        return ((m - 1) * busiest + 1) / (m * busiest)


def _ring(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of `nbytes` over `n` ranks."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def stage_shares(recipe: Recipe, config: Config) -> list[float]:
    """Each pipeline stage's share of the step's hardware FLOPs: its blocks (recomputed ones
    again), and on the last stage the output projection (a gpt-tiny head is a quarter of the
    matmul work: its stage does 61% of a pp=2 step, not half)."""
    flops = stage_flops_per_token(recipe.model, config)
    return [f / sum(flops) for f in flops]


# Activation elements per token that a layer pass's memory-bound kernels read and write, per
# hidden unit and per FFN unit: norms, residual adds, bias and dropout-free activations, the
# attention's projections reshaped and rotated (a rough count of one block, not a profile; the
# fitted bandwidth absorbs its scale). Math attention also materialises heads x seq scores per
# token, each written by the matmul and read and written by the softmax.
_ELEMS_PER_HIDDEN = 12.0
_ELEMS_PER_FFN = 3.0
_ELEMS_PER_SCORE = 3.0
# Adam's step reads and writes the weight, its gradient and two moments (fp32): 4 x 2 passes.
_OPT_PASSES = 8.0


# Host work a recomputed layer adds, in plain layer passes (a layer's forward or backward): the
# forward run again, and the checkpoint's own bookkeeping around it (saved-tensor hooks, its frame,
# the recomputation's autograd graph), which costs more than the forward itself. Measured on a
# model whose kernels cost next to nothing (`python benchmarks/recompute_host.py --rounds 60`,
# 2-core AMD EPYC Zen 4, benchmarks/results/recompute-host-zen4.json): gpt 2.71 and 3.82, llama
# 2.35 and 3.39 for selective and full. Counted as one pass and half a pass, the gpt-3 table's
# full-recompute configs were predicted 1.21x the time of no recompute, measured 1.30x (now 1.29x).
_RECOMPUTE_HOST_UNITS = {"none": 0.0, "selective": 2.5, "full": 3.6}


# Tensor parallelism's collectives outside the blocks, per micro-batch (CommDebugMode's count):
# the embedding's and the head's input gradient, activation-sized (all-reduces, or with sequence
# parallelism two gathers and scatters each), and three all-reduces of the vocabulary-parallel
# loss's per-token statistics, small.
_TP_ENDS = {False: (2, 0, 3), True: (0, 4, 3)}  # (all-reduces, gathers/scatters, small ones)


def _gathered_share(device: DeviceInfo) -> float:
    """What an all-gather or reduce-scatter of an activation costs against its all-reduce: NCCL
    and HCCL move half the bytes (an all-reduce is the two together); gloo takes about as long
    for each as for the all-reduce (2 ranks on a 2-core AMD EPYC, 256 KiB: all-reduce 0.46 ms,
    reduce-scatter 0.49 ms, an all-gather of twice the output 0.61 ms), so sequence parallelism's
    eight collectives per block cost it more than the plain split's four to seven all-reduces."""
    return 1.0 if device.family == "cpu" else 0.5


def _tp_collectives(recipe: Recipe, c: Config, layers: int, device: DeviceInfo) -> tuple[int, float]:
    """(collectives, all-reduces of one activation they are worth) of one micro-batch on a rank
    under tensor parallelism: its stage's blocks (recomputed ones with their extra collectives),
    and the embedding's, head's and loss's (counted on the busiest stage)."""
    if c.tp == 1:
        return 0, 0.0
    family, m = family_of(recipe.model), recipe.model
    k = recomputed_layers(layers, c.recompute_layers) if c.recompute != "none" else 0
    plain = family.tp_collectives(m, c.sequence_parallel, "none")
    again = family.tp_collectives(m, c.sequence_parallel, c.recompute)
    ends = _TP_ENDS[c.sequence_parallel]
    reduces = (layers - k) * plain[0] + k * again[0] + ends[0]
    sharded = (layers - k) * plain[1] + k * again[1] + ends[1]
    return reduces + sharded + ends[2], reduces + sharded * _gathered_share(device)


def _memory_traffic(recipe: Recipe, c: Config, micro_tokens: int, layers: int, repeat: float, last: bool):
    """(bytes per micro-batch of the memory-bound kernels, optimizer bytes per step) on a rank."""
    m = recipe.model
    family = family_of(m)
    per_token = _ELEMS_PER_HIDDEN * m.hidden + _ELEMS_PER_FFN * family.ffn_size(m)
    if c.attention == "math":
        per_token += _ELEMS_PER_SCORE * m.heads * m.seq_len
    # TP shards the heads and the FFN; without sequence parallelism the norms and residuals stay
    # whole on every rank (counted here as sharded too: a first-order count).
    elems = micro_tokens * layers * per_token / c.tp
    passes = 3.0 + repeat  # forward, backward (about twice the forward's traffic), recomputation
    # The loss: fp32 logits, their softmax and gradient, on the last stage only.
    logits = 4.0 * micro_tokens * m.vocab / c.tp * 4 if last else 0.0
    act_bytes = 2 if c.amp == "O2" else 4  # autocast (O1) runs norms, softmax and the loss in fp32
    params = family.param_count(m) / (c.tp * c.pp)
    if c.dp > 1 and c.dp_shard == "fsdp":
        params /= c.dp
    return elems * passes * act_bytes + logits, params * 4 * _OPT_PASSES


def step_work(recipe: Recipe, config: Config, device: DeviceInfo) -> StepWork:
    m, c = recipe.model, config
    est = estimate(recipe, config, device)
    n_micro = microbatches(c, recipe)
    micro_tokens = c.micro_batch_size * m.seq_len
    # Hardware FLOPs split over the ranks: tp splits the matmuls, dp the batch, pp the layers
    # (unevenly: the busiest stage is what a pipeline waits for).
    busiest = max(stage_shares(recipe, c))
    flops_micro = est.hardware_flops_per_step / (c.dp * c.tp) / n_micro * busiest
    layers = m.layers // c.pp
    recomputed = recomputed_layers(layers, c.recompute_layers) if c.recompute != "none" else 0
    # Memory passes a recomputed layer's forward adds (selective: about half a layer's kernels),
    # averaged over the stage's layers.
    repeat = {"none": 0.0, "selective": 0.5, "full": 1.0}[c.recompute] * recomputed / layers
    # Host work: forward + backward per layer, the embedding and head, and what each recomputed
    # layer adds.
    units = layers * 2 + 2 + recomputed * _RECOMPUTE_HOST_UNITS[c.recompute]
    act_bytes = 4 if c.amp == "O0" else 2
    activation = micro_tokens * m.hidden * act_bytes
    tp_msgs, tp_reduced = _tp_collectives(recipe, c, layers, device)
    tp_summed = micro_tokens * m.hidden * _summed_bytes(device, act_bytes)
    pp_msgs = 0 if c.pp == 1 else 2 * n_micro
    mem_micro, opt_bytes = _memory_traffic(recipe, c, micro_tokens, layers, repeat, True)
    fsdp = c.dp > 1 and c.dp_shard == "fsdp"
    if c.dp == 1:
        dp_msgs, dp_bytes = 0, 0.0
    elif fsdp:
        elems = est.params_bytes * c.dp / 4
        p_bytes = 2 if c.amp == "O2" else 4
        # Two all-gathers of the parameters (forward, backward) and a reduce-scatter of the gradients.
        per = 2 * p_bytes + _summed_bytes(device, p_bytes)
        dp_msgs, dp_bytes = 3 * (layers + 1), (c.dp - 1) / c.dp * elems * per
    else:
        p_bytes = 2 if c.amp == "O2" else 4
        elems = est.params_bytes / p_bytes
        per = _summed_bytes(device, _COMPRESSED_BYTES.get(c.grad_compression, p_bytes))
        dp_msgs = max(1, math.ceil(elems * p_bytes / (c.bucket_mb * MiB)))
        dp_bytes = _ring(elems * per, c.dp)
    return StepWork(
        tokens=recipe.tokens_per_step,
        microbatches=n_micro,
        micro_tokens=micro_tokens,
        flops_micro=flops_micro,
        units_micro=units,
        mem_bytes_micro=mem_micro,
        opt_bytes=opt_bytes,
        tp_messages_micro=tp_msgs,
        tp_bytes_micro=_ring(tp_summed, c.tp) * tp_reduced,
        pp_messages=pp_msgs,
        pp_bytes=pp_msgs * activation,
        dp_messages=dp_msgs,
        dp_bytes=dp_bytes,
        pp=c.pp,
        ranks=c.world_size,
        peak_mem_bytes=int(est.peak_mem_bytes),
        busiest_share=busiest,
        estimate=est,
        # Offloaded tensors cross the host link twice: out in the forward, back in the backward.
        offload_bytes_micro=2.0 * est.offloaded_bytes,
    )
