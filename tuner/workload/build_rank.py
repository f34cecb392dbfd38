"""One rank of a build: `python -m tuner.workload.build_rank SPEC.json`, started by the build like a
trial's rank. TUNER_BUILD_PHASE picks the phase:

- `cold`: compile the config, timing the cold compile; measure, profile, and save the compiler's
  portable cache (`torch.compiler.save_cache_artifacts`) to `{workdir}/cache/rank{r}.bin`, its
  entries' keys beside it (`tuner.compile_cache.save`); then measure the same config eager
  (compile=none) for comparison. Inductor writes its generated kernels under
  `{workdir}/inductor/rank{r}` (TORCHINDUCTOR_CACHE_DIR); the build collects them.
- `warm`: a fresh process with an empty inductor cache dir unpacks the cold phase's compiled CPU
  kernels (the tar TUNER_BUILD_KERNELS names, when set) into it and loads the cache saved by the
  cold phase (from the directory TUNER_BUILD_CACHE names) before compiling, and times the compile
  again.

Rank 0 writes `result.json` (a TrialResult; the build's numbers in `extra["build"]`), a failing rank
writes `rank{r}.error.json`, the same protocol as `tuner.workload`, so `run_trial` supervises it.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PHASE_ENV = "TUNER_BUILD_PHASE"
CACHE_ENV = "TUNER_BUILD_CACHE"
KERNELS_ENV = "TUNER_BUILD_KERNELS"
# Steps after the compiling one in the warm phase: enough for a median to subtract from the
# first step, few because the warm phase is about compile time, not throughput.
WARM_EXTRA_STEPS = 2


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def _point_inductor_at_workdir(workdir: Path, rank: int) -> Path:
    # Each rank gets its own cache dir so the build can tell whose kernels are whose, and so the
    # cold compile really is cold (no kernels from earlier runs on this machine).
    cache = workdir / "inductor" / f"rank{rank}"
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    return cache


def _timed_step(train: Any, family: str) -> float:
    from tuner.devices import synchronize

    synchronize(family)
    t0 = time.perf_counter()
    train.step()
    synchronize(family)
    return time.perf_counter() - t0


def _import_compiler() -> float:
    """Import the compiler stack now; return the wall seconds it took.

    Every process pays this once, cache or no cache (in the warm phase the cache load would pay
    it, in the cold one the first compile), so it is kept out of both compile timings.
    """
    t0 = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch._functorch._aot_autograd.autograd_cache  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    return time.perf_counter() - t0


def _cpu_s() -> tuple[float, float]:
    """CPU seconds so far of (this process, its reaped children).

    Inside the process: tracing, lowering and code generation, what compile-cache.bin lets a
    process skip. The children are the C++ compiler runs Inductor starts for CPU kernels, which
    the cache does not hold. Wall time of a compile swings with whatever else shares the cores;
    CPU time barely does, so both phases report it next to the wall time.
    """
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


def _cpu_since(start: tuple[float, float]) -> dict[str, float]:
    now = _cpu_s()
    return {"in_process_s": now[0] - start[0], "compiler_children_s": now[1] - start[1]}


def _cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k: int(v) for k, v in counters["inductor"].items() if "cache" in k}


def _slowest_cpu(ranks: list[dict[str, Any]]) -> dict[str, float]:
    return max((r["compile_cpu"] for r in ranks), key=lambda c: c["in_process_s"] + c["compiler_children_s"])


def _gather(obj: dict[str, Any], world: int) -> list[dict[str, Any]]:
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def cold(spec: Any, env: Any, baseline: int) -> Any:
    """Compiled, then eager: this rank's measurements, profile and saved compile cache."""
    from tuner import compile_cache
    from tuner.workload.profile import profile_steps, write_breakdown
    from tuner.workload.run import PROFILE_STEPS, _result, measure
    from tuner.workload.train import Training

    workdir = Path(spec.workdir)
    compiled = spec.config.get("compile", "none") != "none"
    mine: dict[str, Any] = {"rank": env.rank}
    # The built config comes first, so its cold compile runs in a process in the same state as the
    # warm phase's (nothing built before it) and the two compile timings compare.
    train = Training.from_spec(spec, env)
    cpu0 = _cpu_s()
    first = _timed_step(train, spec.family) if compiled else None
    mine["compile_cpu"] = _cpu_since(cpu0) if compiled else None
    times, losses = measure(train, spec, baseline)
    out = workdir / "profile"
    report = profile_steps(train, min(PROFILE_STEPS, _measured_steps(spec)), out, env.rank, spec.family)
    mine["breakdown"] = report["seconds_per_step"]
    result = _result(train, spec, times, losses, {}, report, [])
    eager = result
    if compiled:
        mine["compile_s"] = max(0.0, first - statistics.median(times))
        saved = compile_cache.save(workdir / "cache", env.rank)
        if saved is not None:
            mine["cache_bytes"] = saved
        del train
        eager_spec = dataclasses.replace(spec, config={**spec.config, "compile": "none"})
        train = Training.from_spec(eager_spec, env)
        eager_times, eager_losses = measure(train, eager_spec, baseline)
        eager = _result(train, eager_spec, eager_times, eager_losses, {}, None, [])
    ranks = _gather(mine, env.world_size)
    if env.rank != 0:
        return None
    write_breakdown(report, out)
    result.extra["build"] = {
        "phase": "cold",
        "compiled": compiled,
        "eager": eager.public() | {"step_times": eager.step_times},
        "compile_s": max(r["compile_s"] for r in ranks) if compiled else None,
        "compile_cpu": _slowest_cpu(ranks) if compiled else None,
        "ranks": ranks,
    }
    return result


def _measured_steps(spec: Any) -> int:
    return int(spec.recipe.get("measure", {}).get("steps", 5))


def unpack_kernels(archive: Path, cache_dir: Path) -> int:
    """Unpack compiled kernels (`<hash dir>/<name>.so` and its `.cpp`) into an inductor cache dir,
    where Inductor finds a kernel's .so by the hash of its source and skips the C++ build."""
    import tarfile

    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        tar.extractall(cache_dir, filter="data")
    return sum(m.name.endswith(".so") for m in members)


def warm(spec: Any, env: Any) -> Any:
    """Unpack the cold phase's kernels, load its cache for this rank, then compile and time it again."""
    import torch

    from tuner.record.status import OK
    from tuner.result import TrialResult
    from tuner.workload.train import Training

    source = Path(os.environ[CACHE_ENV]) / f"rank{env.rank}.bin"
    try:
        blob = source.read_bytes()
    except OSError as err:
        raise FileNotFoundError(f"{source}: the cold phase saved no compile cache ({err.strerror})") from None
    t0, cpu0 = time.perf_counter(), _cpu_s()
    kernels = os.environ.get(KERNELS_ENV)
    unpacked = unpack_kernels(Path(kernels), Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])) if kernels else 0
    torch.compiler.load_cache_artifacts(blob)
    load_s = time.perf_counter() - t0
    train = Training.from_spec(spec, env)
    first = _timed_step(train, spec.family)
    compile_cpu = _cpu_since(cpu0)
    rest = [_timed_step(train, spec.family) for _ in range(WARM_EXTRA_STEPS)]
    mine = {
        "rank": env.rank,
        "load_s": load_s,  # unpacking the kernels and loading the cache
        "kernels_unpacked": unpacked,
        "compile_cpu": compile_cpu,
        "compile_s": max(0.0, first - statistics.median(rest)) + load_s,
        "counters": _cache_counters(),
    }
    ranks = _gather(mine, env.world_size)
    if env.rank != 0:
        return None
    median = statistics.median(rest)
    return TrialResult(
        status=OK,
        step_time_s=median,
        step_times=rest,
        tag=spec.tag,
        extra={
            "build": {
                "phase": "warm",
                "compile_s": max(r["compile_s"] for r in ranks),
                "compile_cpu": _slowest_cpu(ranks),
                "ranks": ranks,
            }
        },
    )


def main(spec_path: str) -> int:
    from tuner.workload.__main__ import _load_spec

    spec = _load_spec(spec_path)
    workdir = Path(spec.workdir)
    phase = os.environ.get(PHASE_ENV, "cold")
    _point_inductor_at_workdir(workdir, _rank())
    # torch is imported only now, after TORCHINDUCTOR_CACHE_DIR is set.
    import torch.distributed as dist

    from tuner.memory import reset_peak_memory
    from tuner.workload.parallel import RankEnv, set_rank_threads
    from tuner.workload.run import _write_json, error_record

    baseline = reset_peak_memory(spec.family)
    try:
        if phase not in ("cold", "warm"):
            raise ValueError(f"{PHASE_ENV}={phase!r}: use cold or warm")
        env = RankEnv.from_environ()
        set_rank_threads(env, spec.config.get("cpu_affinity", "none"))
        if spec.config.get("compile", "none") != "none":
            _import_compiler()
        result = cold(spec, env, baseline) if phase == "cold" else warm(spec, env)
        if result is not None:
            _write_json(workdir / "result.json", result.to_dict())
            build = result.extra["build"]
            print(
                f"build {phase}: compile {build.get('compile_s') or 0:.1f}s, step {result.step_time_s:.4f}s"
            )
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure becomes a record, never a hang
        record = error_record(exc)
        _write_json(workdir / f"rank{_rank()}.error.json", record)
        print(
            f"rank {_rank()} failed ({record['error_kind']}): {record['error']}", file=sys.stderr, flush=True
        )
        return 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tuner.workload.build_rank SPEC.json   (TUNER_BUILD_PHASE=cold|warm)")
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        # Peers may be blocked in a collective with us; the launcher ends the rest.
        os._exit(code)
