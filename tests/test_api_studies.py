"""Every study in the database over REST and the dashboard's data endpoints (a `tuner tune` run's
as well as a job's), the one-line error of a failed job with its log behind GET /v1/jobs/ID/log,
and the reuse wording of a job that found measured trials."""

from __future__ import annotations

import hashlib

import pytest
from fastapi.testclient import TestClient
from seed import seed_job, seed_study

from api import Settings, create_app
from api.auth import create_token
from tuner.db import Build, Job, session_scope
from tuner.record.reader import read_study

TRACEBACK = """Traceback (most recent call last):
  File "/srv/tuner/build/kernels.py", line 88, in compile_kernels
    subprocess.run(cmd, check=True)
subprocess.CalledProcessError: Command '['g++', '-O3']' returned non-zero exit status 1."""


@pytest.fixture
def env(tmp_path):
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    with TestClient(create_app(Settings(database_url=url))) as client:
        job = seed_job(url, 30, seed=1, name="gpt-rest")
        seed_study(url, "gpt-cli-0123456789abcdef-fp", 25, seed=2)
        with session_scope(url) as s:
            token = create_token(s, "t")
        client.headers["Authorization"] = f"Bearer {token}"
        yield {
            "client": client,
            "url": url,
            "job": job,
            "cli": "gpt-cli-0123456789abcdef-fp",
            "tmp": tmp_path,
        }


def test_every_study_is_listed_and_a_cli_study_gets_the_job_pages_data(env):
    client, url = env["client"], env["url"]
    items = client.get("/v1/studies").json()["items"]
    by_name = {s["name"]: s for s in items}
    with session_scope(url) as s:
        job_study = s.get(Job, env["job"]).study_name
        cli = read_study(s, env["cli"])
    assert set(by_name) == {job_study, env["cli"]}
    assert by_name[job_study]["source"] == "job" and by_name[job_study]["job_ids"] == [env["job"]]
    listed = by_name[env["cli"]]
    assert listed["source"] == "cli" and listed["job_ids"] == [] and listed["trials"] == 25
    assert listed["links"]["page"] == f"/ui/studies/{env['cli']}"
    best = cli.ranking().best
    assert listed["best_tokens_per_s"] == pytest.approx(best.tokens_per_s)

    base = f"/ui/api/studies/{env['cli']}"
    overview = client.get(f"{base}/overview").json()
    assert overview["job"]["kind"] == "study" and overview["job"]["id"] is None
    assert overview["best"]["number"] == best.trial
    assert overview["best"]["tokens_per_s"] == pytest.approx(best.tokens_per_s)
    assert overview["best"]["noise"] == pytest.approx(best.noise)
    assert (
        overview["build"]["ready"] is False and overview["build"]["url"] == f"/v1/studies/{env['cli']}/build"
    )
    table = client.get(f"{base}/trials", params={"size": 10, "sort": "-tokens_per_s"}).json()
    assert (
        table["total_all"] == 25
        and table["items"][0]["number"]
        == max((t for t in cli.trials if t.completed), key=lambda t: t.tokens_per_s).number
    )
    assert client.get(f"{base}/plots").json()["total"] == 25
    assert client.get(f"{base}/trials/{best.trial}").json()["trial"]["number"] == best.trial
    assert client.get("/ui/studies/" + env["cli"]).status_code == 200


def test_a_cli_studys_build_downloads_and_unknown_studies_are_404(env):
    client, url = env["client"], env["url"]
    missing = client.get(f"/v1/studies/{env['cli']}/build")
    assert missing.status_code == 404 and "tuner build" in missing.json()["detail"]
    assert client.get("/v1/studies/no-such-study/build").status_code == 404
    assert client.get("/ui/api/studies/no-such-study/overview").status_code == 404
    assert client.get("/ui/api/studies/bad%20name/overview").status_code == 422
    archive = env["tmp"] / "b.tar.gz"
    archive.write_bytes(b"a build")
    with session_scope(url) as s:
        built = read_study(s, env["cli"]).ranking().ranked[1].trial  # not the fastest: the build decides
        s.add(Build(study_name=env["cli"], trial_number=built, path=str(archive),
                    sha256=hashlib.sha256(b"a build").hexdigest(), size_bytes=7))  # fmt: skip
    got = client.get(f"/v1/studies/{env['cli']}/build")
    assert got.status_code == 200 and got.content == b"a build"
    assert got.headers["X-Checksum-Sha256"] == hashlib.sha256(b"a build").hexdigest()
    overview = client.get(f"/ui/api/studies/{env['cli']}/overview").json()
    assert overview["build"]["ready"] and overview["best"]["number"] == built


def test_a_failed_job_shows_one_line_and_its_log_is_one_call_away(env):
    client, url = env["client"], env["url"]
    with session_scope(url) as s:
        failed = s.get(Job, env["job"])
        failed.state, failed.log = "failed", TRACEBACK
        failed.error = "build failed: CalledProcessError: g++ returned 1; the best config stands"
        legacy = Job(recipe_name="old", recipe={}, recipe_hash="x", state="failed", error=TRACEBACK)
        s.add(legacy)
        s.flush()
        legacy_id = legacy.id
    job = client.get(f"/v1/jobs/{env['job']}").json()
    assert job["error"] == "build failed: CalledProcessError: g++ returned 1; the best config stands"
    assert job["links"]["log"] == f"/v1/jobs/{env['job']}/log"
    log = client.get(job["links"]["log"]).json()
    assert log["log"] == TRACEBACK and log["error"] == job["error"]
    # A row written before errors were one line: its traceback never reaches a view.
    old = client.get(f"/v1/jobs/{legacy_id}").json()
    assert old["error"].startswith("subprocess.CalledProcessError") and "\n" not in old["error"]
    for path in ("/v1/jobs", f"/ui/api/jobs/{legacy_id}/overview"):
        assert "Traceback" not in client.get(path).text
    none = client.get(f"/v1/jobs/{legacy_id + 1}/log")
    assert none.status_code == 404


def test_a_job_that_reused_measured_trials_says_so(env):
    client, url = env["client"], env["url"]
    with session_scope(url) as s:
        job = s.get(Job, env["job"])
        job.trials_done, job.trials_total, job.trials_reused = 12, 6, 12
    job = client.get(f"/v1/jobs/{env['job']}").json()
    assert (job["trials_done"], job["trials_total"]) == (6, 6)
    assert job["progress"] == "6 of 6: reused from 12 measured earlier"
    with session_scope(url) as s:
        job = s.get(Job, env["job"])
        job.trials_done, job.trials_total, job.trials_reused = 15, 20, 12
    assert (
        client.get(f"/v1/jobs/{env['job']}").json()["progress"]
        == "15 of 20: 12 reused from earlier, 3 measured now"
    )


def test_knob_importance_below_twenty_completed_trials_is_indicative_with_its_spread(env):
    client, url = env["client"], env["url"]
    seed_study(url, "few-trials", 10, seed=3)
    with session_scope(url) as s:
        completed = sum(t.completed for t in read_study(s, "few-trials").trials)
    few = client.get("/ui/api/studies/few-trials/plots").json()["importance"]
    assert 4 <= completed < 20
    assert few["indicative"] is True and few["completed"] == completed and few["min_trials"] == 20
    assert len(few["low"]) == len(few["high"]) == len(few["params"]) > 0
    assert all(lo <= hi for lo, hi in zip(few["low"], few["high"], strict=True))
    assert any(hi > lo for lo, hi in zip(few["low"], few["high"], strict=True)), (
        "resamples disagree on 9 trials"
    )
    seed_study(url, "many-trials", 60, seed=4)
    many = client.get("/ui/api/studies/many-trials/plots").json()["importance"]
    assert many["indicative"] is False and many["completed"] >= 20 and "low" not in many


class _Executor:
    """Where the worker's preflight describes this machine; the study below starts no trial."""

    name = "local"

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        pass

    def describe(self, requested: str):
        from tuner.fingerprint import described_here

        return described_here(requested)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def any_env(request, tmp_path):
    """`env`'s seeded job on SQLite and on PostgreSQL."""
    from test_db import fresh_pg_database

    from tuner.migrations import upgrade

    url, drop = (f"sqlite:///{tmp_path / 'tuner.db'}", None)
    if request.param == "postgresql":
        url, drop = fresh_pg_database()
        upgrade(url)
    try:
        with TestClient(create_app(Settings(database_url=url))) as client:
            job = seed_job(url, 30, seed=1, name="gpt-rest")
            with session_scope(url) as s:
                client.headers["Authorization"] = f"Bearer {create_token(s, 't')}"
            yield {"client": client, "url": url, "job": job, "tmp": tmp_path}
    finally:
        if drop is not None:
            drop()


def test_a_study_whose_newest_job_waits_or_was_cancelled_lists_its_winner(any_env, monkeypatch):
    """The studies list took a job's study's best from its newest job's row: null once a job of
    the same recipe came back to the queue behind another driver of the study (`hold_back`, which
    names the job's study first), and still null after that job was cancelled, though the study
    and the job's page (`links.job`, `links.page`) name its winner."""
    from tuner.resume import StudyBusy
    from tuner.worker import Worker, WorkerSettings

    env = any_env
    client, url = env["client"], env["url"]
    with session_scope(url) as s:
        first = s.get(Job, env["job"])
        name, recipe = first.study_name, first.recipe
    again = client.post("/v1/jobs", json=recipe).json()["id"]  # the same recipe, submitted again

    def busy(*_a, **_kw):  # a CLI `tuner tune` holds the study (`tuner.resume.claim_study`)
        raise StudyBusy(f"study {name} is being tuned by another driver (pid 1 on host cli-host)")

    monkeypatch.setattr("tuner.study.study_name", lambda *_a: name)  # the seeded study's name
    monkeypatch.setattr("tuner.study.run_study", busy)
    settings = WorkerSettings(database_url=url, heartbeat_s=0.1, artifact_dir=str(env["tmp"]))
    assert Worker(settings, executor=_Executor()).run_once() == again
    job = client.get(f"/v1/jobs/{again}").json()
    assert (job["state"], job["study_name"]) == ("queued", name)
    with session_scope(url) as s:
        winner = read_study(s, name).ranking().best.tokens_per_s
    for state in ("queued", "cancelled"):
        assert client.get(f"/v1/jobs/{again}").json()["state"] == state
        listed = {s["name"]: s for s in client.get("/v1/studies").json()["items"]}[name]
        assert listed["job_ids"] == [again, env["job"]] and listed["links"]["job"] == f"/v1/jobs/{again}"
        assert client.get(f"/v1/jobs/{again}/best").json()["tokens_per_s"] == pytest.approx(winner)
        overview = client.get(f"/ui/api/jobs/{again}/overview").json()
        assert overview["best"]["tokens_per_s"] == pytest.approx(winner)
        assert listed["best_tokens_per_s"] == pytest.approx(winner), state
        assert client.post(f"/v1/jobs/{again}/cancel").status_code in (202, 409)
