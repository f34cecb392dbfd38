"""On an NVIDIA GPU: does the warm-start helper stay fit to fork CUDA ranks?

1. In a fresh interpreter, import what the helper preloads, then each step of Inductor's
   preparation (`tuner.executors.warm.prepare_compile`), and print after each whether CUDA is
   initialised (a process forked after that cannot use the GPU).
2. Run a compiled trial and then an eager one through the local executor's helper, as `tuner tune`
   does, and print how each started (warm or cold, and why) and how it ended.

    python benchmarks/cuda_warm_check.py

Exits 0 with a note when no NVIDIA GPU is visible.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = r"""
import importlib, sys
from tuner.executors.warm import PRELOAD
from tuner.executors.warm_server import device_runtime
for name in PRELOAD:
    importlib.import_module(name)
print("after the preload:", device_runtime())
import torch._inductor.compile_fx
print("after importing torch._inductor.compile_fx:", device_runtime())
from torch._inductor import cpu_vec_isa
from torch._inductor.codecache import CppPythonBindingsCodeCache, torch_key
cpu_vec_isa.valid_vec_isa_list()
print("after valid_vec_isa_list():", device_runtime())
torch_key()
print("after torch_key():", device_runtime())
from tuner.executors.warm import _PROBE_KERNEL
CppPythonBindingsCodeCache.load_pybinding(["float*"], _PROBE_KERNEL)
print("after loading a C++ kernel:", device_runtime())
"""

MODEL = {"family": "llama", "layers": 2, "hidden": 1024, "heads": 16, "kv_heads": 4, "seq_len": 1024,
         "vocab": 32000, "ffn": 2816}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no NVIDIA GPU visible (torch.cuda.is_available() is False): nothing checked")
        return 0
    print("== what initialises CUDA in the helper", flush=True)
    subprocess.run([sys.executable, "-c", PROBE], check=False)

    from tuner.config import Config
    from tuner.executors.local import run_trial
    from tuner.recipe import recipe_from_dict
    from tuner.result import TrialSpec

    recipe = recipe_from_dict(
        {
            "name": "warm-check",
            "model": MODEL,
            "train": {"global_batch_size": 4},
            "hardware": {"device": "cuda", "devices": 1},
            "measure": {"warmup_steps": 3, "steps": 3, "max_seconds": 3, "timeout_s": 240},
        }
    )
    print("\n== a compiled trial, then an eager one, through the helper", flush=True)
    with tempfile.TemporaryDirectory(prefix="tuner-warm-check-") as tmp:
        for i, compile_mode in enumerate(("default", "none", "default")):
            knobs = {"micro_batch_size": 2, "amp": "O1", "amp_dtype": "bf16", "attention": "flash"}
            config = Config.from_params({**knobs, "compile": compile_mode})
            spec = TrialSpec(
                recipe=recipe.to_dict(),
                config=config.to_dict(),
                family="cuda",
                workdir=str(Path(tmp) / f"t{i}"),
                timeout_s=240.0,
                tag=str(i),
            )
            res = run_trial(spec)
            print(
                f"compile={compile_mode}: {res.status}, start {res.extra.get('start')}, "
                f"{res.tokens_per_s or 0:,.0f} tokens/s, wall {res.wall_s:.1f} s {res.error or ''}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
