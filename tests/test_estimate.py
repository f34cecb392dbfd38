"""The memory/FLOPs estimator: each knob moves the right term, weights match the real model, and
the estimate tracks measured peaks of real trials."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tuner.config import Config
from tuner.devices import DeviceInfo, describe
from tuner.estimate import OOM_MARGIN, GiB, MiB, budget_bytes, estimate, predicts_oom
from tuner.recipe import recipe_from_dict
from tuner.workload.flops import flops_per_step, param_count

CPU = describe("cpu")
GPU = DeviceInfo(
    family="cuda",
    name="NVIDIA H100",
    count=8,
    memory_bytes=80 * GiB,
    backend="nccl",
    attention_backends=("math", "efficient", "flash", "cudnn"),
    amp_dtypes=("bf16", "fp16"),
    compile_modes=("none",),
    supports_offload=True,
)


def recipe(devices=1, layers=4, hidden=128, heads=4, seq_len=256, vocab=2048, gbs=16, budget=None, **extra):
    model = {"layers": layers, "hidden": hidden, "heads": heads, "seq_len": seq_len, "vocab": vocab}
    hardware = {"devices": devices, "memory_budget_gb": budget}
    return recipe_from_dict(
        {"name": "e", "model": model, "train": {"global_batch_size": gbs, **extra}, "hardware": hardware}
    )


def est(config: Config, rec=None, device=CPU):
    return estimate(rec or recipe(devices=config.world_size), config, device)


def test_weights_match_the_real_model():
    from tuner.workload.model import GPT

    rec = recipe()
    real = sum(p.numel() for p in GPT(rec.model).parameters())
    assert real == param_count(rec.model)
    e = est(Config())
    assert e.params_bytes == 4 * real and e.grads_bytes == 4 * real
    assert e.optimizer_bytes == (2 + 1) * 4 * real  # adamw's two states + foreach temporaries


@pytest.mark.parametrize("tied", [False, True])
def test_llama_weights_match_the_real_model_and_split_over_tp(tied):
    from tuner.workload.model import build_meta

    model = {"family": "llama", "layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "seq_len": 256,
             "vocab": 2048, "tie_embeddings": tied}  # fmt: skip
    rec = recipe_from_dict({"name": "l", "model": model, "hardware": {"devices": 2}})
    real = sum(p.numel() for p in build_meta(rec.model, "math").parameters())
    assert est(Config(dp=2), rec).params_bytes == 4 * real
    tp = est(Config(tp=2), rec).params_bytes
    norms = 4 * (2 * 4 + 1) * 128  # two RMSNorms per block and the final one stay whole
    assert tp == (4 * real - norms) // 2 + norms


def test_amp_o2_keeps_low_precision_params_and_fp32_master():
    n = param_count(recipe().model)
    e = est(Config(amp="O2", optimizer_impl="fused"))
    assert e.params_bytes == 2 * n and e.grads_bytes == 2 * n
    assert e.optimizer_bytes == (2 + 2) * 4 * n  # adam states + fp32 master weights and grads
    assert est(Config(amp="O1")).params_bytes == 4 * n


def test_sgd_keeps_one_state():
    n = param_count(recipe().model)
    assert est(Config(optimizer_impl="fused"), recipe(optimizer="sgd")).optimizer_bytes == 4 * n


def test_sharding_divides_the_weights():
    base = est(Config(dp=1), recipe(devices=2))
    tp = est(Config(dp=1, tp=2), recipe(devices=2))
    pp = est(Config(dp=1, pp=2, micro_batch_size=1), recipe(devices=2))
    fsdp = est(Config(dp=2, dp_shard="fsdp"), recipe(devices=2))
    ddp = est(Config(dp=2), recipe(devices=2))
    m = recipe().model
    block_matmul_bytes = 4 * m.layers * (4 * m.hidden**2 + 2 * m.hidden * m.ffn_size)
    vocab_bytes = 4 * 2 * m.vocab * m.hidden  # token embedding and LM head, split over the vocabulary
    assert base.params_bytes - tp.params_bytes == (block_matmul_bytes + vocab_bytes) // 2
    assert pp.params_bytes < 0.75 * base.params_bytes
    assert fsdp.params_bytes == base.params_bytes // 2
    assert ddp.comm_bytes == ddp.grads_bytes  # DDP buckets copy the gradients


def test_activations_follow_batch_recompute_kernel_and_offload():
    none = est(Config(micro_batch_size=4)).activation_bytes
    assert est(Config(micro_batch_size=8)).activation_bytes == pytest.approx(2 * none, rel=0.01)
    selective = est(Config(micro_batch_size=4, recompute="selective")).activation_bytes
    full = est(Config(micro_batch_size=4, recompute="full")).activation_bytes
    assert full < selective < none
    assert est(Config(micro_batch_size=4, attention="flash")).activation_bytes < none
    offload = est(Config(micro_batch_size=4, offload=True), device=GPU).activation_bytes
    assert offload < full


def test_pipeline_schedules_hold_different_microbatches():
    rec = recipe(devices=2, gbs=16)
    one_f1b = est(Config(pp=2, micro_batch_size=1), rec)
    gpipe = est(Config(pp=2, micro_batch_size=1, pp_schedule="gpipe"), rec)
    # 1f1b keeps at most pp microbatches alive on the first stage; gpipe keeps all 16.
    assert gpipe.activation_bytes > 4 * one_f1b.activation_bytes


def test_pipeline_last_stage_keeps_its_logits_for_backward():
    # torch's pipeline stage caches each microbatch's output (the logits) until its backward.
    rec = recipe(devices=2, gbs=16, vocab=8192)  # the logits make the last stage the peak
    pp = est(Config(pp=2, micro_batch_size=2), rec)
    assert pp.stage == 1
    m = rec.model
    assert pp.logits_bytes == (12 + 4) * 2 * m.seq_len * m.vocab  # 12: the loss's own fp32 temporaries


def test_fsdp_gradient_accumulation_holds_every_unsharded_gradient():
    # Without gradient sync FSDP2 keeps each gradient unsharded (fp32) until the last
    # microbatch's reduce-scatter: accumulating costs the whole model's gradients, not a shard.
    rec = recipe(devices=2, gbs=16)
    one = est(Config(dp=2, dp_shard="fsdp", micro_batch_size=8), rec)  # 1 microbatch per step
    four = est(Config(dp=2, dp_shard="fsdp", micro_batch_size=2), rec)  # 4 microbatches
    assert one.accumulated_grads_bytes == 0
    assert four.accumulated_grads_bytes == 4 * param_count(rec.model) == 2 * four.grads_bytes
    ddp = est(Config(dp=2, micro_batch_size=2), rec)
    assert ddp.accumulated_grads_bytes == ddp.grads_bytes  # DDP accumulates into its own gradients


def test_fsdp_halving_the_micro_batch_can_need_more_memory():
    # Two microbatches instead of one halve the activations but add every unsharded gradient:
    # with a budget between the two estimates, the smaller micro-batch is the one pruned.
    rec = recipe(layers=8, hidden=512, heads=8, seq_len=64, vocab=32000, devices=2, gbs=16)
    one = est(Config(dp=2, dp_shard="fsdp", micro_batch_size=8, optimizer_impl="fused"), rec)
    two = est(Config(dp=2, dp_shard="fsdp", micro_batch_size=4, optimizer_impl="fused"), rec)
    assert two.activation_bytes < one.activation_bytes and two.accumulated_grads_bytes > 0
    budget = int((one.peak_mem_bytes + two.peak_mem_bytes) / 2 / (1 + OOM_MARGIN))
    assert predicts_oom(two, budget) and not predicts_oom(one, budget)


def test_the_peak_is_the_larger_of_backward_and_the_optimizer_step():
    # Activations and the optimizer's step temporaries never live at once: with large
    # activations foreach's temporaries cost nothing extra; with tiny ones they set the peak.
    activations = recipe(seq_len=512)
    fused = est(Config(micro_batch_size=16, optimizer_impl="fused"), activations)
    foreach = est(Config(micro_batch_size=16, optimizer_impl="foreach"), activations)
    assert foreach.peak_phase == "backward" and foreach.peak_mem_bytes == fused.peak_mem_bytes
    weights = recipe(seq_len=8, vocab=32000, hidden=512, heads=8)
    fused = est(Config(micro_batch_size=1, optimizer_impl="fused"), weights)
    foreach = est(Config(micro_batch_size=1, optimizer_impl="foreach"), weights)
    assert foreach.peak_phase == "optimizer" and fused.peak_mem_bytes < foreach.peak_mem_bytes
    e = foreach  # weights, gradients, state and the step's temporaries; no activations
    assert e.peak_mem_bytes == e.params_bytes + e.grads_bytes + e.optimizer_bytes + e.overhead_bytes


def test_flops_count_recompute_as_hardware_work_only():
    rec = recipe()
    plain, full = est(Config()), est(Config(recompute="full"))
    assert plain.flops_per_step == full.flops_per_step == flops_per_step(rec)
    assert plain.hardware_flops_per_step == plain.flops_per_step
    # Recompute repeats block work only, never the embedding and head (a quarter of gpt-tiny's).
    assert plain.flops_per_step < full.hardware_flops_per_step < plain.flops_per_step * 4 / 3


def small_model(family: str) -> dict:
    """A 4-layer model of `family` small enough for one CPU step in a test (hf: a Qwen2 built by
    transformers from its config, no download)."""
    if family == "hf-moe":  # Mixtral: 8 experts of width 64, two per token
        config = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 512, "num_local_experts": 8,
                  "num_experts_per_tok": 2}  # fmt: skip
        return {"family": "hf", "seq_len": 32, "config": config}
    if family == "hf-mla":  # MiniCPM3-4B's head widths: queries and keys 64 + 32, values 64
        config = {"model_type": "minicpm3", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 512, "q_lora_rank": 32,
                  "kv_lora_rank": 32, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}  # fmt: skip
        return {"family": "hf", "seq_len": 32, "config": config}
    if family == "hf":
        config = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 512}  # fmt: skip
        return {"family": "hf", "seq_len": 32, "config": config}
    model = {"family": family, "layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 512}
    if family == "llama":
        model["kv_heads"] = 2  # grouped-query attention: its k and v projections are narrower
    return model


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """transformers' MoE experts run as one `aten._grouped_mm` (each expert's tokens against its
    slice), for which torch's FlopCounterMode has no formula: 2 x the summed products of each
    group. Forward (tokens x k against experts x k x n), and backward's weight gradient (k x
    tokens against tokens x n, grouped along the tokens)."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[-1]


GROUPED_MM = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


@pytest.mark.parametrize("family", ["gpt", "llama", "hf", "hf-moe", "hf-mla"])
def test_hardware_flops_match_what_torch_counts_under_each_recompute(family, monkeypatch):
    """A real training step of the built model, counted by torch's FlopCounterMode (matmuls and
    attention, recomputed forwards included), against the estimator's hardware FLOPs per step:
    the same number for no, selective and full recompute, of all blocks or of half of them.
    Multi-head latent attention's scores (MiniCPM3: queries and keys wider than values) were
    counted at its rotary width alone, 39% under."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from tuner.workload.apply import apply_recompute
    from tuner.workload.model import build_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rec = recipe_from_dict({"name": "f", "model": small_model(family), "train": {"global_batch_size": 2}})
    tokens = torch.randint(0, 512, (2, 32))
    for mode, layers in [("none", 1.0), ("selective", 1.0), ("full", 1.0), ("selective", 0.5), ("full", 0.5)]:
        model = build_model(rec.model, "math", 0, torch.device("cpu"))
        if mode != "none":
            apply_recompute(model, mode, layers)
        with FlopCounterMode(display=False, custom_mapping=GROUPED_MM) as counter:
            model.loss(model(tokens), tokens).backward()
        expected = est(Config(recompute=mode, recompute_layers=layers), rec).hardware_flops_per_step
        assert counter.get_total_flops() == pytest.approx(expected), (mode, layers)


def test_budget_and_oom_prediction():
    assert budget_bytes(recipe(budget=2), CPU) == 2 * GiB
    assert budget_bytes(recipe(devices=2), CPU) == CPU.memory_bytes // 2  # ranks share the RAM
    assert budget_bytes(recipe(), GPU) == 80 * GiB
    e = est(Config())
    assert not predicts_oom(e, e.peak_mem_bytes)
    assert not predicts_oom(e, int(e.peak_mem_bytes / 1.1))  # within the 15% margin
    assert predicts_oom(e, int(e.peak_mem_bytes / 1.2))
    big = est(
        Config(micro_batch_size=16), recipe(layers=48, hidden=4096, heads=32, seq_len=4096, vocab=50304)
    )
    assert predicts_oom(big, 80 * GiB)


def test_breakdown_is_in_gib():
    b = est(Config()).breakdown()
    assert set(b) >= {"peak_mem_bytes", "params_bytes", "activation_bytes", "logits_bytes", "overhead_bytes"}
    assert b["overhead_bytes"] == pytest.approx(50 * MiB / GiB)


# ---- against real trials -------------------------------------------------------------------------

TOLERANCE = 0.25  # |estimate - measured| / measured, for CPU allocated peaks of small models


@pytest.mark.slow
def test_a_llama_math_attention_fp32_step_is_not_underestimated(tmp_path):
    """The math kernel saves the fp32 (batch, heads, seq, seq) probabilities for llama as for gpt:
    the llama formula halved them, and at 1,024 tokens estimated 191 MiB for a rank that held 229
    on an Emerald Rapids host (-17%, past the 15% under which a study runs a config that then
    runs out of memory). The same step holds 206 MiB on a Zen 4 host (exact host memory agrees),
    241 estimated (+17%): above, the bound is the tolerance of every CPU estimate (`TOLERANCE`)."""
    from tuner.executors.local import run_trial
    from tuner.result import TrialSpec

    rec = recipe_from_dict({"name": "la", "model": {"family": "llama", "layers": 2, "hidden": 128, "heads": 4,
                            "kv_heads": 2, "seq_len": 1024, "vocab": 1024}, "train": {"global_batch_size": 2},
                            "hardware": {"device": "cpu", "devices": 1},
                            "measure": {"warmup_steps": 1, "steps": 1}})  # fmt: skip
    config = Config(micro_batch_size=2, attention="math", amp="O0")
    spec = TrialSpec(recipe=rec.to_dict(), config=config.to_dict(), family="cpu", workdir=str(tmp_path))
    r = run_trial(spec)
    assert r.status == "ok", r.error
    err = estimate(rec, config, CPU).peak_mem_bytes / r.peak_mem_allocated_bytes - 1
    assert -OOM_MARGIN < err < TOLERANCE, f"estimate off by {err:+.1%}"


def test_estimate_tracks_measured_peaks(tmp_path):
    from tuner.executors.local import run_trial
    from tuner.result import TrialSpec

    rec = recipe(layers=4, gbs=8)
    rec = rec.model_copy(update={"measure": rec.measure.model_copy(update={"warmup_steps": 1, "steps": 1})})
    configs = [
        Config(micro_batch_size=1),
        Config(micro_batch_size=8, recompute="full"),
        Config(micro_batch_size=8),
    ]

    def measure(i: int):
        spec = TrialSpec(
            recipe=rec.to_dict(), config=configs[i].to_dict(), family="cpu", workdir=str(tmp_path / str(i))
        )
        # As a study runs it: the allocated peak comes from the rank's untimed held-memory step.
        return run_trial(spec)

    with ThreadPoolExecutor(len(configs)) as pool:
        results = list(pool.map(measure, range(len(configs))))
    estimates = [estimate(rec, c, CPU).peak_mem_bytes for c in configs]
    measured, errors = [], []
    for c, r, e in zip(configs, results, estimates, strict=True):
        assert r.status == "ok", r.error
        got = r.peak_mem_allocated_bytes
        measured.append(got)
        err = (e - got) / got
        print(
            f"mbs={c.micro_batch_size} recompute={c.recompute}: allocated {got / MiB:.0f} MiB "
            f"(reserved {r.peak_mem_reserved_bytes / MiB:.0f} MiB), estimated {e / MiB:.0f} MiB, error {err:+.1%}"
        )
        errors.append(err)
        # The heap's slack is reported apart from what the rank holds, as a CUDA pool's is.
        assert r.mem_fragmentation_bytes == max(0, r.peak_mem_reserved_bytes - got)
    assert all(abs(e) < TOLERANCE for e in errors), errors
    assert measured == sorted(measured) and estimates == sorted(estimates)


def hf_qwen2(layers: int = 4, seq_len: int = 256, devices: int = 1):
    config = {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": layers, "num_attention_heads": 8,
              "num_key_value_heads": 2, "intermediate_size": 704, "vocab_size": 8192}  # fmt: skip
    return recipe_from_dict({"name": "q", "model": {"family": "hf", "seq_len": seq_len, "config": config},
                             "train": {"global_batch_size": 4}, "hardware": {"device": "cpu", "devices": devices},
                             "measure": {"warmup_steps": 2, "steps": 1}})  # fmt: skip


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_an_hf_block_saves_what_the_llama_block_it_matches_saves_less_one_width(recompute):
    """Qwen2 is a llama block (RMSNorm, SwiGLU): the hf family took gpt's LayerNorm and two-matrix
    MLP rule for it, 25% (selective: 39%) under the bytes torch's saved-tensor hooks count per
    layer (`benchmarks/saved_activations.py qwen2`). The two modules differ in one tensor: the
    llama module keeps SDPA's output apart from the output projection's input (five hidden-wide
    tensors around SDPA, the math kernel's missing output left as a 5% margin), where transformers'
    contiguous output is that input (four, as measured: +0.0%). Selective and full recompute keep
    neither, so they are the same."""
    from tuner.estimate import _layer_bytes
    from tuner.models import family_of

    hf = hf_qwen2()
    llama = recipe_from_dict({"name": "l", "model": {"family": "llama", "layers": 4, "hidden": 256, "heads": 8,
                              "kv_heads": 2, "ffn": 704, "vocab": 8192, "seq_len": 256},
                              "train": {"global_batch_size": 4}})  # fmt: skip
    family = family_of(hf.model)
    assert family.gated_mlp(hf.model) and family.rms_norm(hf.model)
    config = Config(micro_batch_size=4, recompute=recompute)
    one_width = 4 * 256 * 256 * 4 if recompute == "none" else 0  # batch x tokens x hidden, fp32
    assert _layer_bytes(hf, config, CPU)[recompute] == _layer_bytes(llama, config, CPU)[recompute] - one_width


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_an_hf_qwen2_step_is_estimated_within_the_oom_margin(tmp_path, recompute):
    """Measured on a Zen 4 host, one rank, micro-batch 4: 396 (352) MiB held against 319 (266)
    estimated, -19.5% (-24.3%), before the block rule above and before the rank imported
    transformers' modeling module ahead of its memory baseline (111 MiB of code it counted as
    the model's); 323 (280) against 349 (296), +7.8% (+6.0%), after; 324 (281) against 345 (296),
    +6.2% (+5.6%), with q, k, v and the attention's output counted at the widths saved."""
    from tuner.executors.local import run_trial
    from tuner.result import TrialSpec

    rec, config = hf_qwen2(), Config(micro_batch_size=4, recompute=recompute)
    spec = TrialSpec(recipe=rec.to_dict(), config=config.to_dict(), family="cpu", workdir=str(tmp_path))
    r = run_trial(spec)
    assert r.status == "ok", r.error
    err = estimate(rec, config, CPU).peak_mem_bytes / r.peak_mem_allocated_bytes - 1
    assert abs(err) < OOM_MARGIN, f"estimate off by {err:+.1%}"


def test_an_hf_model_with_its_own_head_dim_is_counted_with_it(monkeypatch):
    """Qwen3 sets head_dim apart from hidden / heads (16 heads of 128 over 1,024): the FLOPs per
    step counted hidden / heads and came out 22% under (MFU likewise), and the kernel rules read
    the wrong head size. Against torch's own count of a training step, under each recompute."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from tuner.workload.apply import apply_recompute
    from tuner.workload.model import build_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "vocab_size": 512}  # fmt: skip
    rec = recipe_from_dict({"name": "q3", "model": {"family": "hf", "seq_len": 32, "config": config},
                            "train": {"global_batch_size": 2}})  # fmt: skip
    assert rec.model.head_dim == 32
    tokens = torch.randint(0, 512, (2, 32))
    for mode in ("none", "selective", "full"):
        model = build_model(rec.model, "math", 0, torch.device("cpu"))
        if mode != "none":
            apply_recompute(model, mode, 1.0)
        with FlopCounterMode(display=False) as counter:
            model.loss(model(tokens), tokens).backward()
        expected = est(Config(recompute=mode), rec).hardware_flops_per_step
        assert counter.get_total_flops() == pytest.approx(expected), mode


def _mistral(window: int | None, seq_len: int = 1024, pattern: dict | None = None):
    config = {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "sliding_window": window}  # fmt: skip
    return recipe_from_dict({"name": "w", "model": {"family": "hf", "seq_len": seq_len, "config": config | (pattern or {})},
                             "train": {"global_batch_size": 1}})  # fmt: skip


def _saved_by_one_layer(recipe, backend: str) -> int:
    """Bytes of the tensors autograd saves for one decoder layer's backward (storages counted once)."""
    from tuner.workload.model import build_model

    decoder = build_model(recipe.model, backend, seed=0, device=torch.device("cpu"))
    s = recipe.model.seq_len
    x = decoder.embed_tokens(torch.randint(0, 256, (1, s))).detach().requires_grad_()
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    kind = decoder.layer_types[0]
    rotary, masks = decoder._position_embeddings(x), decoder._masks(x)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decoder.layers["0"](
            x,
            attention_mask=masks[kind],
            position_ids=torch.arange(s)[None],
            position_embeddings=rotary[kind],
        )
    return sum(storages.values())


def test_a_fused_kernel_keeps_the_sliding_window_mask_and_the_estimate_counts_it():
    """With an explicit mask (a window shorter than the sequence), SDPA's fused kernels keep it
    as a float [batch, 1, seq, seq] tensor for backward, in every sliding layer: 4 MiB a layer at
    1,024 tokens in fp32 here, about 2 GiB a layer at 32k tokens in bf16, which the estimate left out."""
    from tuner.estimate import _layer_bytes
    from tuner.models import family_of

    config = Config(micro_batch_size=1, attention="flash")
    measured = _saved_by_one_layer(_mistral(256), "flash") - _saved_by_one_layer(_mistral(None), "flash")
    estimated = (
        _layer_bytes(_mistral(256), config, CPU)["none"] - _layer_bytes(_mistral(None), config, CPU)["none"]
    )
    assert measured > 3 * 2**20 and abs(estimated - measured) / measured < 0.1, (estimated, measured)
    # Only the sliding layers keep one: Gemma 3's pattern 2 slides every other layer.
    gemma = recipe_from_dict({"name": "g", "model": {"family": "hf", "seq_len": 1024, "config": {
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
        "sliding_window": 256, "sliding_window_pattern": 2}}})  # fmt: skip
    assert family_of(gemma.model).masked_share(gemma.model) == 0.5
    assert family_of(_mistral(1024).model).masked_share(_mistral(1024).model) == 0.0  # within the window
