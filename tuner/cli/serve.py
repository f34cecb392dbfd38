"""`tuner serve` (the REST API plus its workers, one command) and `tuner worker` (a worker alone,
e.g. one docker-compose service per worker)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys

import typer

from tuner.cli.common import fail

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # A worker outliving a killed `tuner serve` would keep running trials nobody watches.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_local_ray(env: dict[str, str]) -> subprocess.Popen:
    """A Ray head for this machine, owned by this process (stopped with it, never `ray stop`,
    which would stop every Ray on the machine)."""
    port = _free_port()
    head = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--disable-usage-stats",
            "--include-dashboard=false",
        ],
        env=env,
        preexec_fn=_die_with_parent,
    )
    env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    return head


def _stop(procs: list[subprocess.Popen], grace_s: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 for all)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535),
    workers: int = typer.Option(1, "--workers", min=0, max=64, help="Job workers to start (0: API only)."),
    executor: str = typer.Option(None, "--executor", envvar="TUNER_EXECUTOR", help="local or ray."),
) -> None:
    """Run the REST API and its job workers. The database schema is brought up to date first."""
    import uvicorn

    from api import create_app
    from api.settings import Settings, SettingsError
    from tuner.db import DatabaseError
    from tuner.migrations import prepare_database

    executor = executor or "local"
    if executor not in ("local", "ray"):
        fail(f"--executor {executor!r}: use local or ray")
    os.environ["TUNER_EXECUTOR"] = executor
    try:
        settings = Settings.from_env()
        prepare_database(settings.database_url)  # once here, so the workers do not race to create tables
    except (SettingsError, DatabaseError) as err:
        fail(str(err))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    env = dict(os.environ)
    children: list[subprocess.Popen] = []
    if executor == "ray" and workers and not env.get("RAY_ADDRESS"):
        children.append(_start_local_ray(env))
    for _ in range(workers):
        children.append(
            subprocess.Popen(
                [sys.executable, "-m", "tuner.cli.main", "worker"], env=env, preexec_fn=_die_with_parent
            )
        )
    try:
        uvicorn.run(create_app(settings), host=host, port=port, log_level="info")
    finally:
        # Workers first: they hand their jobs back to the queue; then the Ray head.
        _stop(children[::-1])


def worker(
    executor: str = typer.Option(None, "--executor", envvar="TUNER_EXECUTOR", help="local or ray."),
    poll_s: float = typer.Option(1.0, "--poll-s", min=0.05, help="Seconds between looks at the queue."),
    once: bool = typer.Option(False, "--once", help="Run at most one job, then exit."),
) -> None:
    """Run a job worker: claim queued jobs and tune them (TUNER_DATABASE_URL, TUNER_ARTIFACT_DIR)."""
    from tuner.db import DatabaseError
    from tuner.migrations import prepare_database
    from tuner.worker import Worker, WorkerSettings

    if executor not in (None, "local", "ray"):
        fail(f"--executor {executor!r}: use local or ray")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = WorkerSettings.from_env(executor=executor, poll_s=poll_s)
    try:
        prepare_database(settings.database_url)
    except DatabaseError as err:
        fail(str(err))
    w = Worker(settings)

    def _shutdown(signum: int, _frame: object) -> None:
        logging.getLogger("tuner.worker").info("signal %s: finishing up, handing the job back", signum)
        w.shutdown.set()

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
    app.command("serve")(serve)
    app.command("worker")(worker)
