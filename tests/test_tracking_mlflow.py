"""MLflow logging by the study driver (TUNER_MLFLOW_TRACKING_URI), against a real MLflow file store
read back with MLflow's own client: one run per finished trial (knobs as params, result keys as
metrics), the study as the experiment, the winner tagged with the figure every view shows.

The executor is the in-test one of tests/test_study.py (the logic under test is the driver's
logging, not a measurement); the study, its storage and MLflow's store are real."""

from __future__ import annotations

import pytest
from test_study import NARROW, FakeExecutor, make_recipe

from tuner.study import run_study
from tuner.summary import summarize

mlflow = pytest.importorskip("mlflow", reason="MLflow is not installed: pip install -e '.[mlflow]'")


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("TUNER_MLFLOW_TRACKING_URI", uri)
    # MLflow 3 keeps its file store in maintenance mode, behind this opt-in.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


def test_each_finished_trial_is_an_mlflow_run_and_the_winner_is_tagged(store, tmp_path):
    from mlflow.tracking import MlflowClient

    url = f"sqlite:///{tmp_path}/study.db"
    recipe = make_recipe("tracked", {**NARROW, "micro_batch_size": [1, 2, 4], "amp": ["O0", "O1"]})
    summary = run_study(
        recipe, storage_url=url, executor=FakeExecutor(again={4: 0.96}), workdir=tmp_path, trials=5,
        sampler="random", remeasure_top=2,
    )  # fmt: skip

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name(summary.study_name)
    assert experiment is not None, "the study is the experiment"
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    trials = {int(r.data.tags["tuner.trial"]): r for r in runs}
    assert len(trials) == len(runs) == sum(summary.counts.values()), (
        f"one run per finished trial: {summary.counts}"
    )
    ok = [r for r in runs if r.data.tags["tuner.status"] == "ok"]
    assert ok and all(r.data.metrics["tokens_per_s"] > 0 for r in ok)
    for r in ok:
        assert {"micro_batch_size", "amp"} <= set(r.data.params), r.data.params
    winners = [r for r in runs if r.data.tags.get("tuner.winner") == "true"]
    assert len(winners) == 1
    (winner,) = winners
    assert int(winner.data.tags["tuner.trial"]) == summary.best.trial
    assert winner.data.params["micro_batch_size"] == str(summary.best.config["micro_batch_size"])
    # The figure every view shows: the median over re-measurements, not the first measurement.
    assert winner.data.metrics["winner_tokens_per_s"] == pytest.approx(summary.best.tokens_per_s)
    assert winner.data.metrics["winner_tokens_per_s"] < winner.data.metrics["tokens_per_s"]
    assert client.get_experiment(experiment.experiment_id).tags["tuner.winner_trial"] == str(
        summary.best.trial
    )
    assert summarize(summary.study_name, url).best.trial == summary.best.trial


def test_without_the_setting_nothing_is_logged_and_a_broken_store_does_not_stop_the_study(
    tmp_path, monkeypatch
):
    url = f"sqlite:///{tmp_path}/study.db"
    recipe = make_recipe("untracked", {**NARROW, "micro_batch_size": [1, 2]})
    monkeypatch.delenv("TUNER_MLFLOW_TRACKING_URI", raising=False)
    run_study(recipe, storage_url=url, executor=FakeExecutor(), workdir=tmp_path, trials=2, remeasure_top=0)
    assert not (tmp_path / "mlruns").exists()
    # A store that cannot be written (a file where the folder should be): the study still ends.
    (tmp_path / "blocked").write_text("not a folder")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("TUNER_MLFLOW_TRACKING_URI", (tmp_path / "blocked" / "mlruns").as_uri())
    summary = run_study(
        make_recipe("still-runs", {**NARROW, "micro_batch_size": [1, 2]}), storage_url=url,
        executor=FakeExecutor(), workdir=tmp_path, trials=2, remeasure_top=0,
    )  # fmt: skip
    assert summary.best is not None
