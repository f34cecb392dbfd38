"""A build's compiled CPU kernels are machine code for the CPU that built them (`-march=native`):
launch.sh unpacks them only where the CPU has the same instruction-set flags. Elsewhere they
loaded anyway (Inductor's cache key names neither the CPU nor its instruction set) and a rank
died by SIGILL on the first AVX-512 instruction."""

from __future__ import annotations

import json
import subprocess
import sys

from tuner.build.cpu_match import cpu_flags, kernels_usable
from tuner.build.launch import launch_script


def _config(flags: list[str] | None) -> dict:
    kernels = {"file": "compiled-kernels.tar", "shared_objects": 3}
    if flags is not None:
        kernels["cpu_flags"] = flags
    return {"build": {"compiled_kernels": kernels}}


def test_the_kernels_load_only_on_a_cpu_with_the_builds_instruction_set(tmp_path):
    here = cpu_flags()
    assert here and "fpu" in here  # read from /proc/cpuinfo on this Linux machine
    assert kernels_usable(_config(here)) == (True, "")
    usable, why = kernels_usable(_config([*here, "avx512_from_elsewhere"]))
    assert not usable and "lacks avx512_from_elsewhere" in why and "Inductor compiles its own" in why
    assert kernels_usable(_config(None))[0]  # a build that recorded no CPU (no CPU kernels)
    for flags, code in ((here, 0), (["sse2"], 1)):
        (tmp_path / "config.json").write_text(json.dumps(_config(flags)))
        run = subprocess.run([sys.executable, "-m", "tuner.build.cpu_match", "config.json"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert run.returncode == code, run.stderr
        assert ("not used" in run.stderr) == bool(code)


def test_launch_sh_unpacks_the_kernels_only_after_the_cpu_check():
    script = launch_script(3, "s", 2, 1000.0, "cpu", compiled=True)
    guard = 'if [ -f compiled-kernels.tar ] && "$py" -m tuner.build.cpu_match config.json; then'
    assert guard in script and script.index('py="${PYTHON:-python3}"') < script.index(guard)
    assert script.index(guard) < script.index("tar -xf compiled-kernels.tar")


def test_each_rank_loads_its_own_compile_cache_where_the_build_shipped_one(tmp_path):
    """launch.sh pointed every rank at compile-cache.bin while config.json mapped rank 1 to
    compile-cache-rank1.bin: a rank whose graphs differ (a pipeline stage) recompiled them all."""
    from tuner import compile_cache

    shared = tmp_path / compile_cache.SHARED
    shared.write_bytes(b"0")
    (tmp_path / compile_cache.rank_file(1)).write_bytes(b"1")
    assert compile_cache.for_rank(shared, 0) == shared
    assert compile_cache.for_rank(shared, 1) == tmp_path / "compile-cache-rank1.bin"
    assert compile_cache.for_rank(shared, 2) == shared  # compiled what rank 0 did: no file of its own
