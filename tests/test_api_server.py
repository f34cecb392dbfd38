"""End to end against a real `tuner serve` (uvicorn + a worker subprocess, real trials on CPU):
token, submit, follow SSE, kill the server mid-job and restart (the job resumes, no finished trial
lost), best, build download with checksum, cancel. On SQLite and on PostgreSQL."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_db import fresh_pg_database

from tuner.executors.nodes import free_port

pytestmark = pytest.mark.slow

RECIPE = """\
name: e2e
model: {family: gpt, layers: 2, hidden: 64, heads: 2, seq_len: 32, vocab: 256}
train: {global_batch_size: 4}
hardware: {device: cpu, devices: 1}
search: {trials: %(trials)d, timeout_min: 10, seed: %(seed)d, overrides: {compile: [none]}}
measure: {warmup_steps: 1, steps: %(steps)d, timeout_s: 120}
"""


# Settings that name a place: a server started with none of them keeps everything in its cwd.
PATH_SETTINGS = ("TUNER_DATABASE_URL", "TUNER_ARTIFACT_DIR", "TUNER_RUNS_DIR")


class Server:
    """`tuner serve` in its own process group, so a test can kill it (and its worker) at once.

    With `db_url=None` it runs as a newcomer starts it: from an empty working directory `cwd`,
    with no path settings at all (database ./tuner.db, builds ./builds, trials ./runs)."""

    def __init__(self, workdir: Path, db_url: str | None, workers: int = 1, **env: str):
        self.workdir = workdir  # the test's files: the server log
        self.cwd = workdir / "fresh" if db_url is None else workdir
        self.cwd.mkdir(exist_ok=True)
        self.db_url = db_url or f"sqlite:///{self.cwd / 'tuner.db'}"
        self.workers = workers
        self.env = {k: v for k, v in os.environ.items() if k not in PATH_SETTINGS}
        if db_url is not None:
            self.env |= {"TUNER_DATABASE_URL": db_url, "TUNER_ARTIFACT_DIR": str(workdir / "artifacts")}
        self.env |= {
            "TUNER_REMEASURE_TOP": "0",  # one run per config: this test checks plumbing, not noise
            "TUNER_MAX_TRIALS": "5",
            **env,
        }
        self.proc: subprocess.Popen | None = None
        self.base = ""

    def tuner(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "tuner.cli.main", *args], env=self.env, cwd=self.cwd,
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return out.stdout.strip()

    def start(self) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - the server owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tuner.cli.main", "serve", "--port", str(port), "--workers", str(self.workers)],
            env=self.env, cwd=self.cwd, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log()}"
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server not ready in 90 s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL the server and its worker together, like a crashed machine would."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        path = self.workdir / "server.log"
        return path.read_text(errors="replace")[-6000:] if path.exists() else ""


def follow(server: Server, token: str, job_id: int, until: set[str], last_id: int = 0, timeout: float = 240):
    """Read the job's SSE stream until an event kind in `until` arrives; returns the events."""
    events: list[dict] = []
    headers = {"Authorization": f"Bearer {token}", "Last-Event-ID": str(last_id)}
    deadline = time.monotonic() + timeout
    with httpx.stream(
        "GET", f"{server.base}/v1/jobs/{job_id}/events", headers=headers, timeout=httpx.Timeout(10, read=60)
    ) as resp:
        assert resp.status_code == 200, resp.read()
        current: dict = {}
        for line in resp.iter_lines():
            if line.startswith("id: "):
                current["id"] = int(line[4:])
            elif line.startswith("event: "):
                current["event"] = line[7:]
            elif line.startswith("data: "):
                current["data"] = json.loads(line[6:])
            elif not line and current:
                events.append(current)
                if current["event"] in until:
                    return events
                current = {}
            assert time.monotonic() < deadline, (
                f"no {until} event in {timeout}s; got {events}\n{server.log()}"
            )
    return events


def _submit(server: Server, auth: dict, trials: int, seed: int, steps: int = 2) -> int:
    # Recipes that differ in measure.steps have their own studies; seed alone would share one.
    resp = httpx.post(
        f"{server.base}/v1/jobs", content=RECIPE % {"trials": trials, "seed": seed, "steps": steps},
        headers={**auth, "Content-Type": "application/yaml"}, timeout=30,
    )  # fmt: skip
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def _check_best(server: Server, auth: dict, job_id: int) -> None:
    best = httpx.get(f"{server.base}/v1/jobs/{job_id}/best", headers=auth, timeout=60)
    assert best.status_code == 200, best.text
    assert best.json()["tokens_per_s"] > 0 and best.json()["config"]["compile"] == "none"


def _check_snapshot(server: Server, job_id: int) -> None:
    """The worker snapshotted the finished study: the dashboard's next cold read is one row."""
    from tuner.db import Job, session_scope
    from tuner.record.reader import read_trials as read_rows
    from tuner.record.reader import study_id
    from tuner.record.snapshot import load as load_snapshot

    with session_scope(server.db_url) as s:
        name = s.get(Job, job_id).study_name
        snap = load_snapshot(s, name)
        assert snap is not None, server.log()
        rows, finished, fetched = read_rows(s, study_id(s, name), snap)
    assert fetched == 0 and len(finished.rows) == len(snap.rows) >= 1
    assert any(r.tokens_per_s for r in rows)


def _check_build(server: Server, auth: dict, job_id: int) -> httpx.Response:
    build = httpx.get(f"{server.base}/v1/jobs/{job_id}/build", headers=auth, timeout=60)
    assert build.status_code == 200, f"{build.text}\n{server.log()}"
    assert hashlib.sha256(build.content).hexdigest() == build.headers["X-Checksum-Sha256"]
    assert ".tar.gz" in build.headers["Content-Disposition"]
    return build


@pytest.fixture
def sqlite_server(tmp_path):
    """A newcomer's server: started in an empty directory with no path settings at all."""
    server = Server(tmp_path, None, workers=2)
    yield server
    server.stop()


def test_job_survives_a_killed_server_and_another_is_cancelled(sqlite_server):
    server = sqlite_server
    token = server.tuner("token", "create", "--name", "e2e")
    auth = {"Authorization": f"Bearer {token}"}
    server.start()
    job_id = _submit(server, auth, trials=2, seed=0)
    other = _submit(server, auth, trials=3, seed=1, steps=3)  # the second worker takes it

    # Cancel the other job while its first trial runs: it ends cancelled, short of its budget.
    follow(server, token, other, {"trial_started"})
    asked = time.monotonic()
    resp = httpx.post(f"{server.base}/v1/jobs/{other}/cancel", headers=auth)
    assert resp.status_code == 202 and resp.json()["cancel_requested"]
    done = follow(server, token, other, {"done"})[-1]
    assert done["data"]["state"] == "cancelled" and done["data"]["done"] < 3
    assert time.monotonic() - asked < 30, "cancel took longer than 30 s"
    build = httpx.get(f"{server.base}/v1/jobs/{other}/build", headers=auth)
    assert build.status_code == 404 and "cancelled" in build.json()["detail"]

    first = follow(server, token, job_id, {"trial_finished"})
    finished = first[-1]["data"]
    assert finished["result"]["status"] == "ok", finished
    server.kill()  # mid-job: the next trial is starting or running

    server.start()
    rest = follow(server, token, job_id, {"done"}, last_id=first[-1]["id"], timeout=600)
    kinds = [e["event"] for e in rest]
    assert rest[-1]["data"]["state"] == "succeeded", f"{rest[-1]}\n{server.log()}"
    assert "requeued" in kinds and "build" in kinds
    job = httpx.get(f"{server.base}/v1/jobs/{job_id}", headers=auth).json()
    assert job["attempts"] == 2 and job["trials_done"] == 2 and job["best_tokens_per_s"] > 0
    # The trial finished before the kill is still there, with its measurement: nothing re-ran it.
    trials = httpx.get(f"{server.base}/v1/jobs/{job_id}/trials?status=complete", headers=auth).json()
    assert trials["total"] == 2, trials
    kept = next(t for t in trials["items"] if t["number"] == finished["trial"])
    assert kept["tokens_per_s"] == pytest.approx(finished["result"]["tokens_per_s"])
    _check_best(server, auth, job_id)
    build = _check_build(server, auth, job_id)
    _check_snapshot(server, job_id)
    # Everything the defaults name landed in the server's working directory, and nowhere else.
    archive = server.cwd / "builds" / job["study_name"] / build.headers["Content-Disposition"].split('"')[1]
    assert (
        archive.is_file()
        and hashlib.sha256(archive.read_bytes()).hexdigest() == build.headers["X-Checksum-Sha256"]
    )
    assert (server.cwd / "tuner.db").is_file() and list((server.cwd / "runs").iterdir())


@pytest.mark.postgres
def test_full_flow_on_postgresql(tmp_path):
    url, drop = fresh_pg_database()
    # The build (two torch.compile runs) is exercised on SQLite above; here the service's tables
    # and Optuna's share PostgreSQL, which is what this test is for.
    server = Server(tmp_path, url, TUNER_BUILD="false")
    try:
        token = server.tuner("token", "create", "--name", "pg")
        assert "pg" in server.tuner("token", "list")
        auth = {"Authorization": f"Bearer {token}"}
        server.start()
        job_id = _submit(server, auth, trials=1, seed=2)
        done = follow(server, token, job_id, {"done"})[-1]
        assert done["data"]["state"] == "succeeded", f"{done}\n{server.log()}"
        _check_best(server, auth, job_id)
        _check_snapshot(server, job_id)
        build = httpx.get(f"{server.base}/v1/jobs/{job_id}/build", headers=auth)
        assert build.status_code == 404 and "TUNER_BUILD=false" in build.json()["detail"]
        server.tuner("token", "revoke", "pg")
        assert httpx.get(f"{server.base}/v1/jobs", headers=auth).status_code == 403
    finally:
        server.stop()
        drop()
