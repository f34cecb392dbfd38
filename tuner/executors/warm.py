"""The warm start: a long-lived helper process per node (one per executor process: the study's
local executor, each Ray worker) that has imported torch and the trial code and initialised
nothing else (no device context, no thread pool, no process group). A trial's launcher is forked
from it on request and becomes the leader of a new session; it forks the trial's ranks in turn.
So every trial still runs in fresh processes of its own session, and is supervised, classified
and killed exactly like a cold one (`tuner.executors.launcher`, `tuner.executors.session`); it
only skips the interpreter start and the imports (about 2 CPU-s per rank).

The helper ends when its parent process ends (its stdin closes), killing the sessions it
started; it also kills a trial's session when the client that asked for it disconnects before the
trial ended (the Ray worker running the trial was killed). A helper that died is started again on
the next trial; a trial that cannot reach a helper runs cold, and so does a build's rank
(`run_trial(module=...)`), which times the compiler from a fresh interpreter, imports included.
`TUNER_WARM_START=0` (in the environment or in the executor's `env`) turns the helper off.

On Ray the helper belongs to the node, not to a worker: the executor starts one `WarmHost` actor
per node when it starts (`tuner.executors.ray_warm`), whose helper listens at a path both sides
derive from a name (`node_socket_path`), and every trial task on that node, whichever worker runs
it, forks its launcher from there (`NodeHelper`). So no trial waits for torch's import, not even
the study's first.

    python -m tuner.executors.warm SOCKET   (started by `shared_helper`, not by hand)
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# What the helper imports before it forks anything: the point of keeping it. torch._dynamo too:
# the optimizer's constructor imports it (with Inductor's config), about 1 CPU-s per rank.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "tuner.workload.run")


# A C++ kernel that does nothing: loading it makes Inductor check its precompiled header.
_PROBE_KERNEL = 'extern "C" void kernel(float* out_ptr0) { out_ptr0[0] = 0.0f; }'


def prepare_compile() -> None:
    """What every compiled trial's ranks would repeat, done once in the helper when the first trial
    that compiles asks, so the ranks forked from then on inherit it: importing Inductor's compiler
    (about 1 CPU-s per rank) and Inductor's probe of the CPU's vector instructions, which loads
    test programs in child interpreters (about 1.2 s per rank on the test machine), each cached
    for the life of the process. Even with every kernel in the cache, a process's first compiled
    graph also hashes torch's sources for the cache keys (`torch_key`, about 0.15 s) and, before
    loading its first C++ kernel, preprocesses the precompiled header's includes with g++ to see
    whether the header is current (about 0.2 s; per process, per compiler command); loading a
    no-op kernel here does that once (a cached compiled trial 0.2-0.8 s shorter on a 2-core
    Zen 2, BENCHMARKS section 8). Not at the helper's start: a study that never
    compiles would wait for it before its first trial. It starts no thread (the kernel is loaded,
    never run); a torch without these only loses the saving. For CPU trials only: on a CUDA build
    of torch the vector-instruction probe counts the GPUs, after which no forked process can use
    CUDA (`warm_server.device_runtime`)."""
    with contextlib.suppress(Exception):
        import torch._inductor.compile_fx  # noqa: F401
        from torch._inductor import cpu_vec_isa
        from torch._inductor.codecache import CppPythonBindingsCodeCache, torch_key

        cpu_vec_isa.valid_vec_isa_list()
        torch_key()
        CppPythonBindingsCodeCache.load_pybinding(["float*"], _PROBE_KERNEL)
    _first_frame_imports()


# Modules a process's first compiled frame imports besides what `_first_frame_imports` calls
# (module names of torch 2.13; one that is gone is skipped).
FIRST_FRAME_MODULES = (
    "torch._dynamo.dce_extra_outputs",
    "torch._functorch._aot_autograd.subclass_codegen",
    "torch._higher_order_ops.passes.inline_invoke_subgraph",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.hooks",
    "torch._subclasses.schema_check_mode",
    "torch.distributed.tensor.experimental",
    "torch.export._trace",
    "torch.fx.experimental.validator",
)


def _first_frame_imports() -> None:
    """What Dynamo and Inductor import, register and discover the first time a process compiles
    a frame, even when every graph is in the cache: Dynamo's backend registry (its modules and
    the installed packages' entry points), Inductor's code generators for every device, the
    context managers Dynamo refuses to trace (pytest's, where it is installed), and about 130
    modules in all. Done once here, it spares each rank of a cached compiled trial about 0.1-0.3 s
    of its first step (the test machine's gpt-tiny first step: 0.38-0.55 s with it, 0.51-0.70 s
    without; a steady step 0.13 s). Pure imports and registrations: no thread, no device."""
    for name in FIRST_FRAME_MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    with contextlib.suppress(Exception):
        from torch._dynamo.backends.registry import _lazy_import
        from torch._dynamo.variables.user_defined import is_forbidden_context_manager
        from torch._inductor.codegen.common import init_backend_registration

        _lazy_import()
        init_backend_registration()
        is_forbidden_context_manager(contextlib.nullcontext)


READY_TIMEOUT_S = 120.0  # torch's import on a badly loaded machine
WARM_ENV = "TUNER_WARM_START"


def enabled(env: dict[str, str] | None = None) -> bool:
    """Whether trials start warm: TUNER_WARM_START in `env`, else in this process's environment."""
    value = (env or {}).get(WARM_ENV, os.environ.get(WARM_ENV, "1"))
    return value.strip().lower() not in ("0", "false", "no", "off")


class Unavailable(RuntimeError):
    """No helper answers; the caller starts the trial cold."""


class WarmProcess:
    """A launcher forked by the helper, seen like a `subprocess.Popen` (pid, poll, wait, kill) so
    the supervisor and `kill_session` treat it like a cold launcher. The helper reaps it and
    sends its exit status over the connection."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._buf = b""
        self._lost = False  # the helper died first: watch /proc instead

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.1 if end is None else min(0.1, end - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"warm launcher {self.pid}", timeout)
            self._read(left)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def _read(self, timeout: float) -> None:
        if self._lost:
            if not _alive(self.pid):
                self.returncode = 1  # its exit status went with the helper
            else:
                time.sleep(timeout)
            return
        self._conn.settimeout(timeout if timeout > 0 else 0.0)
        try:
            chunk = self._conn.recv(4096)
        except (BlockingIOError, TimeoutError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._lost = True
            self._conn.close()
            return
        self._buf += chunk
        if b"\n" in self._buf:
            self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["returncode"])
            self._conn.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class WarmHelper:
    """The client side: starts the helper process and asks it to fork launchers."""

    def __init__(self, env: dict[str, str], socket_path: str | None = None):
        """`socket_path`: where the helper listens (a node's helper, `node_socket_path`); by default
        a fresh directory of this helper's own."""
        self._own_dir = socket_path is None
        if socket_path is None:
            socket_path = os.path.join(tempfile.mkdtemp(prefix="tuner-warm-"), "helper.sock")
        else:
            os.makedirs(os.path.dirname(socket_path), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path)  # a helper that died before: bind would refuse the path
        self._dir = os.path.dirname(socket_path)
        self.socket_path = socket_path
        self._log_path = socket_path.removesuffix(".sock") + ".log"
        self._log = open(self._log_path, "wb")  # noqa: SIM115 - the helper's lifetime
        # stdin is how the helper notices this process ending; stdout says when it is ready. It
        # starts in its own directory: `-m` puts the working directory first on the import path,
        # so from one that holds another `tuner` (a second checkout) it would import that one,
        # not the caller's (`env`'s PYTHONPATH); each trial's launcher runs in the trial's directory.
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tuner.executors.warm",
                self.socket_path,
                *(["--own-dir"] * self._own_dir),
            ],
            cwd=self._dir,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self._ready = False
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        with self._lock:
            if self._ready:
                return
            sel = selectors.DefaultSelector()
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = b""
            end = time.monotonic() + timeout
            while b"\n" not in line and time.monotonic() < end:
                if sel.select(timeout=0.5):
                    chunk = os.read(self.proc.stdout.fileno(), 256)
                    if not chunk:
                        break
                    line += chunk
            sel.close()
            if not line.startswith(b"ready"):
                raise Unavailable(f"the warm-start helper did not start: {self.log_tail()}")
            self._ready = True

    def launch(
        self, argv: list[str], env: dict[str, str], cwd: str, stderr_path: str, compiles: bool = False
    ) -> WarmProcess:
        """Fork `python -m tuner.executors.launcher ARGV` from the helper, as the leader of a new
        session. `compiles`: the trial compiles, so the helper first runs `prepare_compile` if no
        earlier trial made it (seconds, hence the longer wait for its answer)."""
        self.wait_ready()
        request = {"argv": argv, "env": env, "cwd": cwd, "stderr": stderr_path, "compiles": compiles}
        return _fork(self.socket_path, request, connect_s=0.0)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return Path(self._log_path).read_text(errors="replace")[-1000:].strip() or "no output"
        return "no output"

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()  # the helper ends its sessions and exits
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        else:
            for path in (self.socket_path, self._log_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


class NodeHelper:
    """The client of a helper that another process of this node keeps (a Ray node's `WarmHost`):
    it forks launchers like `WarmHelper.launch`. Its helper is ready once its socket accepts; a
    trial waits up to READY_TIMEOUT_S for that (the helper is importing torch, or its host is
    starting it again after it died), then runs cold, and this process's later trials use a
    helper of its own (`helper_for`) instead of waiting for that one again."""

    def __init__(self, socket_path: str):
        self.socket_path = socket_path

    def launch(
        self, argv: list[str], env: dict[str, str], cwd: str, stderr_path: str, compiles: bool = False
    ) -> WarmProcess:
        request = {"argv": argv, "env": env, "cwd": cwd, "stderr": stderr_path, "compiles": compiles}
        try:
            return _fork(self.socket_path, request, connect_s=READY_TIMEOUT_S)
        except Unavailable:
            _unreachable.add(self.socket_path)
            raise


_unreachable: set[str] = set()  # node helpers that did not answer within READY_TIMEOUT_S


def helper_for(env: dict[str, str], socket_path: str | None = None) -> WarmHelper | NodeHelper:
    """The helper a trial forks from: the node's at `socket_path` unless it failed to answer
    before, else this process's own."""
    if socket_path and socket_path not in _unreachable:
        return NodeHelper(socket_path)
    return shared_helper(env)


def node_socket_path(name: str) -> str:
    """Where the helper named `name` of this node listens: the same path for its host and for every
    trial task on the node, from the node's own temporary directory."""
    return os.path.join(tempfile.gettempdir(), f"tuner-warm-{os.getuid()}", f"{name}.sock")


def _fork(path: str, request: dict, connect_s: float) -> WarmProcess:
    """Ask the helper at `path` to fork a launcher; its pid comes back at once. `connect_s`: how long
    to keep trying while no helper answers there (it is importing torch, or its host is starting it
    again after it died: a connection queued when it died is reset)."""
    end = time.monotonic() + connect_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(30)
            conn.connect(path)
            # Preparing Inductor for the first compiled trial takes seconds before the helper answers.
            conn.settimeout(READY_TIMEOUT_S if request.get("compiles") else 30)
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = b""
            while b"\n" not in reply:
                chunk = conn.recv(4096)
                if not chunk:
                    raise ConnectionResetError("the helper closed the connection")
                reply += chunk
            answer = json.loads(reply.split(b"\n", 1)[0])
            if "error" in answer:
                conn.close()
                raise Unavailable(answer["error"])
            pid = int(answer["pid"])
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError) as err:
            conn.close()
            if time.monotonic() >= end:
                raise Unavailable(f"the warm-start helper did not answer at {path}: {err}") from None
            time.sleep(0.05)
            continue
        except (OSError, ValueError, KeyError) as err:
            conn.close()
            raise Unavailable(f"the warm-start helper did not answer: {err}") from None
        proc = WarmProcess(pid, conn)
        proc._buf = reply.split(b"\n", 1)[1]
        return proc


_shared: WarmHelper | None = None
_shared_lock = threading.Lock()


def shared_helper(env: dict[str, str]) -> WarmHelper:
    """This process's helper, started (with `env`) if there is none or the last one died."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive():
            if _shared is not None:
                _shared.close()
            _shared = WarmHelper(env)
        return _shared


@atexit.register
def _close_shared() -> None:
    if _shared is not None:
        _shared.close()


if __name__ == "__main__":
    from tuner.executors.warm_server import serve

    serve(sys.argv[1], PRELOAD, prepare_compile, own_dir="--own-dir" in sys.argv[2:])
