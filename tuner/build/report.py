"""What a build found, in sentences: the CLI prints them, config.json keeps them."""

from __future__ import annotations

from typing import Any

from tuner.build.base import KERNELS_TAR, BuildRecord


def _speed_line(compiled: float | None, eager: float | None, mode: str) -> str:
    if not compiled or not eager:
        return "no compiled/eager comparison"
    ratio = compiled / eager
    verdict = (
        f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower; the kernels are kept anyway"
    )
    return f"compiled (compile={mode}) {compiled:,.0f} tokens/s vs eager {eager:,.0f} tokens/s: {verdict}"


def _ratio(cold: float, warm: float) -> str:
    if not warm:
        return "instant"
    return f"{cold / warm:.2f}x faster" if cold >= warm else f"{warm / cold:.2f}x slower"


def summary_lines(
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


def cache_misses(warm: dict[str, Any] | None) -> list[int]:
    """Ranks whose warm compile did not take its graphs from the loaded cache."""
    ranks = (warm or {}).get("ranks", [])
    return [
        r["rank"]
        for r in ranks
        if r["counters"].get("fxgraph_cache_miss") or not r["counters"].get("fxgraph_cache_hit")
    ]
