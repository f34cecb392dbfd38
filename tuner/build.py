"""The build of a trial's config: compile it in its own process group, collect the fused kernels
Inductor generated, the portable compile cache, the compiled CPU kernels, a profile and a launch
script, and store the lot as one checked archive (`builds/<study>/<trial>.tar.gz`) registered in
the builds table."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import os
import re
import shlex
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.artifacts import ArtifactStore, write_manifest
from tuner.config import Config, infeasible_reasons
from tuner.recipe import Recipe
from tuner.result import RESULT_KEYS, TrialResult, TrialSpec

RANK_MODULE = "tuner.workload.build_rank"
KERNELS_TAR = "compiled-kernels.tar"
# Environment of the measured run that changes its speed; launch.sh exports what is set here.
_LAUNCH_ENV = re.compile(
    r"^(OMP_NUM_THREADS|MKL_NUM_THREADS|CUDA_VISIBLE_DEVICES|ASCEND_RT_VISIBLE_DEVICES|"
    r"PYTORCH_CUDA_ALLOC_CONF|PYTORCH_NPU_ALLOC_CONF|NCCL_\w+|TORCH_NCCL_\w+|HCCL_\w+|GLOO_\w+)$"
)
# A kernel definition in Inductor's generated module: `name = async_compile.<kind>(..., '''source''')`.
_KERNEL_DEF = re.compile(
    r"^(?P<name>\w+) = async_compile\.(?P<kind>\w+)\((?P<head>[^\n]*?)r?'''\n?(?P<src>.*?)'''",
    re.DOTALL | re.MULTILINE,
)
_ORIGIN = re.compile(
    r"# Topologically Sorted Source Nodes: \[(?P<nodes>.*?)\], Original ATen: \[(?P<aten>.*?)\]"
)
_CALL = re.compile(r"^\s*(?P<name>\w+)(?:\.\w+)*\(")

Progress = Callable[[int, int, str], None]


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
    kernels: int = 0
    build_id: int | None = None  # row in the builds table, when registered

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- which trial ----------------------------------------------------------------------------------


def _load_trial(recipe: Recipe, family: str, name: str | None, number: int | None, url: str):
    """(study name, trial number, Config, measured metrics) of the trial to build."""
    import optuna
    import sqlalchemy
    from optuna.trial import TrialState

    from tuner.fingerprint import fingerprint
    from tuner.space import config_from_params
    from tuner.storage import get_storage
    from tuner.study import study_name as make_study_name
    from tuner.summary import build_summary

    name = name or make_study_name(recipe, fingerprint(family))
    try:
        study = optuna.load_study(study_name=name, storage=get_storage(url))
    except KeyError:
        shown = sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
        raise NoStudyError(
            f"no study {name!r} for recipe {recipe.name!r} on this machine in {shown}; "
            "run `tuner tune RECIPE` first (or pass --storage where it ran)"
        ) from None
    measured = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if t.user_attrs.get("tokens_per_s")
    ]
    valid = sorted(t.number for t in measured)
    if number is None:
        best = build_summary(study, url).best
        if best is None and valid:
            raise NoTrialError(
                f"no trial of {name!r} qualifies as the best (loss drift or memory budget); "
                f"pick one with --trial N; valid: {', '.join(map(str, valid))}",
                valid,
            )
        if best is None:
            raise NoTrialError(
                f"study {name!r} has no measured trial yet; run `tuner tune RECIPE` first", valid
            )
        number = int(best["trial"])
    trial = next((t for t in measured if t.number == number), None)
    if trial is None:
        shown = ", ".join(map(str, valid)) or "none"
        raise NoTrialError(
            f"--trial {number}: no measured trial with that number in {name!r}; valid: {shown}", valid
        )
    metrics = {k: trial.user_attrs.get(k) for k in RESULT_KEYS if k in trial.user_attrs}
    return name, number, config_from_params(trial.params), metrics


def build_plan(config: Config, recipe: Recipe, family: str) -> tuple[Config, str | None]:
    """The config to compile, and why nothing will be compiled (None when it will be).

    A winner that already compiles is built as is and compared with compile=none; an eager one is
    built with compile=default and compared with its own eager number, re-measured.
    """
    from tuner.devices import describe

    if config.compile != "none":
        return config, None
    if family == "npu":
        return config, "torch.compile is not driven on Ascend NPU, so the kernel part is not produced there"
    candidate = dataclasses.replace(config, compile="default")
    info = describe(family)
    before = set(infeasible_reasons(config, recipe, info))
    reasons = [r for r in infeasible_reasons(candidate, recipe, info) if r not in before]
    if reasons:
        return config, f"compile=default cannot run with this config ({'; '.join(reasons)})"
    return candidate, None


# ---- running the phases ---------------------------------------------------------------------------


def _run_phase(spec: TrialSpec, env: dict[str, str], deadline: float, what: str) -> TrialResult:
    from tuner.executors.local import run_trial

    left = deadline - time.monotonic()
    if left <= 1:
        raise BuildError(f"the build ran out of time before the {what}; raise --timeout-s")
    spec = dataclasses.replace(spec, timeout_s=left)
    # run_trial supervises from a thread: Ctrl-C here sets `stop`, and run_trial then ends the
    # phase's whole process session instead of leaving compiler processes behind.
    stop, box = threading.Event(), {}

    def supervise() -> None:
        try:
            box["r"] = run_trial(spec, env=env, module=RANK_MODULE, stop=stop)
        except Exception as err:  # noqa: BLE001 - reported below as a failed phase
            box["r"] = TrialResult(status="error", error_kind=type(err).__name__, error=str(err))

    worker = threading.Thread(target=supervise, daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.25)
    except KeyboardInterrupt:
        stop.set()
        worker.join()
        raise
    result = box["r"]
    if result.status != "ok":
        hint = "; raise --timeout-s" if result.status == "timeout" else ""
        raise BuildError(f"{what} failed ({result.status}): {result.error}{hint}; log: {result.log_path}")
    return result


# ---- collecting what the compiler made ------------------------------------------------------------


def _fused_ops(name: str) -> str:
    """`cpp_fused_add_native_layer_norm_0` -> `add_native_layer_norm` (Inductor's naming)."""
    _, _, rest = name.partition("fused_")
    return re.sub(r"_\d+$", "", rest)


@functools.lru_cache(maxsize=1)
def _op_names() -> dict[str, str]:
    """{op name: namespace} for the ATen and prims operators Inductor names kernels after."""
    import torch

    out: dict[str, str] = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = qualified.partition("::")
        name = rest.split(".")[0]
        # Inductor names kernels after ATen ops; prims only fill in names ATen lacks (iota).
        if namespace == "aten" or (namespace == "prims" and name not in out):
            out[name] = namespace
    return out


def split_fused(fused: str) -> list[str]:
    """The operators in a fused kernel's name, taking the longest known op name at each point:
    `add_native_layer_norm` -> [aten.add, aten.native_layer_norm]. Unknown words stay as they are."""
    known, ops, i = _op_names(), [], 0
    while i < len(fused):
        ends = [j for j in range(len(fused), i, -1) if fused[i:j] in known and fused[j : j + 1] in ("", "_")]
        if ends:
            j = ends[0]
            ops.append(f"{known[fused[i:j]]}.{fused[i:j]}")
        else:
            j = fused.find("_", i + 1) if "_" in fused[i + 1 :] else len(fused)
            ops.append(fused[i:j])
        i = j + 1
    return ops


def _origins(code: str, kernels: set[str]) -> dict[str, dict[str, list[str]]]:
    """Kernel name -> source nodes and ATen ops, from an origin comment right above its call.

    Inductor writes such comments above Triton kernel calls and extern calls (mm, bmm); a comment
    belongs to the first call after it, so one above an extern call is not given to a kernel.
    """
    out: dict[str, dict[str, list[str]]] = {}
    last: dict[str, list[str]] | None = None
    for line in code.splitlines():
        m = _ORIGIN.search(line)
        if m:
            split = lambda s: [p.strip() for p in s.split(",") if p.strip()]  # noqa: E731
            last = {"source_nodes": split(m["nodes"]), "aten_ops": split(m["aten"])}
            continue
        call = _CALL.match(line)
        if call is None or last is None:
            continue
        if call["name"] in kernels:
            out.setdefault(call["name"], last)
            last = None
        elif call["name"] in ("extern_kernels", "torch"):
            last = None
    return out


def collect_kernels(inductor_dir: Path, dest: Path, rank: int) -> list[dict[str, Any]]:
    """Copy every generated module and fused kernel of one rank into `dest`; return index entries."""
    entries: list[dict[str, Any]] = []
    modules = sorted(
        p for p in inductor_dir.rglob("*.py") if "async_compile" in p.read_text(errors="replace")
    )
    for module in modules:
        code = module.read_text(errors="replace")
        first = code.splitlines()[0] if code else ""
        graph = re.sub(r"[^A-Za-z0-9_]+", "", first.partition("AOT ID:")[2]) or module.stem
        gdir = dest / f"{graph}-{module.stem[:8]}"
        gdir.mkdir(parents=True, exist_ok=True)
        (gdir / "module.py").write_text(code)  # the whole generated module, with origin comments
        defs = list(_KERNEL_DEF.finditer(code))
        origins = _origins(code, {m["name"] for m in defs})
        for m in defs:
            kind = m["kind"]
            lang = "cpp" if kind.startswith("cpp") else "triton" if kind == "triton" else kind
            ext = {"cpp": ".cpp", "triton": ".py"}.get(lang, ".txt")
            path = gdir / f"{m['name']}{ext}"
            path.write_text(m["src"])
            origin = origins.get(m["name"], {})
            entries.append(
                {
                    "rank": rank,
                    "graph": gdir.name,
                    "kernel": m["name"],
                    "language": lang,
                    "file": path.relative_to(dest.parent.parent).as_posix(),
                    "fused": _fused_ops(m["name"]),
                    # The origin comment when Inductor wrote one (Triton), else read off the name.
                    "aten_ops": origin.get("aten_ops") or split_fused(_fused_ops(m["name"])),
                    "source_nodes": origin.get("source_nodes", []),
                }
            )
    return entries


def pack_compiled_kernels(inductor_dirs: list[Path], dest: Path) -> int:
    """Tar the C++ kernels Inductor compiled (`<hash dir>/<name>.so` and the `.cpp` it was built
    from) out of the ranks' cache dirs; return how many .so files went in.

    compile-cache.bin holds graphs and generated code, not these, so without them a warm start
    rebuilds every CPU kernel. Ranks that compiled the same source share one file (the name is
    the source's hash).
    """
    seen: set[str] = set()
    with tarfile.open(dest, "w") as tar:
        for cache in inductor_dirs:
            for so in sorted(cache.glob("*/*.so")):
                for path in (so.with_suffix(".cpp"), so):
                    name = path.relative_to(cache).as_posix()
                    if path.is_file() and name not in seen:
                        seen.add(name)
                        tar.add(path, arcname=name)
    return sum(name.endswith(".so") for name in seen)


def _launch_script(
    trial: int, study: str, world: int, tokens: float | None, device: str, compiled: bool = False
) -> str:
    env = {k: v for k, v in sorted(os.environ.items()) if _LAUNCH_ENV.match(k)}
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()) or "# (none set)\n"
    if compiled:
        exports += f"""# The build's compiler output, so a compile starts warm: compiled CPU kernels (machine-specific:
# they load only with the CPU, compiler and torch of the build) and the portable compile cache.
if [ -f {KERNELS_TAR} ]; then mkdir -p run/inductor && tar -xf {KERNELS_TAR} -C run/inductor; fi
export TORCHINDUCTOR_CACHE_DIR="$PWD/run/inductor"
if [ -f compile-cache.bin ]; then export TUNER_COMPILE_CACHE="$PWD/compile-cache.bin"; fi
"""
    measured = f"{tokens:,.0f} tokens/s" if tokens else "its throughput"
    return f"""#!/usr/bin/env bash
# Reproduces trial {trial} of study {study}: the measured config ({measured} on {device}).
# Runs {world} rank(s) of `python -m tuner.workload spec.json` under torchrun; rank 0 prints the
# result and writes it to run/result.json. Needs this project installed (`pip install training-tuner`).
set -euo pipefail
cd "$(dirname "${{BASH_SOURCE[0]}}")"
# Environment of the measured run:
{exports}if command -v torchrun >/dev/null 2>&1; then run=(torchrun); else run=("${{PYTHON:-python3}}" -m torch.distributed.run); fi
"${{run[@]}}" --standalone --nproc-per-node {world} -m tuner.workload spec.json
"""


def _speed_line(compiled: float | None, eager: float | None, mode: str) -> str:
    if not compiled or not eager:
        return "no compiled/eager comparison"
    ratio = compiled / eager
    verdict = (
        f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower; the kernels are kept anyway"
    )
    return f"compiled (compile={mode}) {compiled:,.0f} tokens/s vs eager {eager:,.0f} tokens/s: {verdict}"


def _collect_compiled(cold: Path, stage: Path, world: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every rank's kernels into stage/kernels (and their index), the compile caches and the
    compiled kernels' tar."""
    (stage / "kernels").mkdir()
    index: list[dict[str, Any]] = []
    caches: dict[str, str] = {}
    rank0 = cold / "cache" / "rank0.bin"
    for r in range(world):
        index += collect_kernels(cold / "inductor" / f"rank{r}", stage / "kernels" / f"rank{r}", r)
        blob = cold / "cache" / f"rank{r}.bin"
        if not blob.is_file():
            continue  # nothing compiled on this rank, nothing to cache
        # Symmetric ranks (dp, tp) usually compile identical graphs: ship one cache for them.
        same = rank0.is_file() and blob.read_bytes() == rank0.read_bytes()
        caches[f"rank{r}"] = "compile-cache.bin" if r == 0 or same else f"compile-cache-rank{r}.bin"
        shutil.copy(blob, stage / caches[f"rank{r}"])
    (stage / "kernels" / "index.json").write_text(json.dumps(index, indent=1))
    if (cold / KERNELS_TAR).is_file():
        shutil.copy(cold / KERNELS_TAR, stage / KERNELS_TAR)
    return index, caches


def _ratio(cold: float, warm: float) -> str:
    if not warm:
        return "instant"
    return f"{cold / warm:.2f}x faster" if cold >= warm else f"{warm / cold:.2f}x slower"


def _summary_lines(
    record: BuildRecord,
    measured: dict[str, Any],
    mode: str | None,
    index: list[dict[str, Any]],
    note: str | None,
    cxx: tuple[float, float, int] | None = None,
) -> list[str]:
    """What the build found, in sentences: the CLI prints them, config.json keeps them."""
    lines = [
        f"trial {record.trial_number} of {record.study_name}: "
        f"measured {measured.get('tokens_per_s') or 0:,.0f} tokens/s"
    ]
    if mode is None:
        lines.append(f"eager (compile=none) re-measured: {record.eager_tokens_per_s or 0:,.0f} tokens/s")
        lines.append(f"kernels: not produced: {note}")
        return lines
    lines.append(_speed_line(record.compiled_tokens_per_s, record.eager_tokens_per_s, mode))
    cold_s, warm_s = record.compile_cold_s or 0.0, record.compile_warm_s
    if warm_s is not None:
        cold_cpu, warm_cpu = record.compile_cold_cpu_s or 0.0, record.compile_warm_cpu_s or 0.0
        lines.append(
            f"compile time: cold {cold_s:.1f}s, warm from compile-cache.bin"
            f"{f' and {KERNELS_TAR}' if cxx and cxx[2] else ''} {warm_s:.1f}s "
            f"({_ratio(cold_s, warm_s)}); tracing and code generation {cold_cpu:.1f} -> {warm_cpu:.1f} "
            f"CPU s ({_ratio(cold_cpu, warm_cpu)})"
        )
        if cxx and cxx[2]:
            lines.append(
                f"C++ kernel builds {cxx[0]:.1f} -> {cxx[1]:.1f} CPU s: {KERNELS_TAR} holds the {cxx[2]} "
                "compiled CPU kernels (.so); machine-specific like Triton cubins on CUDA: they load "
                "only with the CPU, C++ compiler and torch of this build"
            )
        elif cxx:
            lines.append(
                f"C++ kernel builds {cxx[0]:.1f} -> {cxx[1]:.1f} CPU s: the cache holds graphs and "
                "generated code, not compiled CPU kernels, so a warm start still builds them"
            )
    else:
        lines.append(f"compile time: cold {cold_s:.1f}s; {note}")
    langs = sorted({e["language"] for e in index}) or ["none"]
    ranks = len({e["rank"] for e in index})
    lines.append(f"kernels: {len(index)} fused kernels ({', '.join(langs)}) from {ranks} rank(s)")
    return lines


def _cache_misses(warm: dict[str, Any] | None) -> list[int]:
    """Ranks whose warm compile did not take its graphs from the loaded cache."""
    ranks = (warm or {}).get("ranks", [])
    return [
        r["rank"]
        for r in ranks
        if r["counters"].get("fxgraph_cache_miss") or not r["counters"].get("fxgraph_cache_hit")
    ]


def _register(url: str, record: BuildRecord) -> int:
    from tuner.db import Build, session_scope
    from tuner.migrations import is_current, upgrade

    if not is_current(url):
        upgrade(url)
    with session_scope(url) as s:
        row = Build(
            study_name=record.study_name,
            trial_number=record.trial_number,
            path=record.path,
            sha256=record.sha256,
            size_bytes=record.size_bytes,
        )
        s.add(row)
        s.flush()
        return row.id


# ---- the build ------------------------------------------------------------------------------------


def build_trial(
    recipe: Recipe,
    *,
    study_name: str | None = None,
    trial_number: int | None = None,
    storage_url: str | None = None,
    store: ArtifactStore | None = None,
    timeout_s: float = 900,
    progress: Progress | None = None,
) -> BuildRecord:
    """Build the study's best trial (or `trial_number`) of `recipe` into the artifact store."""
    from tuner.devices import describe, resolve_family
    from tuner.fingerprint import fingerprint
    from tuner.storage import default_storage_url

    deadline = time.monotonic() + timeout_s
    url = storage_url or default_storage_url()
    store = store or ArtifactStore()
    family = resolve_family(recipe.hardware.device)
    say = progress or (lambda step, total, message: None)
    say(0, 5, "reading the trial from the study")
    study, number, config, measured = _load_trial(recipe, family, study_name, trial_number, url)
    built, no_kernels = build_plan(config, recipe, family)
    compiled = built.compile != "none"
    store.root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".work-{study[:40]}-{number}-", dir=store.root))
    spec = TrialSpec(
        recipe=recipe.to_dict(), config=built.to_dict(), family=family, workdir=str(work / "cold"),
        timeout_s=timeout_s, seed=0, tag=f"build-{number}",
    )  # fmt: skip
    what = (
        f"compiling (compile={built.compile}) cold, then measuring it and eager"
        if compiled
        else "measuring and profiling (no compile)"
    )
    say(1, 5, what)
    cold = _run_phase(spec, {"TUNER_BUILD_PHASE": "cold"}, deadline, "cold build phase")
    info = cold.extra["build"]
    warm_s, warm_note, warm_info, n_so = None, None, None, 0
    if compiled:
        say(2, 5, f"compiling again in a fresh process from compile-cache.bin and {KERNELS_TAR} (warm)")
        inductor = [work / "cold" / "inductor" / f"rank{r}" for r in range(config.world_size)]
        n_so = pack_compiled_kernels(inductor, work / "cold" / KERNELS_TAR)
        warm_spec = dataclasses.replace(spec, workdir=str(work / "warm"))
        env = {"TUNER_BUILD_PHASE": "warm", "TUNER_BUILD_CACHE": str(work / "cold" / "cache")}
        if n_so:
            env["TUNER_BUILD_KERNELS"] = str(work / "cold" / KERNELS_TAR)
        try:
            warm_info = _run_phase(warm_spec, env, deadline, "warm build phase").extra["build"]
            warm_s = warm_info["compile_s"]
        except BuildError as err:
            warm_note = f"warm compile not measured: {err}"
    say(3, 5, "collecting kernels, cache, profile and manifest")
    stage = work / "stage"
    stage.mkdir()
    record = BuildRecord(
        path="", sha256="", size_bytes=0, study_name=study, trial_number=number,
        compiled_tokens_per_s=cold.tokens_per_s if compiled else None,
        eager_tokens_per_s=info["eager"]["tokens_per_s"],
        compile_cold_s=info.get("compile_s"), compile_warm_s=warm_s, config=built.active_params(),
        compile_cold_cpu_s=(info.get("compile_cpu") or {}).get("in_process_s"),
        compile_warm_cpu_s=((warm_info or {}).get("compile_cpu") or {}).get("in_process_s"),
    )  # fmt: skip
    index, caches = _collect_compiled(work / "cold", stage, config.world_size) if compiled else ([], {})
    record.kernels = len(index)
    shutil.copytree(work / "cold" / "profile", stage / "profile")
    device = describe(family)
    launch_spec = dataclasses.replace(
        spec,
        config=config.to_dict(),
        workdir="run",
        tag=f"launch-{number}",
        timeout_s=recipe.measure.timeout_s,
    )
    (stage / "spec.json").write_text(json.dumps(launch_spec.to_dict(), indent=1))
    launch = stage / "launch.sh"
    launch.write_text(
        _launch_script(
            number, study, config.world_size, measured.get("tokens_per_s"), device.name, bool(caches)
        )
    )
    launch.chmod(0o755)
    (stage / "logs").mkdir()
    for phase in ("cold", "warm"):
        if (work / phase / "trial.log").is_file():
            shutil.copy(work / phase / "trial.log", stage / "logs" / f"{phase}.log")
    cxx = None
    if info.get("compile_cpu") and warm_info and family == "cpu":
        cxx = (
            info["compile_cpu"]["compiler_children_s"],
            warm_info["compile_cpu"]["compiler_children_s"],
            n_so,
        )
    lines = _summary_lines(
        record, measured, built.compile if compiled else None, index, warm_note or no_kernels, cxx
    )
    missed = _cache_misses(warm_info)
    if missed:
        lines.append(
            f"warning: the warm compile missed compile-cache.bin on rank(s) {', '.join(map(str, missed))}, "
            "so its time is a recompile (Inductor's FX graph cache key did not match)"
        )
    (stage / "config.json").write_text(
        json.dumps(
            {
                "study": study,
                "trial": number,
                "config": config.to_dict(),
                "built_config": built.to_dict(),
                "recipe": recipe.to_dict(),
                "measured": measured,
                "build": {
                    "compiled_tokens_per_s": record.compiled_tokens_per_s,
                    "eager": info["eager"],
                    "compile_cold_s": record.compile_cold_s,
                    "compile_warm_s": warm_s,
                    "compile_cpu": {
                        "cold": info.get("compile_cpu"),
                        "warm": (warm_info or {}).get("compile_cpu"),
                    },
                    "warm": warm_info,
                    "compile_cache": caches,
                    "compiled_kernels": {"file": KERNELS_TAR, "shared_objects": n_so} if n_so else None,
                    "kernels_not_produced": no_kernels,
                    "breakdown": cold.breakdown,
                    "summary": lines,
                },
            },
            indent=1,
        )
    )
    write_manifest(
        stage,
        {
            "format": 1,
            "study": study,
            "trial": number,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "fingerprint": fingerprint(family),
            "device": device.to_dict(),
        },
    )
    say(4, 5, "archiving and registering the build")
    path, digest, size = store.put(study, number, stage)
    record.path, record.sha256, record.size_bytes = str(path.resolve()), digest, size
    lines.append(f"archive: {path} ({size / 2**20:.1f} MiB, sha256 {digest[:12]})")
    try:
        record.build_id = _register(url, record)
    except Exception as err:  # noqa: BLE001 - the archive is good; say why it is not listed
        lines.append(f"not registered in the builds table: {err}")
    record.summary = lines
    shutil.rmtree(work, ignore_errors=True)
    say(5, 5, "done")
    return record
