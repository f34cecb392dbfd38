"""The helper side of the warm start (`tuner.executors.warm`): import the trial code once, then fork
a launcher per request, each the leader of a new session, reap them and report their exit
status. Single-threaded, so forking is safe; nothing here initialises a device or a thread pool."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import sys
import traceback
from collections.abc import Callable

from tuner.executors.session import kill_session


class Refused(Exception):
    """The helper will not fork this request; its message goes back to the client."""


def device_runtime() -> str | None:
    """The device runtime this process has touched so that a process forked from it cannot use the
    device ("CUDA", "NPU"), or None. torch refuses CUDA in such a child ("Cannot re-initialize
    CUDA in forked subprocess") once the parent initialised CUDA or only counted the devices: a
    CUDA build's `cpu_vec_isa.valid_vec_isa_list()` does the latter (seen on an H200 machine,
    where every rank forked after it failed), without `torch.cuda.is_initialized()` turning
    true; so a throwaway child is asked whether it is in that state."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if torch.cuda.is_initialized():
        return "CUDA"
    npu = getattr(torch, "npu", None)  # torch_npu registers it
    if npu is not None and getattr(npu, "is_initialized", lambda: False)():
        return "NPU"
    in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", None)  # absent from CPU-only builds
    if in_bad_fork is None:
        return None
    pid = os.fork()
    if pid == 0:
        os._exit(1 if in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return "CUDA" if os.waitstatus_to_exitcode(status) == 1 else None


def serve(
    path: str,
    preload: tuple[str, ...],
    prepare_compile: Callable[[], None] = lambda: None,
    initialised: Callable[[], str | None] = device_runtime,
    own_dir: bool = False,
) -> None:
    """Serve fork requests on the Unix socket `path` after importing `preload`; the first request
    for a trial that compiles runs `prepare_compile` first (once). Once `initialised()` names a
    device runtime (after the preload, or after the preparation), every request is answered with
    an error naming it, and its trial starts cold. When the process that started it is gone, it
    removes its socket (`own_dir`: and the directory it was made for), since a parent killed with
    SIGTERM or SIGKILL never gets to."""
    for name in preload:
        importlib.import_module(name)
    prepared = False
    runtime = initialised()

    def before_fork(request: dict) -> None:
        nonlocal prepared, runtime
        if request.get("compiles") and not prepared:
            prepared = True
            prepare_compile()
            runtime = initialised()
        if runtime is not None:
            raise Refused(
                f"the warm-start helper has initialised {runtime}, which a forked process cannot "
                "use; the trial starts cold"
            )

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    bound = os.stat(path).st_ino  # a later helper may bind this path again: only ours is removed
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    children: dict[int, socket.socket] = {}
    with contextlib.suppress(BrokenPipeError):  # the parent died while we started: stdin says so next
        os.write(1, b"ready\n")
    while True:
        for key, _ in sel.select(timeout=0.05):
            if key.data == "parent" and not os.read(key.fd, 4096):
                # The process that started us is gone.
                _shutdown(children, path if _same_file(path, bound) else None, own_dir)
            elif key.data == "accept":
                _accept(listener, sel, children, before_fork)
            elif isinstance(key.data, int):
                _client_gone(key.data, sel, children)
        _reap(children, sel)


def _client_gone(pid: int, sel: selectors.BaseSelector, children: dict[int, socket.socket]) -> None:
    """The connection of launcher `pid`'s client became readable. A client sends nothing after its
    request, so it has closed: it died (a killed Ray worker) and nobody supervises the trial any
    more, which must not go on holding the cores or the devices. Its session is killed; the
    launcher is reaped like any other."""
    conn = children.get(pid)
    if conn is None:
        return
    sel.unregister(conn)
    with contextlib.suppress(OSError):
        if conn.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK):
            return  # a stray byte, not an end: keep the trial (and stop watching this client)
    kill_session(pid)


def _accept(
    listener: socket.socket,
    sel: selectors.BaseSelector,
    children: dict[int, socket.socket],
    before_fork: Callable[[dict], None],
) -> None:
    conn, _ = listener.accept()
    try:
        conn.settimeout(10)
        data = b""
        while b"\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                raise OSError("the client closed the connection")
            data += chunk
        request = json.loads(data.split(b"\n", 1)[0])
        try:
            before_fork(request)
        except Refused as err:
            conn.sendall(json.dumps({"error": str(err)}).encode() + b"\n")
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            # The child keeps none of the helper's sockets.
            sel.close()
            for other in (listener, conn, *children.values()):
                other.close()
            _run_launcher(request)  # never returns
        children[pid] = conn
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            # The client stopped waiting (it starts the trial cold): nobody would watch this one.
            kill_session(pid)
            raise
        sel.register(conn, selectors.EVENT_READ, pid)
    except (OSError, ValueError) as err:
        print(f"warm helper: bad request: {err}", file=sys.stderr, flush=True)
        conn.close()


def _reap(children: dict[int, socket.socket], sel: selectors.BaseSelector | None = None) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            if sel is not None:
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(conn)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            conn.close()


def _same_file(path: str, inode: int) -> bool:
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def _shutdown(children: dict[int, socket.socket], path: str | None, own_dir: bool) -> None:
    """The process that started the helper is gone: end every trial, remove the socket (`path`,
    None when another helper has bound it since) or the helper's own directory, and exit."""
    for pid in list(children):
        kill_session(pid)
    _reap(children)
    with contextlib.suppress(OSError):
        if path is not None and own_dir:
            shutil.rmtree(os.path.dirname(path))
        elif path is not None:
            os.unlink(path)
    os._exit(0)


def _run_launcher(request: dict) -> None:
    """In the forked child: become a new session, take the trial's environment and directory,
    and run the launcher, which forks the ranks from here."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(err, 2)
        os.close(err)
        os.close(devnull)
        os.chdir(request["cwd"])
        adopt_environment(request["env"])
        from tuner.executors import launcher

        code = launcher.main(list(request["argv"]), fork=True)
    except BaseException:  # noqa: BLE001 - the launcher's own failure goes to launcher.log
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def adopt_environment(env: dict[str, str]) -> None:
    """Make `env` this process's environment, and its PYTHONPATH the first places imports look
    (a forked process never re-reads them at start as a new interpreter would)."""
    os.environ.clear()
    os.environ.update(env)
    front = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = front + [p for p in sys.path if p not in front]
    importlib.invalidate_caches()
