"""The model families in one process: each family's formulas count what its module builds, a
llama recipe's fields are checked where they are written, the meta-device build allocates
nothing and the sharded initialisation gives every split the same numbers, and each knob changes
what a llama step runs."""

from __future__ import annotations

import pytest
import torch
import yaml
from test_workload_model import saved_bytes
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.config import Config, ConfigError, infeasible_reasons
from tuner.devices import describe
from tuner.models import family_of
from tuner.recipe import RecipeError, load_recipe, recipe_from_dict
from tuner.result import TrialSpec
from tuner.workload.apply import apply_compile, apply_offload, apply_recompute
from tuner.workload.flops import flops_per_token, param_count
from tuner.workload.model import build_meta, build_model, materialize
from tuner.workload.train import Training

LLAMA = {"family": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "seq_len": 32, "vocab": 256}
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def model_spec(**fields):
    return recipe_from_dict({"name": "m", "model": LLAMA | fields}).model


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"kv_heads": None},
        {"kv_heads": 1, "tie_embeddings": True},
        {"ffn": 96},
        {"family": "gpt", "kv_heads": None},
    ],
    ids=["gqa", "mha", "mqa-tied", "ffn", "gpt"],
)
def test_the_formulas_count_what_the_family_builds(fields):
    m = model_spec(**fields)
    model = build_meta(m, "math")
    params = list(model.parameters())
    assert all(p.is_meta for p in params)  # shapes only: nothing allocated
    assert sum(p.numel() for p in params) == param_count(m)
    family = family_of(m)
    linears = [mod for mod in model.modules() if isinstance(mod, torch.nn.Linear)]
    assert sum(lin.weight.numel() for lin in linears) == family.matmul_params(m)
    assert all(lin.bias is None for lin in linears)


def test_llama3_recipes_have_the_published_sizes():
    eight = load_recipe("recipes/llama3-8b.yaml").model
    seventy = load_recipe("recipes/llama3-70b.yaml").model
    assert (
        sum(p.numel() for p in build_meta(eight, "math").parameters()) == param_count(eight) == 8_030_261_248
    )
    assert param_count(seventy) == 70_553_706_496
    tiny = load_recipe("recipes/llama-tiny.yaml").model
    assert tiny.ffn_size == 768  # 8/3 * 256 = 682, rounded up to a multiple of 256
    assert model_spec(hidden=256, ffn_multiple_of=64).ffn_size == 704
    # GQA shrinks k and v: 6N is smaller than with as many kv heads as query heads.
    assert flops_per_token(tiny) < flops_per_token(tiny.model_copy(update={"kv_heads": None}))


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"kv_heads": 3}, "model.kv_heads", "must divide heads (4)"),
        ({"rope_theta": -1.0}, "model.rope_theta", "greater than 0"),
        ({"ffn_multiple_of": 0}, "model.ffn_multiple_of", "greater than or equal to 1"),
        ({"family": "gpt"}, "model.kv_heads", "only the llama family has kv_heads"),
    ],
)
def test_bad_llama_fields_name_their_field(fields, field, says):
    with pytest.raises(RecipeError) as err:
        model_spec(**fields)
    assert [f for f, _ in err.value.problems] == [field]
    assert says in str(err.value)


def write(tmp_path, **sections):
    recipe = {"name": "llama", "model": LLAMA, "hardware": {"device": "cpu", "devices": 1}} | sections
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.parametrize(
    ("sections", "args", "says"),
    [
        ({"model": LLAMA | {"kv_heads": 3}}, ["measure"], "model.kv_heads: kv_heads (3) must divide heads"),
        (
            {"model": LLAMA | {"rope_theta": -5}},
            ["measure"],
            "model.rope_theta: Input should be greater than 0",
        ),
        (
            {"model": LLAMA | {"kv_heads": 1}, "hardware": {"device": "cpu", "devices": 2}},
            ["measure", "--set", "tp=2"],
            "kv_heads (1) not divisible by tp (2)",
        ),
        (
            {
                "model": LLAMA | {"kv_heads": 1},
                "hardware": {"device": "cpu", "devices": 2},
                "search": {"overrides": {"tp": [2]}},
            },
            ["tune"],
            "model.kv_heads: kv_heads (1) not divisible by tp (2) in every split the space allows",
        ),
    ],  # fmt: skip
    ids=["kv_heads", "rope_theta", "measure-tp", "tune-tp"],
)
def test_the_cli_refuses_a_bad_llama_recipe_with_exit_2(tmp_path, sections, args, says):
    path = write(tmp_path, **sections)
    result = CliRunner().invoke(app, [args[0], path, *args[1:]])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_kv_heads_must_split_whole_over_tp():
    recipe = recipe_from_dict({"name": "r", "model": LLAMA, "hardware": {"devices": 4}})
    info = describe("cpu")
    info = type(info)(**{**info.__dict__, "count": 4})
    assert not infeasible_reasons(Config(tp=2, dp=2), recipe, info)
    assert "kv_heads (2) not divisible by tp (4)" in infeasible_reasons(Config(tp=4), recipe, info)


def test_recompute_layers_is_a_fraction_of_the_blocks():
    assert Config.from_params({"recompute_layers": "0.5"}).recompute_layers == 0.5
    with pytest.raises(ConfigError, match="valid values: 0.25, 0.5, 0.75, 1.0"):
        Config.from_params({"recompute_layers": 0.3})
    assert "recompute_layers" not in Config(recompute="none", recompute_layers=0.5).active_params()
    assert "sequence_parallel" not in Config(tp=1, sequence_parallel=True).active_params()
    assert Config(tp=2, sequence_parallel=True).active_params()["sequence_parallel"] is True


def test_every_split_starts_from_the_same_weights():
    """A pipeline stage and a recompute-wrapped model, built on meta and materialised, hold
    exactly the full model's numbers (parameters are drawn by their plain-model name)."""
    m = model_spec(layers=4)
    full = dict(build_model(m, "math", seed=3, device=CPU).named_parameters())
    stage = build_meta(m, "math").keep_stage(1, 2)
    apply_recompute(stage, "full", 0.5)
    materialize(stage, m, CPU, seed=3)
    names = [n for n, _ in stage.named_parameters()]
    assert "layers.2.inner.attention.wq.weight" in names and "layers.3.attention.wq.weight" in names
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name.replace("inner.", "")]), name
    assert stage.tok_embeddings is None and stage.output is not None
    other = build_model(m, "math", seed=4, device=CPU)
    assert not torch.equal(other.layers["2"].feed_forward.w1.weight, full["layers.2.feed_forward.w1.weight"])


def test_tied_embeddings_share_one_tensor_after_materialising():
    model = build_model(model_spec(tie_embeddings=True), "math", seed=0, device=CPU)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.device == CPU and model.output.weight.std() > 0


def test_recompute_and_its_layer_fraction_keep_fewer_activations():
    m = model_spec(layers=4)
    x = torch.randint(m.vocab, (4, m.seq_len))
    saved = {}
    for mode, fraction in [("none", 1.0), ("selective", 1.0), ("full", 1.0), ("full", 0.5), ("full", 0.25)]:
        model = build_model(m, "math", seed=0, device=CPU)
        apply_recompute(model, mode, fraction)
        saved[mode, fraction] = saved_bytes(model, x)
    assert saved["full", 1.0] < saved["selective", 1.0] < saved["none", 1.0]
    assert saved["full", 1.0] < saved["full", 0.5] < saved["full", 0.25] < saved["none", 1.0]
    # Offload hands every block's saved tensors to save_on_cpu (whose copies live on the host).
    model = build_model(m, "math", seed=0, device=CPU)
    apply_offload(model, pin_memory=False)
    assert saved_bytes(model, x) < saved["full", 1.0]


def test_compile_reaches_every_llama_block(monkeypatch):
    seen = []
    real = torch.compile

    def spy(fn, **kwargs):
        seen.append(kwargs.get("mode"))
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    model = build_meta(model_spec(), "math")
    apply_compile(model, "default")
    assert seen == ["default", "default"]


def training(tmp_path, **knobs) -> Training:
    recipe = recipe_from_dict({"name": "l", "model": LLAMA, "train": {"global_batch_size": 8}})
    spec = TrialSpec(
        recipe=recipe.to_dict(),
        config=Config.from_params(knobs).to_dict(),
        family="cpu",
        workdir=str(tmp_path),
    )
    return Training.from_spec(spec)


def losses(train: Training, steps: int = 3) -> list[float]:
    return train.global_losses([train.step() for _ in range(steps)])


def test_llama_knobs_that_change_how_keep_what_is_trained(tmp_path):
    reference = losses(training(tmp_path))
    assert 5.0 < reference[0] < 6.5  # about ln(256) for random tokens
    for knobs in (
        {"recompute": "full", "recompute_layers": 0.5},
        {"recompute": "selective", "attention": "flash"},
        {"optimizer_impl": "fused", "micro_batch_size": 4},
        {"amp": "O1", "amp_dtype": "bf16"},
    ):
        got = losses(training(tmp_path, **knobs))
        assert got == pytest.approx(reference, rel=2e-3), knobs


def test_llama_amp_and_attention_knobs_change_what_runs(tmp_path):
    o2 = training(tmp_path, amp="O2", amp_dtype="bf16")
    assert {p.dtype for p in o2.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in o2.master.master} == {torch.float32}
    flash = training(tmp_path, attention="flash")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flash.step()
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in {e.name for e in prof.events()}


def test_vocab_parallel_cross_entropy_matches_torchs(tmp_path):
    import torch.distributed as dist
    import torch.nn.functional as F

    from tuner.models.layers import vocab_parallel_cross_entropy

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        logits = torch.randn(2, 5, 11, requires_grad=True)
        targets = torch.randint(11, (2, 5))
        ours = vocab_parallel_cross_entropy(logits, targets, dist.group.WORLD)
        (g_ours,) = torch.autograd.grad(ours, logits)
        ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        (g_ref,) = torch.autograd.grad(ref, logits)
        assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
        assert torch.allclose(g_ours, g_ref, atol=1e-7)
    finally:
        dist.destroy_process_group()
