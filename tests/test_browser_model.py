"""The job page's performance-model panel in headless Chromium, against a real `tuner serve
--workers 0` (the API alone) on a free loopback port over a real SQLite database: a seeded study
whose trials carry the model sampler's predictions shows them against what was measured, with the line of a
perfect prediction and how far they missed, and the plan fitted to the study's own trials, drawn
after the page's first view, with what the study measured for each planned config."""

from __future__ import annotations

import numpy as np
import pytest
from seed import seed_job
from test_api_server import Server
from test_browser_dashboard import SHOTS

from tuner.db import Job, session_scope
from tuner.migrations import upgrade
from tuner.perf.predictor import prediction_error
from tuner.record import keys
from tuner.record.reader import read_study

pytestmark = pytest.mark.slow

NARROW = {
    "micro_batch_size": [1, 2, 4, 8], "dp_shard": ["ddp"], "pp_schedule": ["1f1b"], "recompute": ["none", "full"],
    "recompute_layers": [1.0], "sequence_parallel": [False], "attention": ["math"], "bucket_mb": [25],
    "grad_compression": ["none"], "amp": ["O0", "O2"], "compile": ["none", "default"], "optimizer_impl": ["foreach"],
    "loader_workers": [0], "cpu_affinity": ["none"],
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("model-page")
    url = f"sqlite:///{d / 'tuner.db'}"
    upgrade(url)
    # A space of 96 configs, so that 300 seeded trials measured most of what the plan ranks first.
    predicted = seed_job(url, 300, seed=5, predictions=True, name="gpt-model", overrides=NARROW)
    plain = seed_job(url, 30, seed=6, name="gpt-tpe")
    # The API alone: the seeded jobs are finished and no worker may pick anything up.
    api = Server(d, url, workers=0, TUNER_PUBLIC_READS="true")
    api.start()
    try:
        yield {"base": api.base, "url": url, "predicted": predicted, "plain": plain}
    finally:
        api.stop()


@pytest.fixture
def page(browser):
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    pg.close()
    assert not errors, errors


def _study(server, key):
    with session_scope(server["url"]) as s:
        return read_study(s, s.get(Job, server[key]).study_name)


def test_predictions_against_measurements_and_the_plan_beside_the_study(server, page):
    page.goto(f"{server['base']}/ui/jobs/{server['predicted']}")
    page.wait_for_function("window.__dashboard && window.__dashboard.ready", timeout=30_000)
    study = _study(server, "predicted")
    pairs = [
        (t.attrs[keys.PREDICTED_TOKENS_PER_S], t.tokens_per_s)
        for t in study.trials
        if t.completed and t.tokens_per_s and t.attrs.get(keys.PREDICTED_TOKENS_PER_S)
    ]
    median = float(np.median(prediction_error(*zip(*pairs, strict=True))))

    legend = page.locator("#plot-predicted .legend").text_content()
    assert "predicted = measured" in legend and "chosen by model" in legend
    points = page.locator("#plot-predicted .scatterlayer .trace path.point").count()
    assert points == len(pairs)  # under 500: every predicted trial is a point
    note = page.inner_text("#predicted-note")
    assert f"{median * 100:.1f}% over {len(pairs):,} trials" in note, note
    assert "measured inside the predicted 90% interval" in note

    # The plan arrives after the first view, never before it.
    page.wait_for_function("window.__dashboard.planReady === true", timeout=60_000)
    timings = page.evaluate("window.__dashboard.timings")
    assert timings["plan_drawn"] >= timings["plots_drawn"]
    rows = page.locator("#plan-table tbody tr")
    assert rows.count() == 10
    assert [rows.nth(i).locator("td").first.inner_text() for i in range(10)] == [str(i) for i in range(1, 11)]
    assert "no device run" in page.inner_text("#plan-basis")
    best = study.ranking().best
    said = page.inner_text("#plan-best")
    assert f"The study's best, #{best.trial} at {best.tokens_per_s:,.0f} tokens/s, is" in said, said
    # Each row says what the study measured for that config: its figure and place, or its failure.
    places = {r.trial: (i, r.tokens_per_s) for i, r in enumerate(study.ranking().ranked, 1)}
    statuses = {t.number: t.status for t in study.trials}
    tried = measured = 0
    for i in range(10):
        said = rows.nth(i).locator("td").last.inner_text()
        if rows.nth(i).get_attribute("data-tried") == "no":
            assert said == "not tried"
            continue
        tried += 1
        number = int(said.split(" in #")[1].split()[0])
        if number in places:
            rank, tokens = places[number]
            assert said == f"{tokens:,.0f} tokens/s in #{number} · the study's #{rank}", said
            measured += 1
        else:
            assert said.startswith(statuses[number]), said
    assert tried >= 5
    assert f"The study measured {measured} of the plan's top 10." in page.inner_text("#plan-best")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#model-section").screenshot(path=str(SHOTS / "job-model.png"))


def test_a_study_the_model_never_predicted_says_so(server, page):
    page.goto(f"{server['base']}/ui/jobs/{server['plain']}")
    page.wait_for_function("window.__dashboard && window.__dashboard.ready", timeout=30_000)
    assert page.inner_text("#predicted-note").startswith("No predictions:")
    assert page.locator("#plot-predicted .main-svg").count() == 0
    page.wait_for_function("window.__dashboard.planReady === true", timeout=60_000)
    assert page.locator("#plan-table tbody tr").count() == 10  # the plan needs measurements, not predictions
