"""The build's `launch.sh`: the torchrun command that reproduces the measured run, with the
environment that changed its speed and, for a compiled config, the build's compiler output."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.build.base import KERNELS_TAR
from tuner.models.base import Requirement

if TYPE_CHECKING:
    from tuner.recipe import Recipe
    from tuner.result import TrialSpec

# Environment of the measured run that changes its speed; launch.sh exports what is set here.
# Not which devices are visible (CUDA_/ASCEND_RT_VISIBLE_DEVICES): that is the machine's, not the
# config's (a Ray task building on GPUs 6 and 7 would pin every node running the script to them).
_LAUNCH_ENV = re.compile(
    r"^(OMP_NUM_THREADS|MKL_NUM_THREADS|"
    r"PYTORCH_CUDA_ALLOC_CONF|PYTORCH_NPU_ALLOC_CONF|NCCL_\w+|TORCH_NCCL_\w+|HCCL_\w+|GLOO_\w+)$"
)


def write_launch(
    stage: Path,
    spec: TrialSpec,
    recipe: Recipe,
    trial: int,
    study: str,
    tokens: float | None,
    device: str,
    compiled: bool = False,
) -> list[Requirement]:
    """spec.json (`spec`, the config to reproduce) and launch.sh into `stage`; returns what the
    model needs installed besides this project (launch.sh checks it first; config.json lists it)."""
    from tuner.config import Config
    from tuner.models import family_of

    requires = family_of(recipe.model).requires(recipe.model)
    world = Config.from_params(spec.config).world_size
    (stage / "spec.json").write_text(json.dumps(spec.to_dict(), indent=1))
    launch = stage / "launch.sh"
    launch.write_text(
        launch_script(trial, study, world, tokens, device, compiled, recipe.hardware.nodes, requires)
    )
    launch.chmod(0o755)
    return requires


def launch_script(
    trial: int,
    study: str,
    world: int,
    tokens: float | None,
    device: str,
    compiled: bool = False,
    nodes: int = 1,
    requires: Sequence[Requirement] = (),
) -> str:
    env = {k: v for k, v in sorted(os.environ.items()) if _LAUNCH_ENV.match(k)}
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()) or "# (none set)\n"
    warm = ""
    if compiled:
        warm = f"""# The build's compiler output, so a compile starts warm: compiled CPU kernels (machine code for
# the build's CPU: unpacked only where the CPU has the same instruction set, `tuner.build.cpu_match`)
# and the portable compile cache.
if [ -f {KERNELS_TAR} ] && "$py" -m tuner.build.cpu_match config.json; then
  mkdir -p run/inductor && tar -xf {KERNELS_TAR} -C run/inductor
fi
export TORCHINDUCTOR_CACHE_DIR="$PWD/run/inductor"
if [ -f compile-cache.bin ]; then export TUNER_COMPILE_CACHE="$PWD/compile-cache.bin"; fi
"""
    measured = f"{tokens:,.0f} tokens/s" if tokens else "its throughput"
    # The environment, then the interpreter, the checks and the build's compiler output.
    setup = exports + _INTERPRETER + _checks(requires) + warm
    if nodes > 1:
        return _multi_node(trial, study, world, measured, device, setup, nodes)
    return f"""#!/usr/bin/env bash
# Reproduces trial {trial} of study {study}: the measured config ({measured} on {device}).
# Runs {world} rank(s) of `python -m tuner.workload spec.json` under torchrun; rank 0 prints the
# result and writes it to run/result.json. Needs this project installed (`pip install training-tuner`);
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "${{BASH_SOURCE[0]}}")"
# Environment of the measured run:
{setup}"${{run[@]}}" --standalone --nproc-per-node {world} -m tuner.workload spec.json
"""


def _multi_node(
    trial: int, study: str, world: int, measured: str, device: str, setup: str, nodes: int
) -> str:
    per_node = world // nodes
    return f"""#!/usr/bin/env bash
# Reproduces trial {trial} of study {study}: the measured config ({measured} on {device}), {world} ranks
# over {nodes} nodes ({per_node} per node). Run this script on each of the {nodes} nodes, all at once:
#   NODE_RANK=0 MASTER_ADDR=<node 0's address> ./launch.sh     # on node 0
#   NODE_RANK=1 MASTER_ADDR=<node 0's address> ./launch.sh     # on node 1, and so on
# MASTER_PORT (default 29500) must be free on node 0. Ranks are laid out node-major, as measured:
# node k runs global ranks k*{per_node} .. k*{per_node}+{per_node - 1}, so tensor-parallel groups stay inside a node.
# Rank 0 prints the result and writes it to run/result.json on node 0. Needs this project installed.
set -euo pipefail
cd "$(dirname "${{BASH_SOURCE[0]}}")"
: "${{NODE_RANK:?set NODE_RANK to this node's index, 0..{nodes - 1}}}"
: "${{MASTER_ADDR:?set MASTER_ADDR to node 0's address}}"
# Environment of the measured run:
{setup}"${{run[@]}}" --nnodes={nodes} --node-rank="$NODE_RANK" --rdzv-endpoint="$MASTER_ADDR:${{MASTER_PORT:-29500}}" \\
    --nproc-per-node {per_node} -m tuner.workload spec.json
"""


# torchrun is `python -m torch.distributed.run`: run it from one interpreter, so what the checks
# below find installed is what the ranks import.
_INTERPRETER = """# One interpreter (PYTHON, default python3) for the checks and torchrun (torch.distributed.run):
py="${PYTHON:-python3}"
run=("$py" -m torch.distributed.run)
"""


def _checks(requires: Sequence[Requirement]) -> str:
    """One shell line per requirement: a missing one stops launch.sh with one line saying what to
    install, before torchrun starts ranks that would each fail with a traceback."""
    if not requires:
        return ""
    lines = ["# What the model needs installed besides this project:"]
    for r in requires:
        if r.entry_point:
            group, name = (json.dumps(part) for part in r.entry_point)
            code = f"import sys, importlib.metadata as m; sys.exit(not m.entry_points(group={group}, name={name}))"
        else:
            code = f"import sys, importlib.util as u; sys.exit(u.find_spec({json.dumps(r.module)}) is None)"
        had = f" (package {r.package} {r.version} in the measured run)" if r.version else ""
        message = (
            f"launch.sh: this config needs {r.what}{had}, which $py does not have; install it: {r.install}"
        )
        lines.append(f'"$py" -c {shlex.quote(code)} 2>/dev/null || {{ echo "{_dq(message)}" >&2; exit 1; }}')
    return "\n".join(lines) + "\n"


def _dq(text: str) -> str:
    """`text` inside double quotes, with $py left to expand."""
    return re.sub(r'(["`\\]|\$(?!py\b))', r"\\\1", text)
