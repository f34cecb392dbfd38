"""The job page's performance-model panel, server side (real app, real SQLite database with seeded
Optuna studies): predicted against measured tokens/s over every predicted trial, and the plan
fitted to the study's own trials with what the study measured for each planned config."""

from __future__ import annotations

import numpy as np
import optuna
import pytest
from fastapi.testclient import TestClient
from seed import TINY, seed_job, seed_study

from api import Settings, create_app
from api.dashboard.plots import SAMPLE_LIMIT
from tuner.db import Job, session_scope
from tuner.migrations import upgrade
from tuner.perf import study_plan
from tuner.perf.predictor import prediction_error
from tuner.recipe import recipe_from_dict
from tuner.record import keys
from tuner.record.reader import read_study
from tuner.storage import get_storage


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('model') / 'tuner.db'}"
    upgrade(url)
    predicted = seed_job(url, 300, seed=5, predictions=True)
    plain = seed_job(url, 40, seed=6, name="gpt-tpe")
    # A study from a device this server can neither see nor find in its catalogue.
    seed_study(url, "elsewhere", 20, seed=7, fingerprint={"family": "cuda", "device": "Mystery GPU X1"})
    optuna.load_study(study_name="elsewhere", storage=get_storage(url)).set_user_attr(
        "recipe", recipe_from_dict(TINY).to_dict()
    )
    return {"url": url, "predicted": predicted, "plain": plain}


@pytest.fixture(scope="module")
def client(db):
    with TestClient(create_app(Settings(database_url=db["url"], public_reads=True))) as c:
        yield c


def _study(db, key):
    with session_scope(db["url"]) as s:
        return read_study(s, s.get(Job, db[key]).study_name)


def _get(client, path):
    resp = client.get(path)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_predicted_against_measured_counts_every_predicted_trial(client, db):
    p = _get(client, f"/ui/api/jobs/{db['predicted']}/plots")["predictions"]
    study = _study(db, "predicted")
    pairs = [
        (t.attrs[keys.PREDICTED_TOKENS_PER_S], t.tokens_per_s)
        for t in study.trials
        if t.completed and t.tokens_per_s and t.attrs.get(keys.PREDICTED_TOKENS_PER_S)
    ]
    assert p["total"] == len(pairs) > 200
    assert p["sampled"] == len(p["number"]) == len(p["predicted"]) <= SAMPLE_LIMIT
    assert p["median_error"] == pytest.approx(float(np.median(prediction_error(*zip(*pairs, strict=True)))))
    assert 0.5 < p["inside_interval"] <= 1.0  # seeded: 15% error against a 90% interval of +-39%
    assert set(p["chosen_by"]) <= {"model", "queue"}
    # A study whose trials were never predicted says so with an empty series.
    assert _get(client, f"/ui/api/jobs/{db['plain']}/plots")["predictions"] == {"total": 0, "sampled": 0}


def test_the_plan_ranks_configs_and_says_what_the_study_measured_for_each(client, db):
    plan = _get(client, f"/ui/api/jobs/{db['predicted']}/plan")
    study = _study(db, "predicted")
    ranking = study.ranking()
    assert plan["available"] and len(plan["rows"]) == study_plan.TOP
    assert [r["rank"] for r in plan["rows"]] == list(range(1, study_plan.TOP + 1))
    ran = [t for t in study.trials if t.status in ("ok", "oom")]
    # The seeder draws a few configs whose micro-batch x dp does not divide the global batch (16);
    # a real study prunes those before they run, and the plan learns nothing from them.
    fits = sum(16 % (t.config().micro_batch_size * t.config().dp) == 0 for t in ran)
    assert plan["learnable"] == len(ran) and plan["fitted"] == fits < len(ran)
    assert f"fitted to {fits} of this study's {len(ran)} measured trials" in plan["basis"]
    predicted = [r["tokens_per_s"] for r in plan["rows"]]
    assert predicted[0] >= predicted[-1]
    by_trial = {r.trial: (i, r) for i, r in enumerate(ranking.ranked, 1)}
    for row in plan["rows"]:
        if row["study"] and row["study"]["study_rank"]:
            rank, ranked = by_trial[row["study"]["trial"]]
            assert row["study"]["study_rank"] == rank
            assert row["study"]["tokens_per_s"] == pytest.approx(ranked.tokens_per_s)
    best = plan["study_best"]
    assert best["trial"] == ranking.best.trial
    assert best["tokens_per_s"] == pytest.approx(ranking.best.tokens_per_s)
    assert best["plan_rank"] is None or best["plan_rank"] >= 1
    # Computed once per version of the study: the second read is the same answer.
    assert _get(client, f"/ui/api/jobs/{db['predicted']}/plan") == plan


def test_a_large_study_fits_an_evenly_spaced_share_of_its_trials(db, monkeypatch):
    monkeypatch.setattr(study_plan, "MAX_FIT", 50)
    study = _study(db, "predicted")
    recipe = study.recipe or _job_recipe(db)
    plan = study_plan.study_plan(recipe, study.fingerprint, study.trials, study.ranking())
    assert 40 < plan.fitted <= 50 < plan.learnable  # 50 picked; a few seeded ones are no config of the recipe
    assert "(evenly spaced)" in plan.basis


def test_a_study_from_another_cpu_of_the_same_name_says_its_plan_uses_this_servers_priors(db):
    """Hosts of several generations all call themselves "AMD EPYC": the plan of a study measured
    on another CPU model says its priors are this server's, and one measured here does not."""
    from tuner.devices import cpu_model_id, describe

    study = _study(db, "predicted")
    recipe = study.recipe or _job_recipe(db)
    here = {**study.fingerprint, "family": "cpu", "device": describe("cpu").name}
    elsewhere = study_plan.study_plan(
        recipe,
        {**here, "cpu_model": "vendor_id=OtherVendor cpu_family=1 model=1"},
        study.trials,
        study.ranking(),
    )
    assert elsewhere.available and "CPU priors from this server's" in elsewhere.basis
    assert cpu_model_id() in elsewhere.basis
    same = study_plan.study_plan(recipe, {**here, "cpu_model": cpu_model_id()}, study.trials, study.ranking())
    assert same.available and "CPU priors" not in same.basis


def _job_recipe(db):
    with session_scope(db["url"]) as s:
        return s.get(Job, db["predicted"]).recipe


def test_no_plan_for_a_device_this_server_cannot_describe(client):
    plan = _get(client, "/ui/api/studies/elsewhere/plan")
    assert not plan["available"] and plan["rows"] == []
    assert "Mystery GPU X1" in plan["reason"] and "cannot describe" in plan["reason"]


def test_the_plan_of_a_study_from_another_cpu_starts_from_the_priors_that_cpu_measured(db):
    """A study run on other machines (a Ray cluster's nodes, or a worker that is not the API host)
    keeps what its devices measured of themselves; the job page's plan starts from those."""
    from tuner.perf.priors import DevicePriors

    job = seed_job(db["url"], 30, seed=8, name="gpt-nodes", state="running")
    with session_scope(db["url"]) as s:
        name = s.get(Job, job).study_name
    measured = DevicePriors(
        family="cpu", efficiency=0.7, half_tokens=32.0, peak_flops={"fp32": 9e10, "bf16": 2e11},
        bandwidth=2e8, latency=3e-3, host_unit_s=2e-4, node_devices=1 << 30, cross_node_share=1.0, cores=8,
    )  # fmt: skip
    study = optuna.load_study(study_name=name, storage=get_storage(db["url"]))
    study.set_user_attr(keys.FINGERPRINT, {**study.user_attrs[keys.FINGERPRINT], "cpu": "Node CPU 9000"})
    with TestClient(create_app(Settings(database_url=db["url"], public_reads=True))) as client:
        without = _get(client, f"/ui/api/jobs/{job}/plan")
        assert without["available"] and "CPU priors from this server's" in without["basis"]
        study.set_user_attr(keys.DEVICE_PRIORS, measured.to_dict())
        plan = _get(client, f"/ui/api/jobs/{job}/plan")
    assert plan["available"] and "CPU priors as the study's Node CPU 9000 measured them" in plan["basis"]
    assert [r["tokens_per_s"] for r in plan["rows"]] != [r["tokens_per_s"] for r in without["rows"]]
