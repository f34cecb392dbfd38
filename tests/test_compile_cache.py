"""The compile cache across trials: a compiled trial reuses the joint graph an earlier trial of the
same graph traced (AOTAutograd's cache), and never a graph traced under another attention kernel.
Each compile runs in a fresh interpreter, as each trial's ranks do, over one cache directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tuner.executors.nodes import free_port

pytestmark = pytest.mark.slow

# One compiled attention, forward and backward, under the named kernel; prints AOTAutograd's cache
# counters and the sum of one input's gradient.
CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    from tuner.models.layers import attention, let_compile_cache_the_kernel_switch

    backend, marked = sys.argv[1], sys.argv[2] == "marked"
    if marked:
        let_compile_cache_the_kernel_switch()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    out = torch.compile(lambda q, k, v: attention(q, k, v, backend))(q, k, v)
    out.square().sum().backward()
    print(json.dumps({"cache": dict(counters["aot_autograd"]), "grad": float(q.grad.abs().sum())}))
    """
)


def run_child(script: str, cache_dir, *args: str) -> dict:
    """Run `script` in a fresh interpreter over the Inductor cache `cache_dir`; its last line's JSON."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_once(cache_dir, backend: str, marked: bool = True) -> dict:
    return run_child(CHILD, cache_dir, backend, "marked" if marked else "plain")


def test_a_compiled_graph_is_reused_only_under_the_same_attention_kernel(tmp_path):
    first = compile_once(tmp_path, "math")
    assert first["cache"].get("autograd_cache_saved") == 1, first
    again = compile_once(tmp_path, "math")
    assert again["cache"].get("autograd_cache_hit") == 1, again
    assert again["grad"] == pytest.approx(first["grad"], rel=1e-6)
    # The kernel's name is part of the graph, so the flash kernel misses the math kernel's entry.
    other = compile_once(tmp_path, "flash")
    assert other["cache"].get("autograd_cache_miss") == 1, other
    assert not other["cache"].get("autograd_cache_hit"), other
    assert other["grad"] == pytest.approx(first["grad"], rel=1e-4)  # same maths, another kernel
    # Unmarked, the kernel switch's private calls keep the graph out of the cache altogether: the
    # joint graph was traced again in every compiled trial.
    plain = compile_once(tmp_path, "math", marked=False)
    assert plain["cache"].get("autograd_cache_bypass") == 1, plain


# A tensor-parallel module (DTensor weights on a 1-rank gloo "tp" mesh), compiled, forward and
# backward; prints Inductor's FX graph cache counters. `tuner`: the rank-side module that every
# trial's ranks import first (`tuner.workload.parallel`) is imported before the mesh is built.
TP_CHILD = textwrap.dedent(
    """
    import json, os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    import torch, torch.distributed as dist
    if sys.argv[2] == "tuner":
        import tuner.workload.parallel
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torch.compile(model)(torch.randn(4, 16)).sum().backward()
    dist.destroy_process_group()
    print(json.dumps(dict(counters["inductor"])))
    """
)


def compile_tp_once(cache_dir, mode: str) -> dict:
    return run_child(TP_CHILD, cache_dir, str(free_port()), mode)


def test_a_tensor_parallel_graph_compiled_in_one_process_is_found_by_the_next(tmp_path):
    """A device mesh's cached Python hash is pickled into the key of every graph with DTensor
    inputs; torch's own is per interpreter, so without tuner's content hash a tp graph never
    matched another process's entry (each study, each new warm helper compiled it again)."""
    first = compile_tp_once(tmp_path / "tuner", "tuner")
    assert first.get("fxgraph_cache_miss") == 2, first  # forward and backward
    again = compile_tp_once(tmp_path / "tuner", "tuner")
    assert again.get("fxgraph_cache_hit") == 2 and not again.get("fxgraph_cache_miss"), again
    # Torch alone, for contrast: the second process misses what the first one saved.
    compile_tp_once(tmp_path / "plain", "plain")
    plain = compile_tp_once(tmp_path / "plain", "plain")
    assert plain.get("fxgraph_cache_miss") == 2 and not plain.get("fxgraph_cache_hit"), plain
