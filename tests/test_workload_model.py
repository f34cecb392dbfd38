"""In-process checks of the workload's pieces: the model matches the FLOPs formulas, each
single-rank knob changes what actually runs, and the profiler breakdown classifies real ops."""

from __future__ import annotations

import json

import pytest
import torch

from tuner.config import Config
from tuner.recipe import recipe_from_dict
from tuner.result import TrialSpec
from tuner.workload.apply import apply_compile, apply_offload, apply_recompute
from tuner.workload.data import DpShardSampler, SyntheticTokens
from tuner.workload.flops import param_count
from tuner.workload.model import GPT, build_model
from tuner.workload.parallel import ParallelDims, RankEnv
from tuner.workload.profile import CATEGORIES, profile_steps, write_breakdown
from tuner.workload.train import Training

TINY = {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256}
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    # Several test processes share two cores; OpenMP threads spinning against each other make a
    # tiny step hundreds of times slower than one thread.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def recipe(**model):
    return recipe_from_dict({"name": "tiny", "model": TINY | model, "train": {"global_batch_size": 8}})


def training(tmp_path, **knobs) -> Training:
    spec = TrialSpec(
        recipe=recipe().to_dict(),
        config=Config.from_params(knobs).to_dict(),
        family="cpu",
        workdir=str(tmp_path),
    )
    return Training.from_spec(spec)


def losses(train: Training, steps: int = 3) -> list[float]:
    return train.global_losses([train.step() for _ in range(steps)])


def test_model_has_the_parameters_the_flops_formula_counts():
    m = recipe(ffn=96).model
    model = GPT(m)
    assert sum(p.numel() for p in model.parameters()) == param_count(m)
    assert all(lin.bias is None for lin in model.modules() if isinstance(lin, torch.nn.Linear))


def test_a_pipeline_stage_owns_its_layers_and_starts_from_the_full_models_weights():
    m = recipe(layers=4).model
    full = build_model(m, "math", seed=7, device=CPU)
    stage = build_model(m, "math", seed=7, device=CPU).keep_stage(1, 2)
    assert list(stage.layers) == ["2", "3"]
    assert stage.tok_emb is None and stage.lm_head is not None
    full_params = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full_params[name]), name
    other_seed = build_model(m, "math", seed=8, device=CPU)
    assert not torch.equal(other_seed.layers["2"].mlp.up.weight, full.layers["2"].mlp.up.weight)


def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward outside checkpointed regions (what recompute frees)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return total


def test_recompute_keeps_fewer_activations_for_backward():
    m = recipe(layers=4).model
    x = torch.randint(m.vocab, (4, m.seq_len))
    saved = {}
    for mode in ("none", "selective", "full"):
        model = build_model(m, "math", seed=0, device=CPU)
        apply_recompute(model, mode)
        saved[mode] = saved_bytes(model, x)
    assert saved["full"] < saved["selective"] < saved["none"]
    assert saved["full"] < saved["none"] / 2
    # Offload hands every block's saved tensors to save_on_cpu (whose copies live on the host).
    model = build_model(m, "math", seed=0, device=CPU)
    apply_offload(model, pin_memory=False)
    assert saved_bytes(model, x) < saved["full"]


def test_a_config_the_rules_reject_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"layers \(2\) not divisible by pp \(4\)"):
        spec = TrialSpec(
            recipe=recipe().to_dict(), config=Config(pp=4).to_dict(), family="cpu", workdir=str(tmp_path)
        )
        Training.from_spec(spec, RankEnv(world_size=4))


def op_names(train: Training) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train.step()
    return {e.name for e in prof.events()}


def test_the_attention_knob_picks_the_sdpa_kernel_that_runs(tmp_path):
    flash = op_names(training(tmp_path, attention="flash"))
    math = op_names(training(tmp_path, attention="math"))
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in flash
    assert not any("flash_attention" in n for n in math)
    assert "aten::_scaled_dot_product_attention_math" in math


def test_amp_levels_change_the_dtypes_that_run(tmp_path):
    o1 = training(tmp_path, amp="O1", amp_dtype="bf16")
    x = torch.randint(256, (2, 32))
    assert o1.model(x).dtype == torch.bfloat16  # autocast computes in bf16 ...
    assert o1.model.lm_head.weight.dtype == torch.float32  # ... from fp32 weights
    assert o1.scaler is None

    o2 = training(tmp_path, amp="O2", amp_dtype="fp16")
    assert {p.dtype for p in o2.model.parameters()} == {torch.float16}
    assert {m.dtype for m in o2.master.master} == {torch.float32}
    assert o2.scaler is not None  # fp16 needs loss scaling
    before = o2.master.master[0].detach().clone()
    losses(o2, steps=2)
    # The fp32 master moved and the fp16 parameter is its rounded copy.
    assert not torch.equal(before, o2.master.master[0])
    assert torch.equal(o2.master.params[0], o2.master.master[0].half())


def test_single_rank_knobs_train_the_same_model(tmp_path):
    """Knobs that change how, not what, is computed keep the loss (same seed, same data)."""
    reference = losses(training(tmp_path))
    for knobs in (
        {"recompute": "full"},
        {"recompute": "selective", "attention": "flash"},
        {"optimizer_impl": "fused"},
        {"optimizer_impl": "for_loop", "micro_batch_size": 4},
        {"amp": "O1", "amp_dtype": "bf16"},
    ):
        got = losses(training(tmp_path, **knobs))
        assert got == pytest.approx(reference, rel=1e-3), knobs


def test_compile_reaches_torch_compile_per_block_with_its_mode(monkeypatch):
    # Compiling for real costs tens of seconds of Inductor codegen; the build's tests run that.
    # Here a spy checks the mode reaches torch.compile, once per block.
    seen = []
    real = torch.compile

    def spy(fn, **kwargs):
        seen.append(kwargs.get("mode"))
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    model = build_model(recipe().model, "math", seed=0, device=CPU)
    apply_compile(model, "max-autotune")
    assert seen == ["max-autotune", "max-autotune"]
    assert all(block._compiled_call_impl is not None for block in model.layers.values())


def test_every_dp_split_reads_the_same_global_batch():
    data = SyntheticTokens(vocab=256, seq_len=8, seed=3)
    assert torch.equal(data[5][0], SyntheticTokens(256, 8, 3)[5][0])
    assert torch.equal(data[5][0][1:], data[5][1][:-1])  # targets are inputs shifted by one

    def first_steps(sampler, n):
        it = iter(sampler)
        return [next(it) for _ in range(n)]

    one = first_steps(DpShardSampler(global_batch=8, dp=1, dp_rank=0), 16)
    halves = [first_steps(DpShardSampler(8, 2, r), 8) for r in (0, 1)]
    for step in range(2):
        merged = halves[0][step * 4 : step * 4 + 4] + halves[1][step * 4 : step * 4 + 4]
        assert sorted(merged) == one[step * 8 : step * 8 + 8]


def test_parallel_dims_must_multiply_to_the_rank_count():
    dims = ParallelDims(dp=2, tp=2, pp=1, world_size=4)
    assert dims.dp_enabled and dims.tp_enabled and not dims.pp_enabled
    assert [dims.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match=r"dp\*tp\*pp = 2\*2\*1 = 4 but the trial has 2 ranks"):
        ParallelDims(dp=2, tp=2, pp=1, world_size=2)


def test_profile_breaks_a_step_into_categories(tmp_path):
    train = training(tmp_path, micro_batch_size=4)
    train.step()
    report = profile_steps(train, steps=2, out_dir=tmp_path / "profile", rank=0, family="cpu")
    write_breakdown(report, tmp_path / "profile")
    seconds = report["seconds_per_step"]
    assert set(seconds) == set(CATEGORIES)
    assert seconds["compute"] > 0 and seconds["attention"] > 0 and seconds["optimizer"] > 0
    assert seconds["communication"] == 0  # one rank talks to nobody
    assert sum(report["fractions"].values()) == pytest.approx(1.0)
    assert 0 < len(report["top_operators"]) <= 15
    assert json.loads((tmp_path / "profile" / "breakdown.json").read_text())["steps"] == 2
    trace = json.loads((tmp_path / "profile" / "trace-rank0.json").read_text())
    assert any(ev.get("name") == "optimizer" for ev in trace["traceEvents"])


def test_the_fp16_loss_scaler_unscales_tensor_parallel_gradients(tmp_path):
    """torch's GradScaler refuses DTensor gradients mixed with plain ones (tp with fp16)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tuner.workload.precision import ShardAwareGradScaler

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
        plain = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([{"params": [plain]}, {"params": [sharded]}], lr=0.5)
        scaler = ShardAwareGradScaler("cpu", init_scale=1024.0)
        scaler.scale(sharded.full_tensor().sum() + plain.sum()).backward()
        scaler.unscale_(opt)
        assert torch.equal(sharded.grad.full_tensor(), torch.ones(4, 4))  # 1024 divided back out
        assert torch.equal(plain.grad, torch.ones(4))
        scaler.step(opt)
        scaler.update()
        assert torch.equal(sharded.full_tensor(), torch.full((4, 4), 0.5))

        opt.zero_grad()
        scaler.scale(sharded.full_tensor().sum() * float("inf")).backward()
        scaler.step(opt)  # an overflow skips the step and halves the scale
        scaler.update()
        assert torch.equal(sharded.full_tensor(), torch.full((4, 4), 0.5))
        assert scaler.get_scale() == 512.0
    finally:
        dist.destroy_process_group()
