"""A trial rank forked from a warm launcher (`tuner.executors.warm`): the child takes torchrun's
variables, sends its output into a pipe like a cold rank's, dies with its launcher, and runs
`python -m MODULE SPEC.json` in place; the parent sees it through a `Popen`-like handle."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import runpy
import signal
import sys
import traceback

from tuner.executors.session import die_with_parent


class ForkedRank:
    """What the launcher's `RankGroup` uses of a `subprocess.Popen`: pid, stdout, poll, terminate, kill."""

    def __init__(self, pid: int, stdout: io.RawIOBase):
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for signal N, as Popen
        return self.returncode

    def _signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


def fork_rank(module: str, spec_path: str, env: dict[str, str]) -> ForkedRank:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            code = _run_rank(module, spec_path, env, write)
        finally:
            os._exit(code)
    os.close(write)
    return ForkedRank(pid, os.fdopen(read, "rb", buffering=0))


def _run_rank(module: str, spec_path: str, env: dict[str, str], out_fd: int) -> int:
    """In the child: what a new `python -m MODULE SPEC.json` with PYTHONUNBUFFERED and
    PYTHONFAULTHANDLER would do, in this already warm interpreter."""
    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        return 1
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(devnull)
    os.close(out_fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.update(env)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    faulthandler.enable(file=sys.stderr)
    sys.argv = [module, spec_path]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback, exit 1
        traceback.print_exc()
        return 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
