"""The dashboard's server side (real app, real SQLite database with seeded Optuna studies): the
trials table, plot aggregation of large studies, best card, comparison, nightly history, auth,
offline assets, and optuna-dashboard reading the same database."""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import optuna
import pytest
from fastapi.testclient import TestClient
from seed import seed_job
from sqlalchemy import create_engine, text

from api import Settings, create_app
from api.auth import create_token
from api.dashboard.plots import SAMPLE_LIMIT, pareto_front
from tuner.db import Build, Job, NightlyResult, StudySnapshot, session_scope
from tuner.executors.nodes import free_port
from tuner.migrations import upgrade
from tuner.record import keys
from tuner.record.importance import importances
from tuner.record.reader import ROW_ATTRS, Finished, read_study, study_id, with_all_attrs
from tuner.record.reader import read_trials as read_rows
from tuner.record.snapshot import load as load_snapshot
from tuner.record.snapshot import snapshot_study

DASHBOARD = Path(__file__).resolve().parent.parent / "api" / "dashboard"
PG_URL = os.environ.get("TUNER_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def storage_url(request, tmp_path):
    """Every storage the service supports; PostgreSQL gets a fresh database of its own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tuner.db'}"
        return
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"tuner_dash_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as err:  # noqa: BLE001 - any connection problem means: no server here
        admin.dispose()
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}: {err}")
    yield PG_URL.rsplit("/", 1)[0] + f"/{name}"
    from tuner.db import dispose_engines
    from tuner.storage import _storages

    dispose_engines()
    for storage in _storages.values():
        storage.engine.dispose()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """One database for the module: a 300-trial job, a 1,500-trial job and a second 300-trial job."""
    url = f"sqlite:///{tmp_path_factory.mktemp('dash') / 'tuner.db'}"
    upgrade(url)
    small = seed_job(url, 300, running=1, state="running", seed=1)
    large = seed_job(url, 1500, seed=2)
    other = seed_job(url, 300, seed=3, name="gpt-tiny-b", device="NVIDIA H100")
    with session_scope(url) as s:
        token = create_token(s, "dash")
    return {
        "url": url,
        "small": small,
        "large": large,
        "other": other,
        "auth": {"Authorization": f"Bearer {token}"},
    }


@pytest.fixture(scope="module")
def client(db):
    with TestClient(create_app(Settings(database_url=db["url"]))) as c:
        yield c


def _get(client, db, path, **params):
    resp = client.get(path, params=params, headers=db["auth"])
    assert resp.status_code == 200, resp.text
    return resp.json()


def _rows(db, key):
    with session_scope(db["url"]) as s:
        return read_study(s, s.get(Job, db[key]).study_name).trials


def test_reader_agrees_with_optuna(db):
    """The bulk reader (and the seeder) against Optuna's own storage API, trial by trial."""
    with session_scope(db["url"]) as s:
        name = s.get(Job, db["small"]).study_name
    trials = optuna.load_study(study_name=name, storage=db["url"]).get_trials(deepcopy=False)
    rows = _rows(db, "small")
    assert [r.number for r in rows] == [t.number for t in trials]
    for r, t in zip(rows, trials, strict=True):
        assert r.params == t.params
        # The bulk read carries the attrs the table and plots use; a trial shown whole has all.
        assert r.attrs == {k: v for k, v in t.user_attrs.items() if k in ROW_ATTRS}
        assert r.state == t.state.name.lower()
        if t.values:
            assert r.values == t.values
    assert {r.state for r in rows} >= {"complete", "fail", "running"}
    with session_scope(db["url"]) as s:
        whole = with_all_attrs(s, rows)
    assert [r.attrs for r in whole] == [t.user_attrs for t in trials]
    assert any("log_tail" in r.attrs for r in whole) and not any("log_tail" in r.attrs for r in rows)


def test_reader_and_table_on_every_storage(storage_url):
    upgrade(storage_url)
    job_id = seed_job(storage_url, 120, running=1, state="running", seed=5)
    with session_scope(storage_url) as s:
        name = s.get(Job, job_id).study_name
        rows = read_study(s, name).trials
        token = create_token(s, "pg")
    trials = optuna.load_study(study_name=name, storage=storage_url).get_trials(deepcopy=False)
    assert [(r.number, r.params, r.attrs) for r in rows] == [
        (t.number, t.params, {k: v for k, v in t.user_attrs.items() if k in ROW_ATTRS}) for t in trials
    ]
    with TestClient(create_app(Settings(database_url=storage_url))) as c:
        page = c.get(
            f"/ui/api/jobs/{job_id}/trials",
            params={"sort": "-tokens_per_s", "size": 10},
            headers={"Authorization": f"Bearer {token}"},
        ).json()
    best = max(t.user_attrs["tokens_per_s"] for t in trials if "tokens_per_s" in t.user_attrs)
    assert page["total"] == 121 and page["items"][0]["tokens_per_s"] == best


def _fields(rows):
    return [
        (r.number, r.state, r.status, r.values, r.params, r.attrs, r.started_at, r.finished_at) for r in rows
    ]


def test_snapshot_and_incremental_reads_match_a_full_read(storage_url):
    """A reader holding the finished trials (from memory or the snapshot) reads only new and
    unfinished ones, and ends with exactly what a full read of Optuna's tables gives."""
    upgrade(storage_url)
    job_id = seed_job(storage_url, 200, running=2, state="running", seed=7)
    with session_scope(storage_url) as s:
        name = s.get(Job, job_id).study_name
        sid = study_id(s, name)
        assert load_snapshot(s, name) is None  # a running job has none yet
        _, _, fetched = read_rows(s, sid)
    assert fetched == 200
    assert snapshot_study(storage_url, name) == 200  # what the worker does when a job ends

    # The study moves on: a running trial finishes and a new one is asked and told.
    study = optuna.load_study(study_name=name, storage=storage_url)
    running = [t.number for t in study.get_trials(deepcopy=False) if t.state.name == "RUNNING"]
    study.tell(running[0], 54321.0)
    trial = study.ask({"new_knob": optuna.distributions.CategoricalDistribution([1, 2, 4])})
    trial.set_user_attr("status", "ok")
    trial.set_user_attr("tokens_per_s", 321.0)
    trial.set_user_attr("log_tail", "not read in bulk")
    study.tell(trial, 321.0)

    with session_scope(storage_url) as s:
        snap = load_snapshot(s, name)
        assert len(snap.rows) == 200 and snap.importance is not None
        rows, finished, fetched = read_rows(s, sid, snap)
        full, _, _ = read_rows(s, sid)
    assert fetched == 2  # the finished and the new trial; 200 came from the snapshot
    assert _fields(rows) == _fields(full)
    assert len(finished.rows) == 202
    trials = study.get_trials(deepcopy=False)
    assert [r.params for r in rows] == [t.params for t in trials]
    assert rows[-1].tokens_per_s == 321.0 and "log_tail" not in rows[-1].attrs


def test_an_unreadable_snapshot_is_ignored_and_the_page_still_loads(tmp_path):
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    upgrade(url)
    job_id = seed_job(url, 40, seed=8)
    with session_scope(url) as s:
        name = s.get(Job, job_id).study_name
        s.get(StudySnapshot, name).data = b"not zlib"
        token = create_token(s, "t")
    with TestClient(create_app(Settings(database_url=url))) as c:
        page = c.get(f"/ui/api/jobs/{job_id}/trials", headers={"Authorization": f"Bearer {token}"})
    assert page.status_code == 200 and page.json()["total"] == 40


def test_importance_is_kept_while_the_study_grows_by_at_most_two_percent(db):
    with session_scope(db["url"]) as s:
        study = read_study(s, s.get(Job, db["large"]).study_name)
    dists = study.finished.distributions()
    done = [r for r in study.trials if r.state == "complete"]
    finished = Finished()
    first = importances(done[:-10], finished, dists)
    assert first and finished.importance[0] == len(done) - 10
    assert importances(done, finished, dists) is first  # 10 more of ~1,000: the same ranking
    again = importances(done + done[:100], finished, dists)  # 10% more: computed afresh
    assert again is not first and finished.importance[0] == len(done) + 100


def test_table_sorts_filters_and_pages_on_the_server(client, db):
    path = f"/ui/api/jobs/{db['small']}/trials"
    first = _get(client, db, path, size=20, sort="-tokens_per_s")
    assert first["total"] == 301 and first["pages"] == 16 and len(first["items"]) == 20
    speeds = [t["tokens_per_s"] for t in first["items"]]
    assert speeds == sorted(speeds, reverse=True)
    assert speeds[0] == max(r.tokens_per_s for r in _rows(db, "small") if r.tokens_per_s is not None)
    second = _get(client, db, path, size=20, sort="-tokens_per_s", page=2)
    assert second["items"][0]["tokens_per_s"] <= speeds[-1]
    assert not {t["number"] for t in first["items"]} & {t["number"] for t in second["items"]}

    oom = _get(client, db, path, status="oom", size=200)
    assert oom["total"] == first["status_counts"]["oom"] > 0
    assert {t["status"] for t in oom["items"]} == {"oom"}

    # A misspelt status was an empty page with 200, where /v1's trials say 422 (one rule for both).
    typo = client.get(path, params={"status": "oomm"}, headers=db["auth"])
    assert typo.status_code == 422 and "status" in {e["field"] for e in typo.json()["errors"]}
    # An Optuna state too, as /v1 takes it (the table answered 0 rows where /v1 had every one).
    failed_state = _get(client, db, path, status="fail", size=200)
    assert failed_state["total"] >= oom["total"] and {t["status"] for t in failed_state["items"]} >= {"oom"}
    both = _get(client, db, path, status=["oom", "error"], knob="recompute:none", size=200)
    assert both["items"] and all(t["params"]["recompute"] == "none" for t in both["items"])
    assert {t["status"] for t in both["items"]} <= {"oom", "error"}

    by_knob = _get(client, db, path, sort="-micro_batch_size", size=200)
    sizes = [t["params"]["micro_batch_size"] for t in by_knob["items"]]
    assert sizes == sorted(sizes, reverse=True)
    assert set(first["knobs"]["recompute"]) == {"none", "selective", "full"}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"sort": "speed"}, "sort"),
        ({"knob": "nope:1"}, "knob"),
        ({"knob": "recompute"}, "knob"),
        ({"size": 0}, "size"),
    ],
)
def test_bad_table_query_names_the_field(client, db, params, field):
    resp = client.get(f"/ui/api/jobs/{db['small']}/trials", params=params, headers=db["auth"])
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["field"] == field


def test_reads_need_a_token_unless_public(client, db):
    path = f"/ui/api/jobs/{db['small']}/overview"
    assert client.get(path).status_code == 401
    assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 403
    with TestClient(create_app(Settings(database_url=db["url"], public_reads=True))) as public:
        assert public.get(path).status_code == 200
    # The pages themselves hold no data: they load without a token and ask for one.
    assert client.get("/ui/jobs").status_code == 200


def test_plots_of_a_large_study_are_downsampled_but_keep_what_matters(client, db):
    data = _get(client, db, f"/ui/api/jobs/{db['large']}/plots")
    rows = _rows(db, "large")
    assert data["total"] == 1500 and data["sampled"] <= SAMPLE_LIMIT
    h = data["history"]
    # Every step of the ranking's best-so-far line is kept, so the line is exact and ends at the best.
    with session_scope(db["url"]) as s:
        ranking = read_study(s, s.get(Job, db["large"]).study_name).ranking()
    steps = [e.trial for e in ranking.improvements()]
    assert set(steps) <= set(h["number"])
    assert (h["best_trial"][-1], h["best"][-1]) == (ranking.best.trial, ranking.best.tokens_per_s)
    failed = [r.number for r in rows if r.failed]
    assert h["failed"]["number"] == failed  # fewer than a quarter of the points: all kept
    # The Pareto front is non-dominated and exactly the full study's front.
    front = data["pareto"]["front"]
    assert front["number"] == [
        r.number for r in sorted(pareto_front(rows), key=lambda r: r.attrs["peak_mem_allocated_bytes"])
    ]
    # The seeded speed model makes micro-batch size and compile the knobs that matter.
    assert data["importance"]["params"][0] in ("micro_batch_size", "compile")
    assert set(data["importance"]["params"][:3]) & {"micro_batch_size", "compile"}
    assert [d["name"] for d in data["parallel"]["dimensions"]] == data["importance"]["params"][:6]
    assert len(data["memory"]["number"]) == len(data["memory"]["measured"]) > 0


def test_overview_has_best_speedup_failures_and_build(client, db, tmp_path):
    data = _get(client, db, f"/ui/api/jobs/{db['large']}/overview")
    rows = _rows(db, "large")
    best = max((r for r in rows if r.state == "complete"), key=lambda r: r.tokens_per_s)
    assert data["best"]["number"] == best.number
    assert set(data["best"]["attrs"]["breakdown"]) == {
        "compute",
        "attention",
        "communication",
        "optimizer",
        "idle",
    }
    with session_scope(db["url"]) as s:
        assert data["speedup"] == pytest.approx(s.get(Job, db["large"]).speedup)
    assert data["failures"]["total"] == sum(r.failed for r in rows)
    assert data["failures"]["items"][0]["attrs"]["log_tail"]
    assert data["build"]["ready"] is False

    archive = tmp_path / "build.tar.gz"
    archive.write_bytes(b"not really a tarball, but bytes with a checksum")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    # The worker builds the winner after re-measuring the top configs: it need not be the fastest
    # single measurement, and the card follows the build.
    built = next(r for r in rows if r.state == "complete" and r.number != best.number)
    with session_scope(db["url"]) as s:
        s.add(Build(job_id=db["large"], study_name="x", trial_number=built.number, path=str(archive),
                    sha256=digest, size_bytes=archive.stat().st_size))  # fmt: skip
    after = _get(client, db, f"/ui/api/jobs/{db['large']}/overview")
    assert after["best"]["number"] == built.number
    assert after["build"] == {
        "ready": True,
        "url": f"/v1/jobs/{db['large']}/build",
        "sha256": digest,
        "size_bytes": archive.stat().st_size,
        "trial_number": built.number,
    }


def test_compare_two_trials_from_different_jobs(client, db):
    a, b = _rows(db, "small")[0], _rows(db, "other")[5]
    data = _get(client, db, "/ui/api/compare", a=f"{db['small']}:{a.number}", b=f"{db['other']}:{b.number}")
    differs = {k["name"] for k in data["knobs"] if k["differs"]}
    assert differs == {k for k in set(a.params) | set(b.params) if a.params.get(k) != b.params.get(k)}
    tps = next(m for m in data["metrics"] if m["name"] == "tokens_per_s")
    if a.tokens_per_s and b.tokens_per_s:
        assert tps["change"] == pytest.approx((b.tokens_per_s - a.tokens_per_s) / a.tokens_per_s)
    assert data["a"]["job_id"] == db["small"] and data["b"]["recipe_name"] == "gpt-tiny-b"
    # What ran each trial comes from its study's fingerprint (the same recipe on two device types).
    assert (data["a"]["hardware"]["device"], data["b"]["hardware"]["device"]) == ("seeded CPU", "NVIDIA H100")
    bad = client.get("/ui/api/compare", params={"a": "1-2", "b": "1:2"}, headers=db["auth"])
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "a"
    missing = client.get(
        "/ui/api/compare", params={"a": f"{db['small']}:99999", "b": "1:1"}, headers=db["auth"]
    )
    assert missing.status_code == 404


def test_recipe_history_marks_regressions_and_what_changed(client, db):
    fp = {"family": "cuda", "device": "NVIDIA H100", "torch": "2.8.0", "driver": "550.54"}
    nights = [
        (dt.date(2026, 11, 1), fp, 1000.0, "ok"),
        (dt.date(2026, 11, 2), {**fp, "torch": "2.9.0"}, 800.0, "regression"),
        (dt.date(2026, 11, 3), {**fp, "torch": "2.9.0"}, 805.0, "ok"),
    ]
    with session_scope(db["url"]) as s:
        for night, fingerprint, best, verdict in nights:
            s.add(NightlyResult(recipe_name="nightly-tiny", night=night, fingerprint_hash=str(hash(str(fingerprint))),
                                fingerprint=fingerprint, best_tokens_per_s=best, verdict=verdict))  # fmt: skip
    data = _get(client, db, "/ui/api/recipes/nightly-tiny/history")
    assert [n["night"] for n in data["nights"]] == ["2026-11-01", "2026-11-02", "2026-11-03"]
    assert data["regressions"] == 1
    regression = data["nights"][1]
    assert regression["regression"] and regression["suspects"] == ["torch"]
    assert regression["changes"] == [{"key": "torch", "before": "2.8.0", "after": "2.9.0"}]
    assert data["nights"][2]["changes"] == []


def test_a_recipe_name_with_a_slash_has_its_history_page(client, db):
    """Recipe names are free text: one with a slash (sent as %2F, which the server decodes before
    routing) still reaches its history and its page."""
    with session_scope(db["url"]) as s:
        s.add(NightlyResult(recipe_name="team/gpt tiny", night=dt.date(2026, 11, 1), fingerprint_hash="f",
                            fingerprint={}, best_tokens_per_s=1000.0, verdict="first_run"))  # fmt: skip
    data = _get(client, db, "/ui/api/recipes/team%2Fgpt%20tiny/history")
    assert [n["best_tokens_per_s"] for n in data["nights"]] == [1000.0]
    page = client.get("/ui/recipes/team%2Fgpt%20tiny")
    assert page.status_code == 200 and "recipe.js" in page.text


def test_a_regression_after_a_failed_night_names_what_changed_since_the_night_it_was_judged_by(client, db):
    """Night 2 failed (no fingerprint measured); night 3 regressed against night 1 on the same
    machine: the history shows nothing changed, as the report said, not night 2's empty record."""
    from tuner import nightly as nl
    from tuner.recipe import recipe_from_dict

    recipe = recipe_from_dict(
        {
            "name": "nightly-failed-between",
            "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256},
        }
    )
    fp = {"family": "cpu", "device": "cpu-a", "torch": "2.13.0"}

    def tonight(best):
        def tune(recipe, enqueue, run):
            if best is None:
                raise RuntimeError("ray cluster unreachable")
            return nl.Tonight(best, {"micro_batch_size": 4}, fp, "fp-a")

        return tune

    outs = [
        nl.run_recipe(
            recipe,
            "r.yaml",
            night=dt.date(2026, 11, d),
            threshold=0.05,
            tune=tonight(best),
            expected_fingerprint_hash="fp-a",
            db_url=db["url"],
        )  # fmt: skip
        for d, best in ((1, 1000.0), (2, None), (3, 800.0))
    ]
    assert [o.verdict for o in outs] == ["first_run", "failed", "regression"] and not outs[
        2
    ].fingerprint_changed
    night3 = _get(client, db, "/ui/api/recipes/nightly-failed-between/history")["nights"][2]
    assert night3["regression"] and night3["compared_night"] == "2026-11-01"
    assert night3["changes"] == [] and night3["suspects"] == []


PLOTLY_SHA256 = "99784e3abfb07b142a15e521a439e6d9addceadb3f79553fd24c72774f0649ba"


def test_pages_and_assets_are_served_from_the_package_with_no_network(client):
    for page in ("/ui/jobs", "/ui/jobs/1", "/ui/studies/gpt-tiny-1-2", "/ui/compare", "/ui/recipes/gpt-tiny"):
        resp = client.get(page)
        assert resp.status_code == 200 and "text/html" in resp.headers["content-type"]
    # The vendored partial bundle, pinned: npm's plotly.js-basic-dist-min 4.1.1, with its licence.
    plotly_js = client.get("/ui/static/plotly.min.js")
    assert plotly_js.status_code == 200 and hashlib.sha256(plotly_js.content).hexdigest() == PLOTLY_SHA256
    assert plotly_js.content.startswith(b"/**\n* plotly.js (basic - minified) v4.1.1")
    assert "MIT License" in client.get("/ui/static/plotly.LICENSE").text
    assert client.get("/ui/static/job.js").status_code == 200
    assert client.get("/ui/static/..%2Fstore.py").status_code == 404
    # Offline: nothing the browser loads points outside this server.
    for f in [*DASHBOARD.glob("static/*.*"), *DASHBOARD.glob("templates/*")]:
        assert not re.search(r"(src|href)=\"?(https?:)?//", f.read_text()), f


@pytest.mark.slow
def test_optuna_dashboard_lists_our_studies(db):
    """README: `optuna-dashboard sqlite:///tuner.db` opens the same database."""
    exe = Path(sys.executable).parent / "optuna-dashboard"
    if not exe.exists():
        pytest.skip("optuna-dashboard is not installed (pip install -c constraints/cpu.txt optuna-dashboard)")
    port = free_port()
    proc = subprocess.Popen(
        [str(exe), db["url"], "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        deadline, studies = time.monotonic() + 60, None
        while time.monotonic() < deadline and studies is None:
            try:
                studies = httpx.get(f"http://127.0.0.1:{port}/api/studies", timeout=5).json()[
                    "study_summaries"
                ]
            except httpx.HTTPError:
                time.sleep(0.3)
        assert studies is not None, "optuna-dashboard did not answer within 60 s"
        with session_scope(db["url"]) as s:
            ours = {s.get(Job, db[k]).study_name for k in ("small", "large", "other")}
        listed = {st["study_name"]: st for st in studies}
        assert ours <= set(listed)
    finally:
        proc.terminate()
        proc.wait(10)


def test_downsampling_caps_failures_but_keeps_every_improvement():
    from api.dashboard.plots import SAMPLE_LIMIT, downsample
    from tuner.record.ranking import rank_trials
    from tuner.record.trial import TrialRecord as TrialRow

    def row(n: int) -> TrialRow:
        failed = n % 2 == 1  # half the study failed: more than the plot's quarter for failures
        return TrialRow(
            number=n,
            state="fail" if failed else "complete",
            status="oom" if failed else "ok",
            values=[] if failed else [float(n % 97 + n / 100)],
            params={},
            attrs={"peak_mem_allocated_bytes": 1000 - n % 13},
            started_at=None,
            finished_at=None,
        )

    rows = [row(n) for n in range(6000)]
    ranking = rank_trials(rows, {})
    sample = downsample(rows, ranking)
    assert len(sample) <= SAMPLE_LIMIT
    assert sum(r.failed for r in sample) == SAMPLE_LIMIT // 4
    improvements = [e.trial for e in ranking.improvements()]
    assert len(improvements) > 1 and improvements[-1] == ranking.best.trial
    assert set(improvements) <= {r.number for r in sample}
    assert [r.number for r in sample] == sorted(r.number for r in sample)


def test_the_best_so_far_line_is_the_rankings_and_ends_at_its_best():
    """The fastest first measurements are not the best: #1 measured lower twice more, #2's loss
    drifts from the fp32 reference, #3 claims inf. The line steps where the ranking says and ends
    at its best, #4, also when the plot shows a sample of the study; a point above the line says why."""
    from api.dashboard.plots import downsample, history
    from tuner.record.ranking import rank_trials
    from tuner.record.trial import TrialRecord as TrialRow

    def row(n: int, tps: float, amp: str = "O1", losses: tuple[float, ...] = (1.0, 0.9)) -> TrialRow:
        attrs = {keys.TOKENS_PER_S: tps, keys.LOSSES: list(losses)}
        return TrialRow(n, "complete", "ok", [tps], {"amp": amp}, attrs, None, None)

    rows = [
        row(0, 100.0, amp="O0"),  # the fp32 reference
        row(1, 300.0),  # lucky once: its median over three runs is 150
        row(2, 400.0, losses=(1.1, 1.0)),  # 11% off the reference's losses
        row(3, math.inf),
        row(4, 200.0),
        row(5, 120.0),
    ]
    ranking = rank_trials(rows, {1: [150.0, 140.0]})
    assert ranking.best.trial == 4 and max(r.tokens_per_s for r in rows) != ranking.best.tokens_per_s
    assert [e.trial for e in ranking.improvements()] == [0, 1, 4]
    h = history(rows, ranking)
    assert h["best"] == [100.0, 150.0, 150.0, 150.0, 200.0, 200.0]
    assert h["best_trial"] == [0, 1, 1, 1, 4, 4]
    assert h["eligible"] == [True, True, False, False, True, True]
    assert h["note"][1].startswith("ranked at its median") and "loss drifts" in h["note"][2]
    assert h["note"][3] == "cannot win: not a measured throughput"
    sample = downsample(rows, ranking, limit=3)  # only the line's steps fit
    assert [r.number for r in sample] == [0, 1, 4]
    assert (history(sample, ranking)["best_trial"][-1], history(sample, ranking)["best"][-1]) == (4, 200.0)


def test_a_queued_job_without_a_study_shows_empty_table_and_plots(client, db):
    with session_scope(db["url"]) as s:
        job = Job(recipe_name="queued", recipe={}, recipe_hash="h", state="queued", trials_total=3)
        s.add(job)
        s.flush()
        job_id = job.id
    table = _get(client, db, f"/ui/api/jobs/{job_id}/trials")
    assert table["total"] == 0 and table["items"] == []
    assert _get(client, db, f"/ui/api/jobs/{job_id}/plots") == {"total": 0, "sampled": 0}
    overview = _get(client, db, f"/ui/api/jobs/{job_id}/overview")
    assert overview["best"] is None and overview["build"]["ready"] is False
    assert client.get("/ui/api/jobs/999999/overview", headers=db["auth"]).status_code == 404


@pytest.mark.slow
def test_fuzzed_dashboard_queries_never_get_a_5xx(db):
    """Property-based requests to every /ui/api route (schemathesis): bad input is a 4xx, never a
    traceback."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    app = create_app(Settings(database_url=db["url"]))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app).include(path_regex="^/ui/api")
    token = db["auth"]["Authorization"]
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/ui/api/jobs/{job_id}/trials", "/ui/api/compare"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case):
            case.headers = {**(case.headers or {}), "Authorization": token}
            case.call_and_validate(checks=[not_a_server_error])

        check()


def _running_job(tmp_path, trials: int, seed: int):
    """A fresh database with one running job of `trials` seeded trials: (url, job id, its Optuna
    study, auth headers)."""
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    upgrade(url)
    job_id = seed_job(url, trials, seed=seed, state="running")
    with session_scope(url) as s:
        name = s.get(Job, job_id).study_name
        token = create_token(s, f"job-{seed}")
    study = optuna.load_study(study_name=name, storage=url)
    return url, job_id, study, {"Authorization": f"Bearer {token}"}


def test_a_trial_with_nan_loss_and_infinite_throughput_does_not_break_the_pages(tmp_path):
    """JSON has no NaN: a diverged trial's values go out as null, the pages still load."""
    url, job_id, study, auth = _running_job(tmp_path, 20, seed=9)
    trial = study.ask()
    trial.set_user_attr("status", "error")
    trial.set_user_attr("loss", float("nan"))
    trial.set_user_attr("tokens_per_s", float("inf"))
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    with TestClient(create_app(Settings(database_url=url))) as c:
        for path in (
            f"/ui/api/jobs/{job_id}/overview",
            f"/ui/api/jobs/{job_id}/trials?sort=-tokens_per_s",
            f"/ui/api/jobs/{job_id}/plots",
            f"/ui/api/jobs/{job_id}/trials/{trial.number}",
            f"/v1/jobs/{job_id}/trials?status=fail",
        ):
            resp = c.get(path, headers=auth)
            assert resp.status_code == 200, (path, resp.text)
        shown = c.get(f"/ui/api/jobs/{job_id}/trials/{trial.number}", headers=auth).json()["trial"]
    assert shown["attrs"]["loss"] is None and shown["tokens_per_s"] is None


def test_the_server_keeps_a_bounded_number_of_studies_in_memory(db, monkeypatch):
    from collections import OrderedDict

    from tuner.record import reader as store

    monkeypatch.setattr(store, "CACHED_STUDIES", 2)
    monkeypatch.setattr(store, "_cache", OrderedDict())
    with session_scope(db["url"]) as s:
        names = [s.get(Job, db[k]).study_name for k in ("small", "large", "other")]
        for name in names:
            assert read_study(s, name) is not None
        held = {name for _, name in store._cache}
        assert names[0] not in held and set(names[1:]) <= held
        # The least recently read goes first: reading `large` again keeps it over `other`.
        read_study(s, names[1])
        read_study(s, names[0])
        held = {name for _, name in store._cache}
    assert names[2] not in held and {names[0], names[1]} <= held


def test_the_cached_study_sees_a_running_trial_finish_and_a_new_trial_appear(tmp_path):
    """The freshness check reads only the highest trial id and the trials held unfinished."""
    from seed import seed_study
    from sqlalchemy import update

    from tuner import optuna_tables as tables
    from tuner.db import session_scope
    from tuner.record.reader import read_study

    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    seed_study(url, "live", 30, seed=1, running=2)
    with session_scope(url) as s:
        first = read_study(s, "live")
        assert read_study(s, "live") is first  # unchanged: the cached record
        running = [t for t in first.trials if t.state == "running"]
        assert len(running) == 2
    with session_scope(url) as s:
        s.execute(update(tables.trials).where(tables.trials.c.trial_id == running[0].trial_id)
                  .values(state="FAIL", datetime_complete=dt.datetime.now()))  # fmt: skip
    with session_scope(url) as s:
        second = read_study(s, "live")
        assert second is not first
        assert second.find(running[0].number).state == "fail"
        assert read_study(s, "live") is second
    seed_study(url, "live", 3, seed=2)
    with session_scope(url) as s:
        third = read_study(s, "live")
        assert len(third.trials) == 35 and third is not second


def test_a_re_measurement_appended_to_a_trials_list_reaches_the_ranking(tmp_path):
    """A second re-measurement updates its study attribute in place (the count of attributes
    stays): the cached study must still be re-read, or the winner is named from stale medians."""
    import optuna
    from seed import seed_study

    from tuner.db import session_scope
    from tuner.record import keys
    from tuner.record.reader import read_study

    url = f"sqlite:///{tmp_path / 'again.db'}"
    seed_study(url, "again", 6, seed=3)
    study = optuna.load_study(study_name="again", storage=url)
    with session_scope(url) as s:
        best = read_study(s, "again").ranking().best
    key, slow = keys.remeasured_key(best.trial), best.tokens_per_s / 10
    study.set_user_attr(key, [slow])
    with session_scope(url) as s:
        entry = next(e for e in read_study(s, "again").ranking().ranked if e.trial == best.trial)
        assert entry.remeasured_tokens_per_s == [slow]
    study.set_user_attr(key, [slow, slow])  # in place: the count of attributes stays
    with session_scope(url) as s:
        ranking = read_study(s, "again").ranking()
        entry = next(e for e in ranking.ranked if e.trial == best.trial)
        assert entry.remeasured_tokens_per_s == [slow, slow] and entry.tokens_per_s == slow
        assert ranking.best.trial != best.trial


def test_the_trials_table_says_where_each_trial_ran_and_sorts_by_it(tmp_path):
    """A study on a cluster: the table shows the host of a one-node trial and how many nodes a
    multi-node one spanned (what the REST listing says), and sorts by it."""
    url, job_id, study, auth = _running_job(tmp_path, 4, seed=11)
    for node, nodes, speed in (("node-b", 1, 900.0), ("node-a", 2, 1800.0)):
        trial = study.ask()
        for key, value in {"status": "ok", "tokens_per_s": speed, "node": node, "nodes": nodes}.items():
            trial.set_user_attr(key, value)
        study.tell(trial, speed)
    with TestClient(create_app(Settings(database_url=url))) as c:
        resp = c.get(f"/ui/api/jobs/{job_id}/trials", params={"sort": "node", "size": 200}, headers=auth)
    assert resp.status_code == 200, resp.text
    placed = [(t["node"], t["nodes"]) for t in resp.json()["items"] if t["node"]]
    # The seeded trials ran on "seed-host": sorted by where, ours come first.
    assert placed[:2] == [("node-a", 2), ("node-b", 1)] and {n for n, _ in placed[2:]} == {"seed-host"}
