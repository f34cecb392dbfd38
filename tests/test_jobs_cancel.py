"""Cancelling a job over REST while a worker claims it: the real app, the real worker and queue, on
SQLite and PostgreSQL (a stand-in study, as in tests/test_worker.py)."""

from __future__ import annotations

import yaml
from fastapi.testclient import TestClient
from sqlalchemy import select
from test_worker import RECIPE, _Executor, _study, db_url  # noqa: F401 - a fixture (migrated, both databases)

from api import Settings, create_app
from api.auth import create_token
from api.routes import jobs as job_routes
from tuner.db import Job, JobEvent, session_scope
from tuner.worker import JobRun, Worker, WorkerSettings, claim_job


def test_a_queued_job_a_worker_claims_while_it_is_cancelled_is_cancelled_as_a_running_one(
    db_url,
    tmp_path,
    monkeypatch,  # noqa: F811 - the fixture
):
    """POST /cancel read the job queued and wrote it `cancelled` over the claim a worker made in
    between: the worker ran its study anyway until its heartbeat found the job gone, and wrote the
    trial's events and the study's end after the job's `done` (which an event stream stops at).
    Now the cancel is a compare-and-set, as the claim is: the claimed job is cancelled as a running
    one, its worker stops it and ends it `cancelled`, and `done` is its last event."""
    monkeypatch.setattr("tuner.study.run_study", _study(trials_before_stop=1))
    settings = Settings(database_url=db_url, max_trials=50, max_timeout_min=60)
    worker = Worker(
        WorkerSettings(database_url=db_url, heartbeat_s=0.1, artifact_dir=str(tmp_path), build=False),
        executor=_Executor(),
    )
    with TestClient(create_app(settings)) as client:
        with session_scope(db_url) as s:
            client.headers["Authorization"] = f"Bearer {create_token(s, 'tester')}"
        yaml_body = {"Content-Type": "application/yaml"}
        submitted = client.post("/v1/jobs", content=yaml.safe_dump(RECIPE.to_dict()), headers=yaml_body)
        job_id = submitted.json()["id"]
        read_job = job_routes._get_job

        def claimed_meanwhile(session, wanted: int) -> Job:
            job = read_job(session, wanted)
            assert job.state == "queued"
            assert claim_job(db_url, worker.worker_id) == wanted  # between the read and the write
            return job

        monkeypatch.setattr(job_routes, "_get_job", claimed_meanwhile)
        cancel = client.post(f"/v1/jobs/{job_id}/cancel")
        monkeypatch.setattr(job_routes, "_get_job", read_job)
        assert cancel.status_code == 202, cancel.text
        ended = JobRun(worker, job_id).run()  # the worker that claimed it
        job = client.get(f"/v1/jobs/{job_id}").json()
    with session_scope(db_url) as s:
        kinds = list(s.scalars(select(JobEvent.kind).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))
    assert kinds.count("done") == 1 and kinds[-1] == "done", kinds
    assert (job["state"], job["error"], ended) == ("cancelled", None, "cancelled")
    assert (cancel.json()["state"], cancel.json()["cancel_requested"]) == ("running", True)
    assert kinds.index("cancel_requested") < kinds.index("done")
