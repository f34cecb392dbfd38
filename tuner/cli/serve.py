"""`tuner serve` (the REST API plus its workers, one command) and `tuner worker` (a worker alone,
e.g. one docker-compose service per worker)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import typer

from tuner.cli.common import executor_name_or_exit, fail, writable_dir_or_exit
from tuner.executors.nodes import free_port

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # A worker outliving a killed `tuner serve` would keep running trials nobody watches.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _start_local_ray(env: dict[str, str], timeout_s: float = 120.0) -> subprocess.Popen:
    """A Ray head on loopback shared by this command's workers, in a process group of its own so
    that stopping it stops all of Ray's processes (never `ray stop`: that stops every Ray on the
    machine). Returns once the head accepts connections; sets RAY_ADDRESS for the workers."""
    port = free_port()
    # Ray's token auth, with a token of our own that the head and our workers share.
    env.setdefault("RAY_AUTH_MODE", "token")
    env.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    head = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
         f"--port={port}", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
         "--include-dashboard=false"],
        env=env, start_new_session=True, preexec_fn=_die_with_parent,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            fail(f"--executor ray: the local Ray head exited (code {head.returncode}); see the log above")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
            os.environ["RAY_ADDRESS"] = env["RAY_ADDRESS"]  # /readyz checks the same address
            return head
        time.sleep(0.5)
    _stop_group(head)
    fail(f"--executor ray: the local Ray head did not come up in {timeout_s:.0f} s")


def _stop(procs: list[subprocess.Popen], grace_s: float = 15.0) -> None:
    """SIGTERM, a grace period, then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _stop_group(leader: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Stop a process group we started (the Ray head): its helpers may outlive the leader."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        leader.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()


SERVE_HELP = """Run the REST API, the dashboard (/ui) and its job workers in one command.

The database schema is brought up to date first. Settings come from the environment, read and checked once here and handed to the workers: TUNER_DATABASE_URL (default: ./tuner.db), TUNER_ARTIFACT_DIR (default: ./builds), TUNER_RUNS_DIR (default: ./runs), TUNER_EXECUTOR, RAY_ADDRESS, TUNER_PUBLIC_READS, TUNER_MAX_TRIALS, TUNER_MAX_TIMEOUT_MIN, TUNER_REMEASURE_TOP, TUNER_BUILD. A bad value stops the command with exit code 2, naming the variable.

\b
Examples:
  tuner serve
  tuner serve --host 0.0.0.0 --port 8080 --workers 2
  TUNER_DATABASE_URL=postgresql+psycopg://tuner@db:5432/tuner tuner serve --executor ray
  tuner serve --workers 0          # the API only; run `tuner worker` elsewhere
"""

WORKER_HELP = """Run one job worker: claim queued jobs from the database and tune them.

Reads the same settings as `tuner serve` (TUNER_DATABASE_URL, TUNER_ARTIFACT_DIR, TUNER_RUNS_DIR, TUNER_EXECUTOR, TUNER_MAX_TRIALS, ...), checked once at start; with --executor ray it joins the cluster at $RAY_ADDRESS first and exits 2 when none answers. A job whose cluster stopped answering goes back to the queue, and none is claimed until it answers again. SIGTERM or Ctrl-C hands the running job back to the queue.

\b
Examples:
  tuner worker
  tuner worker --executor ray        # trials on the Ray cluster at $RAY_ADDRESS
  tuner worker --once                # one job, then exit (cron, tests)
"""


def _settings_or_exit(**changes: object):
    from tuner.settings import Settings, SettingsError

    try:
        settings = Settings.from_env().with_paths(**{k: v for k, v in changes.items() if v is not None})
    except SettingsError as err:
        fail(str(err))
    # The folders jobs write, before the first job: a runs folder that cannot be made failed
    # every job's trials, each stored as its config's error.
    writable_dir_or_exit(settings.runs_dir, "TUNER_RUNS_DIR (default ./runs: the trials' logs)")
    writable_dir_or_exit(settings.artifact_dir, "TUNER_ARTIFACT_DIR (default ./builds)")
    return settings


def _bound_socket_or_exit(host: str, port: int) -> socket.socket:
    """The API's listening address, bound before any worker or Ray head starts: a port in use (or
    a host that is not this machine's) was uvicorn's own log line and exit code 3, after workers
    had started claiming jobs. Uvicorn serves on this socket, so nothing can take it meanwhile."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            fail(
                f"--port {port}: {host}:{port} is already in use; stop what listens there or pick another --port"
            )
        fail(
            f"--host {host}: cannot listen there ({err.strerror or err}); give an address of this machine, e.g. --host 0.0.0.0"
        )
    return sock


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 for all)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535),
    workers: int = typer.Option(1, "--workers", min=0, max=64, help="Job workers to start (0: API only)."),
    executor: str = typer.Option(
        None, "--executor", help="local or ray (default: $TUNER_EXECUTOR or local)."
    ),
) -> None:
    import uvicorn

    from api import create_app
    from tuner.db import DatabaseError
    from tuner.migrations import prepare_database

    executor_name_or_exit(executor)
    settings = _settings_or_exit(executor=executor)
    sock = _bound_socket_or_exit(host, port)
    try:
        prepare_database(settings.database_url)  # once here, so the workers do not race to create tables
    except DatabaseError as err:
        fail(str(err))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    env = dict(os.environ)
    head = None
    if settings.executor == "ray" and workers and not settings.ray_address:
        head = _start_local_ray(env)
        settings = settings.with_paths(ray_address=env["RAY_ADDRESS"])  # for /readyz
    env.update(settings.environ())  # the workers get exactly the settings checked here
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "tuner.cli.main", "worker"], env=env, preexec_fn=_die_with_parent
        )
        for _ in range(workers)
    ]
    try:
        server = uvicorn.Server(uvicorn.Config(create_app(settings), host=host, port=port, log_level="info"))
        # Given its socket, uvicorn does not say where it listens: say it as it would.
        shown = f"[{host}]" if ":" in host else host
        logging.getLogger("uvicorn.error").info(
            f"Uvicorn running on http://{shown}:{port} (Press CTRL+C to quit)"
        )
        server.run(sockets=[sock])
    finally:
        # Workers first (they hand their jobs back to the queue), then the Ray head they use.
        _stop(children)
        if head is not None:
            _stop_group(head)


def worker(
    executor: str = typer.Option(
        None, "--executor", help="local or ray (default: $TUNER_EXECUTOR or local)."
    ),
    poll_s: float = typer.Option(
        1.0, "--poll-s", min=0.05, max=3600, help="Seconds between looks at the queue."
    ),
    once: bool = typer.Option(False, "--once", help="Run at most one job, then exit."),
) -> None:
    from tuner.db import DatabaseError
    from tuner.migrations import prepare_database
    from tuner.worker import Worker, WorkerSettings

    executor_name_or_exit(executor)
    settings = WorkerSettings.from_settings(_settings_or_exit(executor=executor), poll_s=poll_s)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        prepare_database(settings.database_url)
    except DatabaseError as err:
        fail(str(err))
    w = Worker(settings)
    try:  # at start, as the settings are: a cluster that does not answer would fail each job
        w.start_executor()
    except (ImportError, RuntimeError, ValueError, ConnectionError) as err:
        fail(f"--executor {settings.executor}: cannot start it: {err}")

    def _shutdown(signum: int, _frame: object) -> None:
        # No lock in here (see StopFlag): not logging's, whose stream may be mid-write in the
        # thread this handler interrupted, so the notice is one write(2) of its own.
        w.shutdown.set()
        with contextlib.suppress(OSError):  # stderr gone (a pipe whose reader Ctrl-C ended too)
            os.write(
                2, f"worker {w.worker_id}: signal {signum}: finishing up, handing the job back\n".encode()
            )

    signal.signal(signal.SIGTERM, _shutdown)
    signal.signal(signal.SIGINT, _shutdown)
    try:
        w.recover()
        if once:
            w.run_once()
        else:
            w.run_forever()
    finally:
        w.close()


def register(app: typer.Typer) -> None:
    app.command("serve", help=SERVE_HELP)(serve)
    app.command("worker", help=WORKER_HELP)(worker)
