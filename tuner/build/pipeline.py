"""`build_trial`: compile a trial's config cold and then warm (from the cold run's caches), stage what
the compiler made with a profile, the spec and `launch.sh`, and store the lot as one checked archive
registered in the builds table."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import io
import json
import shutil
import socket
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.artifacts import ArtifactStore, write_manifest
from tuner.build.base import KERNELS_TAR, BuildError, BuildRecord
from tuner.build.cpu_match import cpu_flags
from tuner.build.kernels import collect_compiled, pack_compiled_kernels
from tuner.build.launch import write_launch
from tuner.build.phases import run_phase
from tuner.build.register import register
from tuner.build.report import cache_misses, summary_lines
from tuner.build.select import build_plan, load_trial, machine_refusal
from tuner.config import Config
from tuner.executors.base import Executor
from tuner.fingerprint import Described
from tuner.models.base import Requirement
from tuner.recipe import Recipe
from tuner.record import keys
from tuner.result import TrialResult, TrialSpec

Progress = Callable[[int, int, str], None]
STEPS = 5


@dataclass
class _Plan:
    """The trial being built and where its build is made."""

    recipe: Recipe
    described: Described  # where the trials ran (this machine, or a Ray cluster's nodes)
    study: str
    number: int
    config: Config  # what was measured
    built: Config  # what is compiled (compile=default for an eager winner)
    no_kernels: str | None  # why nothing is compiled, when nothing is
    measured: dict[str, Any]
    work: Path
    spec: TrialSpec
    deadline: float

    @property
    def compiled(self) -> bool:
        return self.built.compile != "none"

    @property
    def family(self) -> str:
        return self.described.family


@dataclass
class _Phases:
    cold: TrialResult
    warm: dict[str, Any] | None = None  # the warm phase's build report
    warm_note: str | None = None  # why the warm compile was not measured
    shared_objects: int = 0  # compiled CPU kernels packed for the warm start

    @property
    def info(self) -> dict[str, Any]:
        return self.cold.extra["build"]


def _plan(
    recipe: Recipe,
    described: Described,
    study_name: str | None,
    trial_number: int | None,
    url: str,
    store: ArtifactStore,
    timeout_s: float,
) -> _Plan:
    family = described.family
    study, number, config, measured = load_trial(recipe, described.fingerprint, study_name, trial_number, url)
    refusal = machine_refusal(config, recipe, family, number, described.device.count, described.device.where)
    if refusal is not None:
        raise BuildError(refusal)
    built, no_kernels = build_plan(config, recipe, described.device)
    store.root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".work-{study[:40]}-{number}-", dir=store.root))
    spec = TrialSpec(
        recipe=recipe.to_dict(), config=built.to_dict(), family=family, workdir=str(work / "cold"),
        timeout_s=timeout_s, seed=0, tag=f"build-{number}",
    )  # fmt: skip
    return _Plan(
        recipe,
        described,
        study,
        number,
        config,
        built,
        no_kernels,
        measured,
        work,
        spec,
        time.monotonic() + timeout_s,
    )


def _compile(p: _Plan, say: Progress) -> _Phases:
    what = (
        f"compiling (compile={p.built.compile}) cold, then measuring it and eager"
        if p.compiled
        else "measuring and profiling (no compile)"
    )
    say(1, STEPS, what)
    phases = _Phases(run_phase(p.spec, {"TUNER_BUILD_PHASE": "cold"}, p.deadline, "cold build phase"))
    if not p.compiled:
        return phases
    say(2, STEPS, f"compiling again in a fresh process from compile-cache.bin and {KERNELS_TAR} (warm)")
    cold = p.work / "cold"
    inductor = [cold / "inductor" / f"rank{r}" for r in range(p.config.world_size)]
    phases.shared_objects = pack_compiled_kernels(inductor, cold / KERNELS_TAR)
    env = {"TUNER_BUILD_PHASE": "warm", "TUNER_BUILD_CACHE": str(cold / "cache")}
    if phases.shared_objects:
        env["TUNER_BUILD_KERNELS"] = str(cold / KERNELS_TAR)
    warm_spec = dataclasses.replace(p.spec, workdir=str(p.work / "warm"))
    try:
        phases.warm = run_phase(warm_spec, env, p.deadline, "warm build phase").extra["build"]
    except BuildError as err:
        phases.warm_note = f"warm compile not measured: {err}"
    return phases


def _record(p: _Plan, ph: _Phases) -> BuildRecord:
    info, warm = ph.info, ph.warm or {}
    return BuildRecord(
        path="", sha256="", size_bytes=0, study_name=p.study, trial_number=p.number,
        compiled_tokens_per_s=ph.cold.tokens_per_s if p.compiled else None,
        eager_tokens_per_s=info["eager"]["tokens_per_s"],
        compile_cold_s=info.get("compile_s"), compile_warm_s=warm.get("compile_s"), config=p.built.active_params(),
        launch_config=p.config.active_params(),
        compile_cold_cpu_s=(info.get("compile_cpu") or {}).get("in_process_s"),
        compile_warm_cpu_s=(warm.get("compile_cpu") or {}).get("in_process_s"),
    )  # fmt: skip


def _summary(p: _Plan, ph: _Phases, record: BuildRecord, index: list[dict[str, Any]]) -> list[str]:
    info = ph.info
    cxx = None
    if info.get("compile_cpu") and ph.warm and p.family == "cpu":
        cxx = (
            info["compile_cpu"]["compiler_children_s"],
            ph.warm["compile_cpu"]["compiler_children_s"],
            ph.shared_objects,
        )
    mode = p.built.compile if p.compiled else None
    lines = summary_lines(record, p.measured, mode, index, ph.warm_note or p.no_kernels, cxx)
    missed = cache_misses(ph.warm)
    if missed:
        lines.append(
            f"warning: the warm compile missed compile-cache.bin on rank(s) {', '.join(map(str, missed))}, "
            "so its time is a recompile (Inductor's FX graph cache key did not match)"
        )
    return lines


def _stage(p: _Plan, ph: _Phases) -> tuple[Path, BuildRecord]:
    """The build's directory: kernels and caches, profile, spec and launch.sh, logs, config.json."""
    stage = p.work / "stage"
    stage.mkdir()
    record = _record(p, ph)
    index, caches = collect_compiled(p.work / "cold", stage, p.config.world_size) if p.compiled else ([], {})
    record.kernels = len(index)
    shutil.copytree(p.work / "cold" / "profile", stage / "profile")
    launch_spec = dataclasses.replace(
        p.spec,
        config=p.config.to_dict(),
        workdir="run",
        tag=f"launch-{p.number}",
        timeout_s=p.recipe.measure.timeout_s,
    )
    tokens = p.measured.get(keys.TOKENS_PER_S)
    device = p.described.device.name
    requires = write_launch(stage, launch_spec, p.recipe, p.number, p.study, tokens, device, bool(caches))
    (stage / "logs").mkdir()
    for phase in ("cold", "warm"):
        if (p.work / phase / "trial.log").is_file():
            shutil.copy(p.work / phase / "trial.log", stage / "logs" / f"{phase}.log")
    record.summary = _summary(p, ph, record, index)
    _write_config(stage, p, ph, record, caches, requires)
    return stage, record


def _write_config(
    stage: Path,
    p: _Plan,
    ph: _Phases,
    record: BuildRecord,
    caches: dict[str, str],
    requires: list[Requirement],
) -> None:
    info, warm = ph.info, ph.warm
    build = {
        "compiled_tokens_per_s": record.compiled_tokens_per_s,
        "eager": info["eager"],
        "compile_cold_s": record.compile_cold_s,
        "compile_warm_s": record.compile_warm_s,
        "compile_cpu": {"cold": info.get("compile_cpu"), "warm": (warm or {}).get("compile_cpu")},
        "warm": warm,
        "compile_cache": caches,
        # With the CPU's instruction set they were compiled for (`tuner.build.cpu_match`).
        "compiled_kernels": {
            "file": KERNELS_TAR,
            "shared_objects": ph.shared_objects,
            "cpu_flags": cpu_flags(),
        }
        if ph.shared_objects
        else None,
        "kernels_not_produced": p.no_kernels,
        "breakdown": ph.cold.breakdown,
        "summary": record.summary,
    }
    config = {
        "study": p.study, "trial": p.number, "config": p.config.to_dict(), "built_config": p.built.to_dict(),
        "recipe": p.recipe.to_dict(), "measured": p.measured, "build": build,
        "requires": [dataclasses.asdict(r) for r in requires],  # needed besides this project
    }  # fmt: skip
    (stage / "config.json").write_text(json.dumps(config, indent=1))
    created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    write_manifest(
        stage,
        {"format": 1, "study": p.study, "trial": p.number, "created": created,
         "fingerprint": p.described.fingerprint, "device": p.described.device.to_dict(),
         "built_on": socket.gethostname()},
    )  # fmt: skip


def build_trial(
    recipe: Recipe,
    *,
    study_name: str | None = None,
    trial_number: int | None = None,
    storage_url: str | None = None,
    store: ArtifactStore | None = None,
    timeout_s: float = 900,
    progress: Progress | None = None,
    executor: Executor | None = None,
) -> BuildRecord:
    """Build the study's best trial (or `trial_number`) of `recipe` into the artifact store. With
    an `executor` whose trials run elsewhere (Ray), the study is the one its machines ran and the
    build compiles and measures on one of them, holding the trial's devices; the archive comes back
    to this machine's store."""
    from tuner.fingerprint import described_here
    from tuner.storage import default_storage_url

    url = storage_url or default_storage_url()
    store = store or ArtifactStore()
    say = progress or (lambda step, total, message: None)
    say(0, STEPS, "reading the trial from the study")
    device = recipe.hardware.device
    described = executor.describe(device) if executor is not None else described_here(device)
    plan = _plan(recipe, described, study_name, trial_number, url, store, timeout_s)
    try:
        record = _build(plan, described, store, say, executor)
    except BaseException:
        _keep_only_logs(plan.work)  # a failure's message names its log; the caches go
        raise
    try:
        record.build_id = register(url, record)
    except Exception as err:  # noqa: BLE001 - the archive is good; say why it is not listed
        record.summary.append(f"not registered in the builds table: {err}")
    shutil.rmtree(plan.work, ignore_errors=True)
    say(5, STEPS, "done")
    return record


def _keep_only_logs(work: Path) -> None:
    """What a failed or interrupted build leaves in the store: its logs (the error names one), not
    its compile caches and staged files (on a GPU, whole Inductor and Triton caches per failure)."""
    for path in sorted(work.rglob("*"), reverse=True):  # files before their folders
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()  # only once empty: a folder holding a log stays
            elif not path.name.endswith(".log"):
                path.unlink()


def _build(plan: _Plan, described, store: ArtifactStore, say, executor: Executor | None) -> BuildRecord:
    """Compile, measure and archive `plan` (here, or on a node of `executor`'s cluster)."""
    if executor is not None and executor.elsewhere:
        say(1, STEPS, f"compiling and measuring on a {plan.family} node of the cluster")
        # Ranks share a CPU node's cores, as they do on this machine (`machine_refusal`).
        count = (
            min(plan.config.world_size, described.device.count)
            if plan.family == "cpu"
            else plan.config.world_size
        )
        try:
            packed, record = executor.call_on_devices(build_elsewhere, (plan,), plan.family, count)
        except (BuildError, ValueError, OSError):
            raise  # the build's own failures, a device not there, a timeout: each says why already
        except Exception as err:  # noqa: BLE001 - the cluster's: no node for it, a node that died
            raise BuildError(
                f"the build on the cluster failed: {type(err).__name__}: {err}; the study is unchanged, "
                "run the build again once the cluster's nodes are back (`ray status`)"
            ) from err
        say(3, STEPS, "unpacking what the node built")
        stage = plan.work / "stage"
        with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as tar:
            tar.extractall(stage, filter="data")
    else:
        phases = _compile(plan, say)
        say(3, STEPS, "collecting kernels, cache, profile and manifest")
        stage, record = _stage(plan, phases)
    say(4, STEPS, "archiving and registering the build")
    path, digest, size = store.put(plan.study, plan.number, stage)
    record.path, record.sha256, record.size_bytes = str(path.resolve()), digest, size
    record.summary.append(f"archive: {path} ({size / 2**20:.1f} MiB, sha256 {digest[:12]})")
    return record


def build_elsewhere(plan: _Plan) -> tuple[bytes, BuildRecord]:
    """On the machine that builds (a Ray node): compile and stage `plan` in a work directory of its
    own there, and return the staged build as a gzipped tar with its record."""
    work = Path(tempfile.mkdtemp(prefix=f"tuner-build-{plan.number}-"))
    try:
        spec = dataclasses.replace(plan.spec, workdir=str(work / "cold"))
        here = dataclasses.replace(
            plan, work=work, spec=spec, deadline=time.monotonic() + plan.spec.timeout_s
        )
        stage, record = _stage(here, _compile(here, lambda step, total, message: None))
        record.summary.append(f"built on {socket.gethostname()}")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for item in sorted(stage.iterdir()):
                tar.add(item, arcname=item.name)
        return buffer.getvalue(), record
    finally:
        shutil.rmtree(work, ignore_errors=True)
