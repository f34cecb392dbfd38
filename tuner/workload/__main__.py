"""`python -m tuner.workload SPEC.json`: run one rank of a trial (started once per rank by an
executor, with torchrun-style RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

USAGE = "usage: python -m tuner.workload SPEC.json   (SPEC.json = tuner.result.TrialSpec.to_dict())"


def _load_spec(path: str):
    from tuner.result import TrialSpec

    try:
        data = json.loads(Path(path).read_text())
        return TrialSpec.from_dict(data)
    except OSError as err:
        sys.exit(f"error: cannot read trial spec {path}: {err.strerror}\n{USAGE}")
    except (ValueError, TypeError) as err:
        sys.exit(f"error: {path} is not a TrialSpec JSON document ({err})\n{USAGE}")


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        sys.exit(USAGE)
    # A rank that dies of a signal (SIGSEGV in a native library) prints every thread's Python
    # stack to its log first, so the trial's error names where it crashed.
    faulthandler.enable(file=sys.stderr)
    spec = _load_spec(argv[0])
    from tuner.workload.run import main as run_main

    code = run_main(spec)
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything the trial reports is written by now. On failure, peers may be blocked in a
    # collective with us, so do not wait for teardown. On success, skip the interpreter's
    # shutdown too: finalising torch's modules and their thread pools took ~3.5 s per rank
    # (measured on the tiny recipe), pure overhead on every trial.
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
