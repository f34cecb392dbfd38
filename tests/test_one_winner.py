"""One study, every reader, one winner: `tuner show`, `GET /v1/jobs/ID/best`, the dashboard's best
card, the end of its history plot's best-so-far line and the nightly's view of a study name the
same trial with the same figure, while the job runs and after it ended, on SQLite and PostgreSQL.

The study is made so that the naive answers differ from the ranked one: the config whose first
measurement is fastest drifts from the fp32 losses (it cannot win), and the next one was lucky once
and measures a fifth of that when re-measured (its median drops below a third config's)."""

from __future__ import annotations

import json
import uuid

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from test_study import NARROW, FakeExecutor, make_recipe
from typer.testing import CliRunner

from api import Settings, create_app
from api.auth import create_token
from tuner.cli.main import app as cli
from tuner.db import Job, session_scope
from tuner.migrations import upgrade
from tuner.nightly.history import _top_configs
from tuner.study import run_study
from tuner.worker.job import apply_summary, jsonable

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tuner.db'}"
        return
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"tuner_winner_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield PG_URL.rsplit("/", 1)[0] + f"/{name}"
    from tuner.db import dispose_engines
    from tuner.storage import _storages

    dispose_engines()
    for storage in _storages.values():
        storage.engine.dispose()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _winners(url: str, job_id: int, recipe_path: str, study: str) -> dict[str, tuple[int, float]]:
    """(trial, tokens/s) of the winner as each reader names it."""
    with session_scope(url) as s:
        token = create_token(s, f"t{uuid.uuid4().hex[:6]}")
    auth = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(Settings(database_url=url))) as client:
        best = client.get(f"/v1/jobs/{job_id}/best", headers=auth).json()
        card = client.get(f"/ui/api/jobs/{job_id}/overview", headers=auth).json()["best"]
        listed = client.get(f"/v1/jobs/{job_id}", headers=auth).json()
        line = client.get(f"/ui/api/jobs/{job_id}/plots", headers=auth).json()["history"]
    show = CliRunner().invoke(cli, ["show", recipe_path, "--storage", url, "--study", study, "--json"])
    assert show.exit_code == 0, show.output
    shown = json.loads(show.output)["best"]
    assert best["interval"] is not None, "the winner has no interval"
    assert best["interval"] == card["interval"] == shown["ci"], (
        "the readers give the winner different intervals"
    )
    # What the winner ran on, as the study recorded it (a nightly on another database reads it here).
    assert study.endswith(best["fingerprint_hash"]) and best["fingerprint"]["family"] == "cpu"
    nightly = _top_configs(study, url, 1)[0]
    assert nightly == shown["config"], "the nightly's best config is another config"
    out = {
        "cli show": (shown["trial"], shown["tokens_per_s"]),
        "/v1/best": (best["trial"], best["tokens_per_s"]),
        "dashboard card": (card["number"], card["tokens_per_s"]),
        "history plot's best-so-far line": (line["best_trial"][-1], line["best"][-1]),
    }
    if listed["best_tokens_per_s"] is not None:
        out["jobs list"] = (out["cli show"][0], listed["best_tokens_per_s"])
    return out


def test_every_reader_names_the_same_winner_mid_run_and_at_the_end(url, tmp_path):
    upgrade(url)
    recipe = make_recipe(
        "winner", overrides={**NARROW, "micro_batch_size": [2, 4, 8], "amp": ["O0", "O1", "O2"]}
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe.to_dict()))
    # O2 runs fastest but drifts 5% from the fp32 losses; micro-batch 8 measures at a fifth the second time.
    ex = FakeExecutor(drift={"O2": 0.05}, again={8: 0.2})
    with session_scope(url) as s:
        job = Job(
            recipe_name=recipe.name, recipe=recipe.to_dict(), recipe_hash=recipe.hash(), state="running"
        )
        s.add(job)
        s.flush()
        job_id = job.id

    def progress(event):  # what the worker records on the job while the study runs
        if event.get("best_tokens_per_s") is not None:
            with session_scope(url) as s:
                s.get(Job, job_id).best_tokens_per_s = event["best_tokens_per_s"]

    kw = {"storage_url": url, "sampler": "grid", "workdir": tmp_path, "progress": progress}
    partial = run_study(recipe, executor=ex, trials=5, remeasure_top=2, **kw)
    with session_scope(url) as s:
        s.get(Job, job_id).study_name = partial.study_name
    mid = _winners(url, job_id, str(path), partial.study_name)
    assert len(set(mid.values())) == 1, f"mid-run the readers disagree: {mid}"
    assert mid["cli show"][0] == partial.best.trial

    final = run_study(recipe, executor=ex, trials=9, remeasure_top=3, **kw)
    with session_scope(url) as s:  # the job ends as the worker ends it
        job = s.get(Job, job_id)
        apply_summary(job, final)
        job.summary, job.state = jsonable(final.to_dict()), "succeeded"
    end = _winners(url, job_id, str(path), final.study_name)
    assert len(set(end.values())) == 1, f"at the end the readers disagree: {end}"
    best = final.best
    assert end["/v1/best"] == (best.trial, best.tokens_per_s)
    # The naive answers are wrong here, which is what makes the agreement above mean something.
    assert best.config["amp"] != "O2" and final.flagged
    complete = [e for e in final.top_k + final.flagged]
    fastest_once = max(complete, key=lambda e: e.metrics["tokens_per_s"])
    assert fastest_once.trial != best.trial
