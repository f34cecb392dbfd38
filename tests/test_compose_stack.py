"""The compose services' own commands, started directly on this machine (no Docker engine): a fresh
PostgreSQL database, `migrate`, a Ray head and a Ray worker on loopback, the API and the job
worker tune a recipe end to end, submitted by `tuner nightly --api` as a cron would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from test_compose import ROOT, commands, env_example, load_compose
from test_compose import interpolate as _interpolate

from tuner.executors.nodes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

NIGHTLY = ["tuner", "nightly", "--trials", "2", "--night", "2026-11-28"]

PG_URL = os.environ.get("TUNER_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
RECIPE = {
    "name": "compose-e2e",
    "model": {"family": "gpt", "layers": 1, "hidden": 32, "heads": 2, "seq_len": 32, "vocab": 256},
    "train": {"global_batch_size": 4},
    "hardware": {"device": "cpu", "devices": 1},
    "search": {"trials": 30, "timeout_min": 5},
    "measure": {"warmup_steps": 1, "steps": 2, "timeout_s": 120},
}


@pytest.fixture
def database():
    """A database of its own, dropped afterwards: clean tables, and no clash with other tests."""
    from sqlalchemy import create_engine, text

    name = f"tuner_compose_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as err:  # noqa: BLE001 - any connection failure means no server to test with
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}: {err}")
    yield PG_URL.rsplit("/", 1)[0] + f"/{name}"
    from tuner.db import dispose_engines

    dispose_engines()
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


class Stack:
    """Processes started in sessions of their own, so each is stopped with all its children."""

    def __init__(self, workdir: Path, env: dict[str, str]):
        self.workdir, self.env, self.procs = workdir, env, {}

    def start(self, name: str, argv: list[str]) -> None:
        exe = str(Path(sys.executable).parent / argv[0])
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        self.procs[name] = subprocess.Popen(
            [exe, *argv[1:]], cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        exe = str(Path(sys.executable).parent / argv[0])
        return subprocess.run(
            [exe, *argv[1:]], cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.workdir.glob("*.log")
        )

    def alive(self, name: str) -> None:
        if self.procs[name].poll() is not None:
            pytest.fail(f"{name} exited with {self.procs[name].returncode}\n{self.logs()}")

    def stop(self) -> None:
        # The job worker first (it hands its job back), Ray last.
        for name in reversed(list(self.procs)):
            self._signal(name, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[name].wait(20)
            self._signal(name, signal.SIGKILL)
            self.procs[name].wait()

    def _signal(self, name: str, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, sig)


def loopback(cmds: dict[str, list[str]], ports: dict[str, int]) -> dict[str, list[str]]:
    """Container host names become 127.0.0.1 and fixed ports become free ones; nothing else changes.
    Ray's other fixed ports (client server, dashboard, agents) get free ones too, since other tests
    may run a Ray of their own on this machine."""
    ray = ports["ray"]
    head = [a.replace("--port=6379", f"--port={ray}") for a in cmds["ray-head"]]
    head += [f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}"]
    head += [f"--dashboard-agent-listen-port={free_port()}"]
    node = [a.replace("ray-head:6379", f"127.0.0.1:{ray}") for a in cmds["ray-worker"]]
    node += [f"--dashboard-agent-listen-port={free_port()}"]
    api = [{"0.0.0.0": "127.0.0.1", "8000": str(ports["api"])}.get(a, a) for a in cmds["api"]]
    return {**cmds, "ray-head": head, "ray-worker": node, "api": api}


def service_env(database_url: str, ray_port: int, workdir: Path) -> dict[str, str]:
    """.env.example's settings, then the compose file's own environment with hosts on loopback."""
    values = {**{k: v for k, v in env_example().items() if v}, "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    compose_env = {
        k: _interpolate(str(v), values) for k, v in load_compose()["x-tuner"]["environment"].items()
    }
    assert "@db:5432/" in compose_env["TUNER_DATABASE_URL"] and compose_env["RAY_ADDRESS"] == "ray-head:6379"
    env = {**os.environ, **values, **compose_env}
    env.update(
        TUNER_DATABASE_URL=database_url,
        RAY_ADDRESS=f"127.0.0.1:{ray_port}",
        TUNER_ARTIFACT_DIR=str(workdir / "artifacts"),
        # Test time: trust one run, and leave the kernel build to tests/test_build.py (it compiles
        # for minutes on a busy 2-core machine).
        TUNER_REMEASURE_TOP="0",
        TUNER_BUILD="false",
        TZ="UTC",
        # The image installs this checkout; here the services run from another folder (tmp_path).
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    env.pop("TUNER_TEST_STEP_DELAY_S", None)
    return env


def wait_for(what: str, check, stack: Stack, timeout_s: float, watch: list[str]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in watch:
            stack.alive(name)
        value = check()
        if value:
            return value
        time.sleep(1.0)
    pytest.fail(f"timed out waiting for {what}\n{stack.logs()}")


def test_compose_commands_tune_a_submitted_recipe_end_to_end(database, tmp_path):
    ports = {"ray": free_port(), "api": free_port()}
    env = service_env(database, ports["ray"], tmp_path)
    cmds = loopback(commands(env_example()), ports)
    stack = Stack(tmp_path, env)
    base = f"http://127.0.0.1:{ports['api']}"
    try:
        migrated = stack.run(cmds["migrate"])
        assert migrated.returncode == 0, migrated.stderr
        stack.start("ray-head", cmds["ray-head"])
        stack.start("ray-worker", cmds["ray-worker"])
        stack.start("api", cmds["api"])
        stack.start("worker", cmds["worker"])
        created = stack.run(["tuner", "token", "create", "--name", "compose-e2e"])
        assert created.returncode == 0, created.stderr
        token = created.stdout.split()[0]
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)

        def ready():
            try:
                r = client.get("/readyz")
            except httpx.HTTPError:
                return None
            return r.json() if r.status_code == 200 else None

        readiness = wait_for("the API to be ready (database + Ray)", ready, stack, 120, ["api", "ray-head"])
        assert f"127.0.0.1:{ports['ray']}" in str(readiness)

        # A trial needs a node with CPUs: the head has none, so the Ray worker node must have joined.
        joined = tmp_path / "ray-worker.log"
        wait_for(
            "the Ray worker node",
            lambda: "Ray runtime started" in joined.read_text(),
            stack,
            120,
            ["ray-worker"],
        )

        # The job is submitted the way the nightly cron does it with --api (the compose nightly
        # service drives studies itself; this is the REST client path of `tuner nightly`).
        (tmp_path / "recipes").mkdir()
        (tmp_path / "recipes" / "e2e.yaml").write_text(json.dumps(RECIPE))
        nightly = [*NIGHTLY, str(tmp_path / "recipes"), "--api", base, "--report", str(tmp_path / "reports")]
        stack.env["TUNER_API_TOKEN"] = token
        ran = stack.run(nightly, timeout=400)
        assert ran.returncode == 0, f"{ran.stdout}{ran.stderr}\n{stack.logs()}"
        line = json.loads((tmp_path / "reports" / "nightly-2026-11-28.json").read_text())["recipes"][0]
        assert line["verdict"] == "first_run" and line["fingerprint_hash"]

        job_id = line["job_id"]
        done = client.get(f"/v1/jobs/{job_id}").json()
        trials = client.get(f"/v1/jobs/{job_id}/trials").json()["items"]
        why = [(t["status"], t["result"].get("error")) for t in trials]
        assert done["state"] == "succeeded", f"{done['error']}\ntrials: {why}\n{stack.logs()}"
        assert done["name"] == "compose-e2e@nightly-2026-11-28" and done["trials_done"] == 2
        best = client.get(f"/v1/jobs/{job_id}/best").json()
        assert best["metrics"]["status"] == "ok" and best["tokens_per_s"] > 0
        assert line["best_tokens_per_s"] == pytest.approx(best["tokens_per_s"])
        assert line["config"] == best["config"]

        # A revoked or mistyped token: the recipe fails with the fix in the message, and the run exits 1.
        stack.env["TUNER_API_TOKEN"] = "tnr_not-a-token"
        refused = stack.run([*NIGHTLY[:-1], "2026-11-29", str(tmp_path / "recipes"), "--api", base])
        assert (
            refused.returncode == 1 and "HTTP 403" in refused.stderr and "TUNER_API_TOKEN" in refused.stderr
        )
    finally:
        stack.stop()
