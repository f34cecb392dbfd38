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


def compile_once(cache_dir, backend: str, marked: bool = True) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, backend, "marked" if marked else "plain"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


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
