"""What a build is (`BuildRecord`) and how one fails (`BuildError` and its kinds)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

KERNELS_TAR = "compiled-kernels.tar"


class BuildError(RuntimeError):
    """A build that cannot start or did not finish; the message says why and what to do."""


class NoStudyError(BuildError):
    """The recipe has no study (on this hardware and software) yet."""


class NoTrialError(BuildError):
    """The requested trial does not exist or has no measurement; `valid` lists the ones that do."""

    def __init__(self, message: str, valid: list[int]):
        super().__init__(message)
        self.valid = valid


@dataclass
class BuildRecord:
    """What a build produced and measured (tokens/s are global, compile times the slowest rank's)."""

    path: str
    sha256: str
    size_bytes: int
    study_name: str
    trial_number: int
    compiled_tokens_per_s: float | None
    eager_tokens_per_s: float | None
    compile_cold_s: float | None
    compile_warm_s: float | None
    # CPU seconds the compiles spent tracing, lowering and generating code (what compile-cache.bin
    # skips), apart from the C++ compiler runs; steadier than wall time when the cores are shared.
    compile_cold_cpu_s: float | None = None
    compile_warm_cpu_s: float | None = None
    summary: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the knob setting that was compiled
    # What launch.sh runs: the trial's measured config (eager where the winner was; the build
    # compiled it to compare and to ship its kernels).
    launch_config: dict[str, Any] = field(default_factory=dict)
    kernels: int = 0
    build_id: int | None = None  # row in the builds table, when registered

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
