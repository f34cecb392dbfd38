"""Fast checks of the build's decisions and parsing: what gets compiled, how kernels are indexed,
how the comparison reads. The real compile runs in test_build.py."""

from __future__ import annotations

import json

from tuner.build import build_plan, collect_kernels, split_fused
from tuner.build.report import _speed_line
from tuner.config import Config
from tuner.devices import describe, known_device
from tuner.recipe import recipe_from_dict

RECIPE = recipe_from_dict(
    {"name": "t", "model": {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 32, "vocab": 256},
     "hardware": {"device": "cpu", "devices": 1}}
)  # fmt: skip

# The shape of Inductor's generated module (abridged from a real CPU compile): kernel sources as
# async_compile calls, call sites with origin comments.
GENERATED = """# AOT ID: ['0_forward']
from torch._inductor.async_compile import AsyncCompile
async_compile = AsyncCompile()


cpp_fused_add_native_layer_norm_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0)
{
    out_ptr0[0] = in_ptr0[0];
}
''')


triton_poi_fused_relu_1 = async_compile.triton('triton_poi_fused_relu_1', '''
import triton
@triton.jit
def triton_poi_fused_relu_1(in_ptr0, xnumel, XBLOCK: tl.constexpr):
    pass
''', device_str='cuda')


async_compile.wait(globals())
class Runner:
    def call(self, args):
        buf0 = empty_strided_cpu((4, 64), (64, 1), torch.float32)
        cpp_fused_add_native_layer_norm_0(arg0_1, buf0)
        buf1 = empty_strided_cpu((4, 64), (64, 1), torch.float32)
        # Topologically Sorted Source Nodes: [x, linear], Original ATen: [aten.t, aten.mm]
        extern_kernels.mm(buf0, arg1_1, out=buf1)
        # Topologically Sorted Source Nodes: [relu], Original ATen: [aten.relu]
        triton_poi_fused_relu_1.run(buf1, 256, stream=stream0)
"""


def test_eager_winner_is_built_with_compile_default():
    plan, why_not = build_plan(Config(), RECIPE, describe("cpu"))
    assert plan.compile == "default" and why_not is None


def test_compiled_winner_is_built_as_is():
    plan, why_not = build_plan(Config(compile="max-autotune"), RECIPE, describe("cpu"))
    assert plan.compile == "max-autotune" and why_not is None


def test_an_eager_gpu_winner_is_planned_from_the_nodes_description_on_a_machine_without_gpus():
    """A Ray head without GPUs builds for its nodes' GPUs: the plan must not ask this machine for
    a CUDA device (it raised "Torch not compiled with CUDA enabled")."""
    recipe = recipe_from_dict({**RECIPE.to_dict(), "hardware": {"device": "cuda", "devices": 2}})
    plan, why_not = build_plan(Config(dp=2), recipe, known_device("H100", 2))
    assert plan.compile == "default" and why_not is None


def test_no_kernels_on_npu_and_the_reason_is_given():
    plan, why_not = build_plan(Config(), RECIPE, known_device("910B", 1))
    assert plan.compile == "none" and "Ascend NPU" in why_not


def test_config_that_cannot_compile_says_why():
    """offload hooks cannot be traced (a feasibility rule): the build stays eager and says so."""
    recipe = recipe_from_dict({**RECIPE.to_dict(), "hardware": {"device": "cpu", "devices": 1}})
    plan, why_not = build_plan(Config(offload=True), recipe, describe("cpu"))
    assert plan.compile == "none" and "offload" in why_not


def test_kernels_are_split_out_and_indexed_with_their_fused_ops(tmp_path):
    inductor = tmp_path / "inductor" / "ab"
    inductor.mkdir(parents=True)
    (inductor / "cabcdef.py").write_text(GENERATED)
    (inductor / "unrelated.py").write_text("print('not generated code')\n")
    index = collect_kernels(tmp_path / "inductor", tmp_path / "stage" / "kernels" / "rank0", rank=0)
    by_name = {e["kernel"]: e for e in index}
    assert set(by_name) == {"cpp_fused_add_native_layer_norm_0", "triton_poi_fused_relu_1"}
    cpp = by_name["cpp_fused_add_native_layer_norm_0"]
    assert cpp["language"] == "cpp" and cpp["fused"] == "add_native_layer_norm"
    # No origin comment above a C++ kernel call (the one below it belongs to the mm): the ops are
    # read off the kernel's name.
    assert cpp["aten_ops"] == ["aten.add", "aten.native_layer_norm"] and cpp["source_nodes"] == []
    source = (tmp_path / "stage" / cpp["file"]).read_text()
    assert source.startswith("#include") and 'extern "C"' in source and "'''" not in source
    tri = by_name["triton_poi_fused_relu_1"]
    assert (
        tri["language"] == "triton" and tri["aten_ops"] == ["aten.relu"] and tri["source_nodes"] == ["relu"]
    )
    assert "@triton.jit" in (tmp_path / "stage" / tri["file"]).read_text()
    assert cpp["file"].startswith("kernels/rank0/0_forward-")
    json.dumps(index)  # the index is written as JSON as is


def test_fused_names_split_into_operators():
    assert split_fused("_unsafe_view_gelu_gelu_backward_view") == [
        "aten._unsafe_view", "aten.gelu", "aten.gelu_backward", "aten.view"
    ]  # fmt: skip
    assert split_fused("add_not_an_op") == ["aten.add", "not", "an", "op"]


def test_comparison_says_faster_or_slower_with_both_numbers():
    assert _speed_line(3000.0, 1000.0, "default") == (
        "compiled (compile=default) 3,000 tokens/s vs eager 1,000 tokens/s: 3.00x faster"
    )
    slower = _speed_line(500.0, 1000.0, "default")
    assert "2.00x slower" in slower and "kernels are kept" in slower and "1,000" in slower


def test_a_gpu_winner_over_more_devices_than_this_machine_is_refused_and_a_cpu_one_is_not():
    """`tuner build` compiles and measures every rank on its own machine: a multi-node GPU winner
    whose ranks need more GPUs than the machine has is refused up front, naming both counts and
    the fix; on CPU the ranks share cores, and the build goes ahead."""
    from tuner.build.select import machine_refusal

    two_nodes = recipe_from_dict(
        {"name": "t", "model": {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 32, "vocab": 256},
         "train": {"global_batch_size": 16}, "hardware": {"device": "cpu", "devices": 16, "nodes": 2}}
    )  # fmt: skip
    winner = Config(dp=16, micro_batch_size=1)
    said = machine_refusal(winner, two_nodes, "cuda", 7, have=8)
    assert said is not None and "trial 7 runs over 2 nodes (16 cuda devices)" in said
    assert "but this machine has 8" in said and "on a machine with 16 cuda devices" in said
    assert "but each Ray node has 8" in machine_refusal(winner, two_nodes, "cuda", 7, 8, "each Ray node")
    assert machine_refusal(winner, two_nodes, "cuda", 7, have=16) is None
    assert machine_refusal(winner, two_nodes, "cpu", 7, have=2) is None
    assert machine_refusal(winner, RECIPE, "cuda", 7, have=1) is None


def test_launch_sh_keeps_the_runs_tuning_environment_but_not_which_devices_the_builder_saw(monkeypatch):
    """A Ray task builds on the GPUs Ray gave it (say 6 and 7): pinning every node that runs the
    script to those ids would leave a machine without them no device; thread counts travel."""
    from tuner.build.launch import launch_script

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "6,7")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    script = launch_script(3, "gpt-x", 4, 1000.0, "H100", nodes=2)
    assert "export OMP_NUM_THREADS=4" in script and "VISIBLE_DEVICES" not in script
