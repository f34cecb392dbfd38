"""The build of a trial's config: compile it in its own process group, collect the fused kernels
Inductor generated, the portable compile cache, the compiled CPU kernels, a profile and a launch
script, and store the lot as one checked archive (`builds/<study>/<trial>-<sha256 prefix>.tar.gz`) registered in
the builds table.

Modules: `select` (which trial, what to compile), `phases` (each phase a trial of its own),
`kernels` (what the compiler made), `launch` (launch.sh), `report` (what the build found),
`register` (the builds table), `pipeline` (`build_trial`, in that order)."""

from tuner.build.base import KERNELS_TAR, BuildError, BuildRecord, NoStudyError, NoTrialError
from tuner.build.kernels import collect_kernels, pack_compiled_kernels, split_fused
from tuner.build.pipeline import build_trial
from tuner.build.select import build_plan

__all__ = [
    "KERNELS_TAR",
    "BuildError",
    "BuildRecord",
    "NoStudyError",
    "NoTrialError",
    "build_plan",
    "build_trial",
    "collect_kernels",
    "pack_compiled_kernels",
    "split_fused",
]
