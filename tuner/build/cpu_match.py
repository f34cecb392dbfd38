"""Whether this machine's CPU can run a build's compiled CPU kernels: Inductor builds them with
`-march=native`, and finds a cached one by its source and command line, which name neither the
CPU nor its instruction set. Kernels with AVX-512 instructions built on one CPU would load on
another without them and kill the rank with SIGILL. A build records its CPU's instruction-set
flags; launch.sh unpacks the kernels only where they are the same (`python -m
tuner.build.cpu_match config.json`, exit 0 when they may be used).

Elsewhere Inductor compiles its own kernels on the first run (the portable compile cache still
spares it the graph compile)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cpu_flags() -> list[str]:
    """This machine's CPU instruction-set flags (/proc/cpuinfo's first `flags` line), sorted; [] where
    it does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):  # x86, ARM
                return sorted(set(value.split()))
    except OSError:
        pass
    return []


def kernels_usable(config: dict) -> tuple[bool, str]:
    """(whether the build's compiled kernels may load here, why not)."""
    kernels = (config.get("build") or {}).get("compiled_kernels") or {}
    built = kernels.get("cpu_flags")
    if built is None:
        return True, ""  # no CPU kernels, or a build that did not record its CPU
    here = cpu_flags()
    if sorted(built) == here:
        return True, ""
    missing = sorted(set(built) - set(here))
    said = f"lacks {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}" if missing else "differs"
    return False, (
        f"note: this CPU {said} against the build's, so its compiled CPU kernels are not used "
        "(they could crash here); Inductor compiles its own on the first run"
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config = json.loads(Path(args[0] if args else "config.json").read_text())
    usable, why = kernels_usable(config)
    if not usable:
        print(why, file=sys.stderr)
    return 0 if usable else 1


if __name__ == "__main__":
    sys.exit(main())
