"""What the compiler made: every rank's generated modules and fused kernels (with the operators each
fused, from Inductor's origin comments or its kernel names), the compile caches, and the compiled
CPU kernels packed so a warm start loads them instead of rebuilding them."""

from __future__ import annotations

import functools
import json
import re
import shutil
import tarfile
from pathlib import Path
from typing import Any

from tuner import compile_cache
from tuner.build.base import KERNELS_TAR

# A kernel definition in Inductor's generated module: `name = async_compile.<kind>(..., '''source''')`.
_KERNEL_DEF = re.compile(
    r"^(?P<name>\w+) = async_compile\.(?P<kind>\w+)\((?P<head>[^\n]*?)r?'''\n?(?P<src>.*?)'''",
    re.DOTALL | re.MULTILINE,
)
_ORIGIN = re.compile(
    r"# Topologically Sorted Source Nodes: \[(?P<nodes>.*?)\], Original ATen: \[(?P<aten>.*?)\]"
)
_CALL = re.compile(r"^\s*(?P<name>\w+)(?:\.\w+)*\(")


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


def collect_compiled(cold: Path, stage: Path, world: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every rank's kernels into stage/kernels (and their index), the compile caches and the
    compiled kernels' tar."""
    (stage / "kernels").mkdir()
    index: list[dict[str, Any]] = []
    caches: dict[str, str] = {}
    for r in range(world):
        index += collect_kernels(cold / "inductor" / f"rank{r}", stage / "kernels" / f"rank{r}", r)
        blob = cold / "cache" / f"rank{r}.bin"
        if not blob.is_file():
            continue  # nothing compiled on this rank, nothing to cache
        # Symmetric ranks (dp, tp) usually compile identical graphs: ship one cache for them.
        same = compile_cache.same_graphs(cold / "cache", r)
        caches[f"rank{r}"] = compile_cache.SHARED if r == 0 or same else compile_cache.rank_file(r)
        shutil.copy(blob, stage / caches[f"rank{r}"])
    (stage / "kernels" / "index.json").write_text(json.dumps(index, indent=1))
    if (cold / KERNELS_TAR).is_file():
        shutil.copy(cold / KERNELS_TAR, stage / KERNELS_TAR)
    return index, caches
