"""The Ray cluster address as the driver, the worker and `/readyz` check it: a GCS tells itself from
any other service within seconds, IPv6 addresses parse, a Ray Client address is refused up front,
and a worker whose cluster does not answer claims no job and fails none."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest_ray import start_ray_runtime
from test_worker import _events, _Executor, _queue, sqlite_url  # noqa: F401 - a fixture

from tuner.db import Job, session_scope
from tuner.executors.nodes import free_port
from tuner.executors.ray_address import check_cluster, split_address
from tuner.worker import JobRun, Worker, WorkerSettings, claim_job


@pytest.fixture
def http_port():
    """An HTTP server (what the dashboard's 8265 is): it accepts TCP, but it is no GCS."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_addresses_parse_with_ipv6_in_brackets_and_the_gcs_port_by_default():
    assert split_address("[::1]:48351") == ("::1", 48351)
    assert split_address("[fd00::2]") == ("fd00::2", 6379)
    assert split_address("fd00::2") == ("fd00::2", 6379)
    assert split_address("head") == ("head", 6379)
    assert split_address("10.0.0.1:6380") == ("10.0.0.1", 6380)
    assert split_address("auto") is None and split_address("ray://head:10001") is None


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_address_nothing_answers_at_is_refused_not_unresolved():
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    with pytest.raises(ConnectionError, match=r"no Ray cluster answers there \(Connection refused\)"):
        check_cluster(f"[::1]:{port}", "RAY_ADDRESS")


def test_a_port_that_is_not_the_gcs_is_told_apart_within_seconds(http_port):
    start = time.monotonic()
    with pytest.raises(
        ConnectionError, match=r"no Ray cluster answers there .*is this the GCS port \(6379\)\?"
    ):
        check_cluster(f"127.0.0.1:{http_port}", "RAY_ADDRESS")
    assert time.monotonic() - start < 6


def test_a_ray_client_address_is_refused_with_the_address_to_use():
    from tuner.executors.ray_executor import RayExecutor

    with pytest.raises(
        ConnectionError, match=r"driver must run on a cluster node; use the GCS address host:6379"
    ):
        RayExecutor(address="ray://127.0.0.1:10001")


@pytest.fixture(scope="module")
def gcs_address():
    ray = start_ray_runtime()
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.mark.slow
def test_a_real_gcs_passes_and_readyz_checks_it_as_the_executor_does(gcs_address, tmp_path, http_port):
    from fastapi.testclient import TestClient

    from api import Settings, create_app

    check_cluster(gcs_address, "RAY_ADDRESS")  # a GCS of token auth answers without the token

    def ready(address: str):
        settings = Settings(
            database_url=f"sqlite:///{tmp_path / 'api.db'}", executor="ray", ray_address=address
        )
        with TestClient(create_app(settings)) as client:
            resp = client.get("/readyz")
        return resp.status_code, resp.json()["checks"]["executor"]["detail"]

    assert ready(gcs_address)[0] == 200
    status, detail = ready(f"ray://{gcs_address.rsplit(':', 1)[0]}")  # no port: was taken for 10001
    assert status == 503 and "use the GCS address host:6379" in detail
    status, detail = ready(f"127.0.0.1:{http_port}")
    assert status == 503 and "is this the GCS port (6379)?" in detail


@pytest.mark.slow
def test_a_real_gcs_passes_where_the_environment_names_an_http_proxy(gcs_address, monkeypatch):
    """Ray's own gRPC channels ignore http_proxy (RAY_grpc_enable_http_proxy is off by default), so
    ray.init joins the cluster; the probe went through the proxy and refused a live GCS as "not the
    GCS port", so `tuner tune --executor ray` failed and `tuner worker` exited 2 on such a host."""
    proxy = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for name in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, proxy)
    for name in ("no_proxy", "NO_PROXY", "no_grpc_proxy", "RAY_grpc_enable_http_proxy"):
        monkeypatch.delenv(name, raising=False)

    check_cluster(gcs_address, "RAY_ADDRESS")


_JOIN = """
from tuner.executors.ray_address import check_cluster
from tuner.executors.ray_executor import RayExecutor
check_cluster({address!r}, "RAY_ADDRESS")  # what /readyz asks, in a process that joins nothing: it answers
try:
    RayExecutor(address={address!r})
except ConnectionError as err:  # what every command reports as a message (exit 2)
    print("refused:", err)
    raise SystemExit(2)
"""


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["without token auth", "without a token", "with another token"])
def test_a_driver_the_cluster_would_refuse_for_its_token_is_told_so_at_once(gcs_address, tmp_path, driver):
    """This module's runtime asks for Ray's token. A driver with token auth on and no token got
    Ray's AuthenticationError, which no command catches (a traceback); one without token auth, or
    with another cluster's token, waited ~20 s for "Failed to connect to Ray cluster"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token
    if driver != "without token auth":
        env["RAY_AUTH_MODE"] = "token"
    if driver == "with another token":
        env["RAY_AUTH_TOKEN"] = "0123456789abcdef" * 2
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", _JOIN.format(address=gcs_address)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    said = out.stdout + out.stderr[-2000:]
    assert out.returncode == 2 and "would refuse this process: the cluster " in out.stdout, said
    assert "RAY_AUTH_TOKEN to the cluster's token" in out.stdout and "Traceback" not in said
    assert time.monotonic() - start < 15


def test_a_worker_whose_cluster_does_not_answer_exits_2_and_leaves_the_queue_alone(sqlite_url, tmp_path):  # noqa: F811
    jobs = _queue(sqlite_url, 3)
    env = {
        **os.environ,
        "TUNER_DATABASE_URL": sqlite_url,
        "TUNER_RUNS_DIR": str(tmp_path / "runs"),
        "TUNER_ARTIFACT_DIR": str(tmp_path / "builds"),
        "RAY_ADDRESS": f"127.0.0.1:{free_port()}",
    }
    cmd = [sys.executable, "-m", "tuner.cli.main", "worker", "--executor", "ray", "--poll-s", "0.1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    assert done.returncode == 2, done.stderr
    assert "no Ray cluster answers there" in done.stderr and "Traceback" not in done.stderr
    with session_scope(sqlite_url) as s:
        assert [(s.get(Job, j).state, s.get(Job, j).attempts) for j in jobs] == [("queued", 0)] * 3


class _FailingStudy(Exception):
    pass


def test_a_job_whose_cluster_went_away_goes_back_to_the_queue_and_none_is_claimed_meanwhile(
    sqlite_url,  # noqa: F811
    monkeypatch,
):
    def run_study(*_a, **_kw):
        raise _FailingStudy("the Ray cluster went away mid-study")

    monkeypatch.setattr("tuner.study.run_study", run_study)
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")  # nothing answers there now
    job_id = _queue(sqlite_url)[0]
    settings = WorkerSettings(database_url=sqlite_url, executor="ray", heartbeat_s=0.1, artifact_dir="unused")
    worker = Worker(settings, executor=_Executor())
    assert claim_job(sqlite_url, worker.worker_id) == job_id

    assert JobRun(worker, job_id).run() == "queued"
    with session_scope(sqlite_url) as s:
        job = s.get(Job, job_id)
        assert (job.state, job.worker_id, job.attempts, job.error) == ("queued", None, 0, None)
    assert "no Ray cluster answers there" in _events(sqlite_url, job_id)[-1].payload["reason"]
    worker.shutdown.set()  # no wait for the retry in this test
    assert worker.run_once() is None  # the cluster still does not answer: the job stays queued
    with session_scope(sqlite_url) as s:
        assert s.get(Job, job_id).state == "queued"


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_free_port_takes_the_family_of_its_host():
    for host in ("::1", "[::1]", "127.0.0.1"):
        port = free_port(host)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            s.bind((host.strip("[]"), port))  # free there, as told


def test_node_0_picks_a_rendezvous_port_free_on_every_interface(monkeypatch):
    """Rank 0's store binds all interfaces: a port free only on the node's IP clashed later."""
    from tuner.executors import ray_node

    asked = []
    monkeypatch.setattr(ray_node, "free_port", lambda host="127.0.0.1": asked.append(host) or 12345)
    spec = type("Spec", (), {"workdir": "/tmp/unused"})()
    where: dict = {}
    part = ray_node._node_part(spec, {"node_rank": 0, "nnodes": 2}, "10.1.2.3", where)

    assert asked == [""] and (part.master_addr, part.master_port) == ("10.1.2.3", 12345)
