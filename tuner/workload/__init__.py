"""Code that runs inside a trial process. Never imports FastAPI, SQLAlchemy, Optuna or Ray.

Public surface: `Training` (one rank's training for a TrialSpec, in-process), `ParallelDims`,
`RankEnv`, `GPT`/`build_model`. They load lazily so that `tuner.workload.flops` (used by the
estimator) does not import torch's distributed stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Training": "tuner.workload.train",
    "ParallelDims": "tuner.workload.parallel",
    "RankEnv": "tuner.workload.parallel",
    "GPT": "tuner.workload.model",
    "build_model": "tuner.workload.model",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tuner.workload' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
