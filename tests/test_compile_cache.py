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


# One rank of a build and then of its launch, as `tuner.workload.build_rank` (cold phase) and
# `tuner.workload.run` do them, around a compiled one-line function instead of a model: the
# machinery is the real one, only the graph is small (a tiny GPT's C++ kernels took 66 s to compile
# on 2 cores, too slow for this suite). Rank 1 is a pipeline stage of its own: its graph differs
# from the others'. Writes rank<R>.json: the cache it loaded, Inductor's counters, its output.
CACHE_RANK = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    spec = json.load(open(sys.argv[1]))
    wd, rank, phase = Path(spec["workdir"]), int(os.environ["RANK"]), os.environ["CACHE_TEST_PHASE"]
    if phase == "build":  # before torch is imported, as build_rank's main does
        from tuner.workload.build_rank import _point_inductor_at_workdir
        _point_inductor_at_workdir(wd, rank)
    import torch, torch.distributed as dist
    from torch._dynamo.utils import counters
    from tuner import compile_cache

    dist.init_process_group("gloo")
    loaded = compile_cache.load_for_rank(rank)
    fn = (lambda x: (x.cos() + 1) * 3) if rank == 1 else (lambda x: x.sin() * 2)
    out = torch.compile(fn)(torch.arange(8.0)).sum().reshape(1)
    dist.all_reduce(out)
    if phase == "build":
        compile_cache.save(wd / "cache", rank)
    mine = {"loaded": loaded and str(loaded), "counters": dict(counters["inductor"]), "sum": out.item()}
    (wd / f"rank{rank}.json").write_text(json.dumps(mine))
    if rank == 0:
        (wd / "result.json").write_text(json.dumps({"status": "ok", "step_time_s": 0.01}))
    os._exit(0)
    """
)
CACHE_WORLD = 3


def run_cache_ranks(root, phase: str, env: dict[str, str]) -> list[dict]:
    """The three ranks of one phase, through the real trial runner; each rank's rank<R>.json."""
    from tuner.executors.local import run_trial
    from tuner.result import TrialSpec

    workdir = root / phase
    spec = TrialSpec(recipe={}, config={"dp": CACHE_WORLD}, family="cpu", workdir=str(workdir), timeout_s=240)
    # Scalar kernels: no vector-ISA probe programs to compile in each rank's Inductor directory
    # (six of them, three quarters of this test's C++ builds).
    env = {
        **env,
        "CACHE_TEST_PHASE": phase,
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "TORCHINDUCTOR_VEC_ISA_OK": "0",
    }
    res = run_trial(spec, env=env, module="cache_rank")
    assert res.status == "ok", f"{res.error}\n{res.log_tail}"
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(CACHE_WORLD)]


def test_a_launched_build_gives_each_rank_the_compile_cache_of_its_own_graphs(tmp_path, monkeypatch):
    """The cold build gives each rank an Inductor directory of its own; the build ships one cache
    for the ranks that compiled rank 0's graphs and one of its own for a rank whose graphs differ;
    launched from a fresh Inductor directory (launch.sh's), each rank loads the one with its graphs
    and compiles nothing. Given the shared cache, rank 1 would compile its graph again; and while
    the build compared caches byte for byte, no two ranks' caches ever matched (each holds its own
    Inductor directory's path), so every rank was shipped a cache of its own."""
    from tuner import compile_cache
    from tuner.build.base import KERNELS_TAR
    from tuner.build.kernels import collect_compiled, pack_compiled_kernels
    from tuner.workload.build_rank import unpack_kernels

    (tmp_path / "cache_rank.py").write_text(CACHE_RANK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    built = run_cache_ranks(tmp_path, "build", {})
    cold = tmp_path / "build"
    kernels = [{p.name for p in (cold / "inductor" / f"rank{r}").glob("*/*.so")} for r in range(3)]
    assert all(kernels) and kernels[0] == kernels[2] != kernels[1]  # each rank compiled in its own
    assert all(rank["counters"].get("fxgraph_cache_miss") == 1 for rank in built), built

    stage = tmp_path / "stage"
    stage.mkdir()
    _, caches = collect_compiled(cold, stage, CACHE_WORLD)
    own = compile_cache.rank_file(1)
    assert caches == {"rank0": compile_cache.SHARED, "rank1": own, "rank2": compile_cache.SHARED}
    assert sorted(p.name for p in stage.glob("*.bin")) == sorted([compile_cache.SHARED, own])

    # launch.sh: the compiled kernels unpacked into a fresh directory all ranks share.
    inductor = tmp_path / "run" / "inductor"
    packed = pack_compiled_kernels([cold / "inductor" / f"rank{r}" for r in range(3)], cold / KERNELS_TAR)
    assert packed == len(set().union(*kernels)) == unpack_kernels(cold / KERNELS_TAR, inductor)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor), compile_cache.ENV: str(stage / compile_cache.SHARED)}
    launched = run_cache_ranks(tmp_path, "launch", env)
    for rank in launched:
        assert rank["counters"].get("fxgraph_cache_hit") == 1, launched
        assert not rank["counters"].get("fxgraph_cache_miss"), launched
    assert [rank["loaded"] for rank in launched] == [str(stage / caches[f"rank{r}"]) for r in range(3)]
    assert [rank["sum"] for rank in launched] == [rank["sum"] for rank in built]
