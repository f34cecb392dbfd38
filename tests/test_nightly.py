"""Nightly logic that needs no trial: thresholds, verdicts, the history table (real SQLite, real
migrations), which night is compared with which, the report, and bad input (exit 2)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math

import pytest
from typer.testing import CliRunner

from tuner import nightly as nl
from tuner.cli.main import app
from tuner.recipe import recipe_from_dict

RECIPE = recipe_from_dict(
    {"name": "gpt-nightly", "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256}}
)
NIGHT1, NIGHT2, NIGHT3 = dt.date(2026, 11, 27), dt.date(2026, 11, 28), dt.date(2026, 11, 29)
FP_A = {"device": "cpu-a", "torch": "2.12.0"}
FP_B = {"device": "cpu-a", "torch": "2.13.0"}


@pytest.fixture
def db_url(tmp_path):
    from tuner.migrations import upgrade

    url = f"sqlite:///{tmp_path}/nightly.db"
    upgrade(url)
    return url


def fixed(
    tokens_per_s: float | None, fp: dict, mbs: int = 4, error: str | None = None, ci: float | None = None
):
    """A stand-in for tonight's tuning (the end-to-end test runs the real one); `ci`: the relative
    half-width of the best's 95% interval, as the ranking reports it."""
    seen: list[list[dict]] = []
    runs: list[int] = []

    def tune(recipe, enqueue, run):
        seen.append(enqueue)
        runs.append(run)
        config = {"micro_batch_size": mbs, "dp": 1} if tokens_per_s else None
        return nl.Tonight(tokens_per_s, config, fp, fp_hash(fp), error=error, best_ci=ci)

    tune.seen, tune.runs = seen, runs
    return tune


def fp_hash(fp: dict) -> str:
    return f"{fp['device']}/{fp['torch']}"


def run(db_url, night, tune, threshold=0.05):
    expected = fp_hash(FP_A)
    return nl.run_recipe(
        RECIPE,
        "r.yaml",
        night=night,
        threshold=threshold,
        tune=tune,
        expected_fingerprint_hash=expected,
        db_url=db_url,
    )


@pytest.mark.parametrize("text,value", [("5%", 0.05), ("0.05", 0.05), (" 12.5% ", 0.125), ("0", 0.0)])
def test_threshold_accepts_percent_or_fraction(text, value):
    assert nl.parse_threshold(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["five", "5%%", "150%", "-1%"])
def test_bad_threshold_names_the_option(text):
    with pytest.raises(nl.NightlyError, match="--fail-on-regression"):
        nl.parse_threshold(text)


def test_verdicts_use_the_threshold_both_ways():
    assert nl.judge(None, 100.0, 0.05) == ("failed", None)
    assert nl.judge(100.0, None, 0.05) == ("first_run", None)
    assert nl.judge(90.0, 100.0, 0.05) == ("regression", pytest.approx(-10.0))
    assert nl.judge(97.0, 100.0, 0.05)[0] == "unchanged"
    assert nl.judge(110.0, 100.0, 0.05)[0] == "improved"
    assert nl.judge(97.0, 100.0, 0.02)[0] == "regression"


def test_history_one_row_per_night_and_rerun_replaces_it(db_url):
    from sqlalchemy import select

    from tuner.db import NightlyResult, session_scope

    first = run(db_url, NIGHT1, fixed(1000.0, FP_A))
    assert first.verdict == "first_run"
    run(db_url, NIGHT2, fixed(700.0, FP_A))
    again = run(db_url, NIGHT2, fixed(990.0, FP_A))  # the same night, re-run: replaces
    assert (again.verdict, round(again.change_pct, 1)) == ("unchanged", -1.0)
    with session_scope(db_url) as s:
        rows = s.scalars(select(NightlyResult).order_by(NightlyResult.night)).all()
        assert [(r.night, r.best_tokens_per_s, r.verdict) for r in rows] == [
            (NIGHT1, 1000.0, "first_run"),
            (NIGHT2, 990.0, "unchanged"),
        ]
        assert rows[1].previous_best_tokens_per_s == 1000.0
        assert rows[1].config == {"micro_batch_size": 4, "dp": 1}


def named(tokens_per_s: float, night: dt.date):
    """A stand-in that, like both real tuners, measures in the study `run_tag` names for its run."""

    def tune(recipe, enqueue, run):
        tune.runs.append(run)
        study = nl.nightly_study_name(recipe, FP_A, night, run)
        return nl.Tonight(
            tokens_per_s, {"micro_batch_size": 4, "dp": 1}, FP_A, fp_hash(FP_A), study_name=study
        )

    tune.runs = []
    return tune


def test_every_run_of_a_night_gets_its_own_study_and_job_name_from_one_rule():
    from tuner.artifacts import check_study_name

    assert (nl.run_tag(NIGHT2), nl.run_tag(NIGHT2, 3)) == ("nightly-2026-11-28", "nightly-2026-11-28-run3")
    local = [nl.nightly_study_name(RECIPE, FP_A, NIGHT2, run) for run in (1, 2, 3)]
    jobs = [nl.nightly_job_name(RECIPE, NIGHT2, run) for run in (1, 2, 3)]
    assert local[0].endswith("-nightly-2026-11-28") and local[1:] == [local[0] + "-run2", local[0] + "-run3"]
    assert jobs == [f"gpt-nightly@nightly-2026-11-28{s}" for s in ("", "-run2", "-run3")]
    # The dashboard links each job to the recipe's nightly history, kept under the recipe's name.
    assert {nl.history_name(job) for job in jobs} == {RECIPE.name}
    assert nl.history_name("team/gpt@v2") == "team/gpt@v2"
    for name in local:
        check_study_name(name)  # study names name build directories
    # The service's study name is the job's name, then the recipe hash and the fingerprint hash.
    service = [f"{job}-{RECIPE.hash()}-3dca968c" for job in jobs]
    assert [nl.parse_run(name, NIGHT2) for name in local + service] == [1, 2, 3, 1, 2, 3]
    assert nl.parse_run(local[1], NIGHT1) is None and nl.parse_run(None, NIGHT2) is None
    with pytest.raises(ValueError, match="count from 1"):
        nl.run_tag(NIGHT2, 0)


@pytest.mark.parametrize("length", [90, 185])
def test_a_long_recipe_name_keeps_each_nights_tag_in_the_services_study_name(length):
    """The service's study name keeps 100 characters of the job's name: the night's tag must be
    among them, or every night after the first would resume night 1's finished study."""
    from tuner.study.naming import study_name

    recipes = [recipe_from_dict({**RECIPE.to_dict(), "name": "x" * (length - 1) + end}) for end in "ab"]
    studies = {}
    for recipe in recipes:
        for night, run in ((NIGHT2, 1), (NIGHT2, 2), (NIGHT3, 1)):
            job = nl.nightly_job_name(recipe, night, run)
            assert len(job) <= 200  # what the service accepts as a recipe's name
            service = study_name(recipe_from_dict({**recipe.to_dict(), "name": job}), FP_A)
            assert nl.parse_run(service, night) == run
            studies[(recipe.name, night, run)] = service
    assert len(set(studies.values())) == 6  # every night, run and recipe in a study of its own


def test_rerunning_a_recorded_night_measures_again_and_an_unrecorded_one_resumes(db_url):
    from sqlalchemy import select

    from tuner.db import NightlyResult, session_scope

    run(db_url, NIGHT1, named(1000.0, NIGHT1))
    # Nothing recorded for tonight (also after a first run killed with -9): run 1, resuming its study.
    assert nl.tonight_run(RECIPE.name, NIGHT2, db_url) == 1
    first = run(db_url, NIGHT2, named(1000.0, NIGHT2))
    # Recorded: its study's budget is spent, so a re-run is run 2, in a study of its own; until run
    # 2 records, a killed run 2 is resumed the same way.
    assert nl.tonight_run(RECIPE.name, NIGHT2, db_url) == 2
    tune = named(800.0, NIGHT2)
    again = run(db_url, NIGHT2, tune)
    assert (tune.runs, first.run, again.run) == ([2], 1, 2)
    assert again.study_name == first.study_name + "-run2"
    # Compared with the latest earlier night, as the first run was, not with the first run.
    assert (again.verdict, again.previous_night, round(again.change_pct)) == ("regression", NIGHT1, -20)
    assert nl.exit_code([again]) == 1
    with session_scope(db_url) as s:
        row = s.scalar(select(NightlyResult).where(NightlyResult.night == NIGHT2))
        assert (row.best_tokens_per_s, row.verdict, row.study_name) == (800.0, "regression", again.study_name)
    assert run(db_url, NIGHT2, named(990.0, NIGHT2)).run == 3


def test_a_rerun_that_failed_before_opening_a_study_keeps_the_count(db_url):
    from sqlalchemy import select

    from tuner.db import NightlyResult, session_scope

    run(db_url, NIGHT2, named(1000.0, NIGHT2))
    second = run(db_url, NIGHT2, named(1000.0, NIGHT2))

    def boom(recipe, enqueue, run):
        raise RuntimeError("ray cluster unreachable")

    failed = run(db_url, NIGHT2, boom)
    assert (failed.run, failed.verdict, failed.study_name) == (3, "failed", None)
    assert nl.exit_code([failed]) == 1  # tonight's report says the re-run failed
    with session_scope(db_url) as s:
        row = s.scalar(select(NightlyResult).where(NightlyResult.night == NIGHT2))
        # The night keeps run 2's measured result, and its trials are still run 2's, so the next
        # re-run never lands in a finished study.
        assert (row.verdict, row.best_tokens_per_s, row.study_name) == (
            second.verdict,
            1000.0,
            second.study_name,
        )
    assert nl.tonight_run(RECIPE.name, NIGHT2, db_url) == 3


def test_a_failed_rerun_keeps_the_nights_result_for_the_next_night(db_url):
    """A re-run that crashes must not wipe the night it re-ran: the next night is compared with
    that night's measured best, not with an older one (which would hide a regression)."""
    run(db_url, NIGHT1, named(1000.0, NIGHT1))
    run(db_url, NIGHT2, named(1300.0, NIGHT2))

    def opened_then_failed(recipe, enqueue, run):
        return nl.Tonight(
            None, None, {}, "fp", study_name=f"gpt-tiny-nightly-{NIGHT2}-run{run}", error="ray lost"
        )

    failed = run(db_url, NIGHT2, opened_then_failed)
    assert failed.verdict == "failed"
    night3 = run(db_url, NIGHT3, named(1010.0, NIGHT3))
    assert (night3.previous_night, night3.verdict, round(night3.change_pct)) == (NIGHT2, "regression", -22)
    # The failed run 2 opened a study: a further re-run comes after it, in a study of its own.
    assert failed.run == 2
    assert nl.tonight_run(RECIPE.name, NIGHT2, db_url) == 3


def test_last_nights_best_remeasured_tonight_is_given_as_tonights_best_is(db_url):
    """The report sets last night's best config, measured again tonight, beside tonight's best:
    both are the median over the trial and its re-measurements, not its first run against a median."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import create_trial

    from tuner.nightly.tuners import _measured
    from tuner.space import config_from_params, trial_params
    from tuner.summary import summarize

    config = {"micro_batch_size": 4, "dp": 1}
    params = trial_params(config_from_params(config))
    study = optuna.create_study(study_name="n-nightly", storage=db_url, direction="maximize")
    attrs = {"status": "ok", "tokens_per_s": 950.0, "step_time_ci": 0.01}
    dists = {k: CategoricalDistribution([v]) for k, v in params.items()}
    study.add_trial(create_trial(params=params, distributions=dists, value=950.0, user_attrs=attrs))
    study.set_user_attr("remeasured:0", [1010.0, 1000.0])
    assert summarize("n-nightly", db_url).best.tokens_per_s == 1000.0
    assert _measured("n-nightly", db_url, [config]) == 1000.0


def test_local_rerun_measures_again_in_a_fresh_study(db_url, monkeypatch):
    """The reported fault: run_study's budget counts the whole study (that is how a killed run
    resumes), so a re-run in the first run's study ran 0 trials and reported the first run's best."""
    import contextlib
    import types

    import tuner.executors
    import tuner.study
    from tuner.fingerprint import described_here
    from tuner.record.ranking import Ranked
    from tuner.summary import StudySummary

    studies: dict[str, list[float]] = {}
    machine = {"tokens_per_s": 1000.0}

    def run_study(recipe, *, trials, study_name, **kwargs):
        done = studies.setdefault(study_name, [])
        done += [machine["tokens_per_s"]] * (trials - len(done))
        best = Ranked(0, {"micro_batch_size": 4, "dp": 1}, max(done), [], 0.0, {}, None, True)
        return StudySummary(study_name, db_url, best=best, counts={"ok": len(done)})

    monkeypatch.setattr(tuner.study, "run_study", run_study)
    # This machine's executor as far as the nightly asks it (what and where its devices are).
    here = types.SimpleNamespace(name="local", describe=described_here)
    monkeypatch.setattr(tuner.executors, "make_executor", lambda name: contextlib.nullcontext(here))
    tune = nl.local_tuner(night=NIGHT2, trials=2, storage_url=db_url)
    run(db_url, NIGHT1, fixed(1000.0, FP_A))
    first = run(db_url, NIGHT2, tune)
    machine["tokens_per_s"] = 700.0  # the machine became slower between the two runs
    again = run(db_url, NIGHT2, tune)
    assert again.study_name == first.study_name + "-run2" and studies[first.study_name] == [1000.0] * 2
    assert (again.trials, again.best_tokens_per_s, again.verdict) == (2, 700.0, "regression")
    assert again.previous_night == NIGHT1 and nl.exit_code([again]) == 1


def test_api_rerun_submits_a_job_of_its_own(db_url, monkeypatch):
    import httpx

    posted: list[str] = []
    studies: dict[str, float] = {}  # the service's studies, keyed by the job's name (tuner.worker)
    machine = {"tokens_per_s": 1000.0}

    def service(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer T"
        if request.method == "POST":
            name = json.loads(request.content)["name"]
            posted.append(name)
            # A recipe with `search.reuse: false`: the service's study name ends with the job's id.
            study = f"{name}-{RECIPE.hash()}-3dca968c-job{len(posted)}"
            studies.setdefault(study, machine["tokens_per_s"])  # an existing study's budget is spent
            job = {"id": len(posted), "state": "succeeded", "trials_done": 2, "trials_total": 2}
            return httpx.Response(201, json={**job, "study_name": study})
        if request.url.path.endswith("/best"):
            n = int(request.url.path.split("/")[3])
            study = f"{posted[n - 1]}-{RECIPE.hash()}-3dca968c-job{n}"
            fp = {"fingerprint": {"family": "cpu", "device": "node"}, "fingerprint_hash": "3dca968c"}
            return httpx.Response(
                200, json={"tokens_per_s": studies[study], "config": {"micro_batch_size": 4}, **fp}
            )
        return httpx.Response(200, json={"items": []})

    real_client = httpx.Client
    monkeypatch.setattr(
        httpx, "Client", lambda **kw: real_client(transport=httpx.MockTransport(service), **kw)
    )
    tune = nl.api_tuner("http://tuner:8000", "T", night=NIGHT2, trials=2, storage_url=db_url)
    run(db_url, NIGHT1, fixed(1000.0, FP_A))
    first = run(db_url, NIGHT2, tune)
    machine["tokens_per_s"] = 700.0
    again = run(db_url, NIGHT2, tune)
    assert posted == ["gpt-nightly@nightly-2026-11-28", "gpt-nightly@nightly-2026-11-28-run2"]
    assert (first.job_id, again.job_id, again.run) == (1, 2, 2)
    assert again.study_name.startswith("gpt-nightly@nightly-2026-11-28-run2-")
    assert (again.best_tokens_per_s, again.verdict, again.previous_night) == (700.0, "regression", NIGHT1)
    # The fingerprint is the service's record of it (this history database holds no such study).
    assert (first.fingerprint_hash, again.fingerprint_hash) == ("3dca968c", "3dca968c")


def test_api_night_whose_job_no_worker_takes_is_cancelled_and_fails_instead_of_waiting(db_url, monkeypatch):
    """The real service with no worker running: the cron run gives up after the recipe's time
    limit and the grace, cancels the job, and says why, instead of waiting forever unreported."""
    import httpx
    from fastapi.testclient import TestClient

    from api import Settings, create_app
    from api.auth import create_token
    from tuner.db import Job, session_scope

    app = create_app(Settings(database_url=db_url, max_trials=50, max_timeout_min=60, max_body_bytes=65536))
    with session_scope(db_url) as s:
        token = create_token(s, "nightly")
    with TestClient(app) as service:  # no worker: `tuner serve` would start one, the app does not
        monkeypatch.setattr(httpx, "Client", lambda base_url, headers, timeout: _bound(service, headers))
        quick = recipe_from_dict({**RECIPE.to_dict(), "search": {"timeout_min": 0.01}})  # 0.6 s
        tune = nl.api_tuner("http://tuner:8000", token, night=NIGHT1, trials=2, storage_url=db_url,
                            poll_s=0.05, grace_min=0.0)  # fmt: skip
        out = nl.run_recipe(quick, "r.yaml", night=NIGHT1, threshold=0.05, tune=tune, db_url=db_url)
    assert out.verdict == "failed" and nl.exit_code([out]) == 1
    assert "still queued after 0.01 min; no worker took it" in out.error and "cancelled it" in out.error
    with session_scope(db_url) as s:
        assert s.get(Job, out.job_id).state == "cancelled"


def _bound(client, headers):
    """The test client with the nightly's headers, used as `httpx.Client(...)` is (a context)."""
    client.headers.update(headers)
    return contextlib.nullcontext(client)


def test_warm_start_is_last_nights_best_and_regression_fails_the_run(db_url):
    run(db_url, NIGHT1, fixed(1000.0, FP_A, mbs=8))
    tune = fixed(800.0, FP_A)
    out = run(db_url, NIGHT2, tune)
    assert tune.seen == [[{"micro_batch_size": 8, "dp": 1}]]
    assert (out.verdict, out.previous_night, round(out.change_pct)) == ("regression", NIGHT1, -20)
    assert nl.exit_code([out]) == 1


def test_changed_fingerprint_is_reported_and_compared_anyway(db_url):
    run(db_url, NIGHT1, fixed(1000.0, FP_A))
    out = run(db_url, NIGHT2, fixed(1200.0, FP_B))
    assert out.fingerprint_changed and out.verdict == "improved"
    assert out.fingerprint_changes == {"torch": ["2.12.0", "2.13.0"]}
    # The next night on B compares with B's own history, not with A's.
    out3 = run(db_url, NIGHT3, fixed(1190.0, FP_B))
    assert (out3.previous_night, out3.fingerprint_changed, out3.verdict) == (NIGHT2, False, "unchanged")


def test_a_drop_inside_the_two_nights_measurement_noise_is_not_a_regression(db_url, tmp_path):
    """On a machine whose runs differ by more than the threshold (a shared CPU: about +-7% per
    night's best), an 8% lower best is noise; on one measured to +-1% it is a regression."""
    run(db_url, NIGHT1, fixed(1000.0, FP_A, ci=0.07))
    noisy = run(db_url, NIGHT2, fixed(920.0, FP_A, ci=0.07))
    assert noisy.verdict == "unchanged" and round(noisy.change_pct) == -8
    assert noisy.band_pct == pytest.approx(100 * math.hypot(70, 64.4) / 1000)  # 9.5%: the tie rule's
    assert nl.exit_code([noisy]) == 0
    md = nl.render_markdown([noisy], NIGHT2, 0.05)
    assert "-8.0% (band ±9.5%)" in md and "a change counts beyond ±9.5%, not ±5%" in md
    # Beyond the noise it still is one, and a precise night is held to the threshold.
    assert run(db_url, NIGHT3, fixed(780.0, FP_A, ci=0.07)).verdict == "regression"  # -15% of 920
    url = f"sqlite:///{tmp_path}/precise.db"
    from tuner.migrations import upgrade

    upgrade(url)
    run(url, NIGHT1, fixed(1000.0, FP_A, ci=0.01))
    precise = run(url, NIGHT2, fixed(920.0, FP_A, ci=0.01))
    assert precise.verdict == "regression" and precise.band_pct == pytest.approx(5.0)


@pytest.mark.parametrize(("ci", "verdict"), [(0.01, "regression"), (0.07, "unchanged")])
def test_a_slow_decline_within_each_nights_band_is_a_regression_against_the_earlier_nights(
    db_url, ci, verdict
):
    """Each night a few percent below the one before never leaves that night's band; against the
    median of the earlier nights it does, where the machine measures precisely enough to tell."""
    nights = [NIGHT1 + dt.timedelta(days=d) for d in range(5)]
    outs = [
        run(db_url, n, fixed(best, FP_A, ci=ci))
        for n, best in zip(nights, (1000, 985, 1000, 960, 925), strict=True)
    ]
    assert [o.verdict for o in outs[1:4]] == ["unchanged"] * 3
    last = outs[4]
    assert round(last.change_pct, 1) == -3.6 and last.drift_nights == 4  # vs 960; the median of four is 992.5
    assert last.drift_pct == pytest.approx((925 - 992.5) / 992.5 * 100)
    assert last.verdict == verdict and nl.exit_code([last]) == (verdict == "regression")
    md = nl.render_markdown([last], nights[4], 0.05)
    assert ("A slow decline: tonight's best is -6.8% from the median best of the last 4 nights" in md) == (
        verdict == "regression"
    )


def test_a_night_that_recovers_part_of_a_regression_is_still_one(db_url):
    """Above the night before, but still far below the recent nights: the regression stays
    flagged until the recipe is back within the band of its history."""
    nights = [NIGHT1 + dt.timedelta(days=d) for d in range(5)]
    outs = [
        run(db_url, n, fixed(best, FP_A, ci=0.01))
        for n, best in zip(nights, (1000, 1000, 1000, 700, 750), strict=True)
    ]
    assert outs[3].verdict == "regression"
    last = outs[4]
    assert round(last.change_pct, 1) == 7.1 and last.drift_pct == pytest.approx(-25.0)
    assert last.verdict == "regression" and nl.exit_code([last]) == 1
    md = nl.render_markdown([last], nights[4], 0.05)
    assert "Still below the recent nights: tonight's best is -25.0%" in md and "above the night before" in md


def test_a_narrowed_search_space_is_an_edited_recipe_not_a_regression(db_url):
    """The nightly compares the best over the whole space: narrowing it (no compile, say) can lower
    the best with nothing regressed, so it starts the recipe's history like any other edit."""
    run(db_url, NIGHT1, fixed(1000.0, FP_A, mbs=8))
    doc = RECIPE.to_dict()
    narrowed = recipe_from_dict({**doc, "search": {**doc["search"], "overrides": {"compile": ["none"]}}})
    assert narrowed.hash() == RECIPE.hash() and nl.night_key(narrowed) != nl.night_key(RECIPE)
    # A recipe at the default space keys as its nights were stored before the space counted.
    assert nl.night_key(RECIPE) == RECIPE.hash()
    out = nl.run_recipe(
        narrowed, "r.yaml", night=NIGHT2, threshold=0.05, tune=fixed(800.0, FP_A), db_url=db_url
    )
    assert (out.verdict, out.recipe_changed_since) == ("first_run", NIGHT1) and nl.exit_code([out]) == 0


def test_an_edited_recipe_starts_its_own_history_under_the_same_name(db_url):
    """A recipe edited between nights (another model) is not judged against the old one's best,
    nor warm-started from its configs; the report says why there is nothing to compare."""
    run(db_url, NIGHT1, fixed(1000.0, FP_A, mbs=8))
    edited = recipe_from_dict({**RECIPE.to_dict(), "model": {**RECIPE.to_dict()["model"], "hidden": 128}})
    assert edited.name == RECIPE.name and edited.hash() != RECIPE.hash()
    tune = fixed(300.0, FP_A)
    out = nl.run_recipe(edited, "r.yaml", night=NIGHT2, threshold=0.05, tune=tune, db_url=db_url)
    assert (out.verdict, out.previous_night, out.recipe_changed_since) == ("first_run", None, NIGHT1)
    assert tune.seen == [[]] and nl.exit_code([out]) == 0
    assert "The recipe changed since 2026-11-27" in nl.render_markdown([out], NIGHT2, 0.05)
    # The next night of the edited recipe compares with its own first night.
    again = nl.run_recipe(
        edited, "r.yaml", night=NIGHT3, threshold=0.05, tune=fixed(310.0, FP_A), db_url=db_url
    )
    assert (again.verdict, again.previous_night) == ("unchanged", NIGHT2)


def test_a_crash_is_a_failed_recipe_not_a_traceback(db_url):
    def boom(recipe, enqueue, run):
        raise RuntimeError("ray cluster unreachable")

    out = run(db_url, NIGHT1, boom)
    assert out.verdict == "failed" and "ray cluster unreachable" in out.error
    assert nl.exit_code([out]) == 1


def test_report_files_show_the_verdict_and_both_configs(db_url, tmp_path):
    run(db_url, NIGHT1, fixed(1000.0, FP_A, mbs=8))
    out = run(db_url, NIGHT2, fixed(800.0, FP_B, mbs=4))
    md_path, json_path = nl.write_report([out], tmp_path / "rep", NIGHT2, 0.05)
    md = md_path.read_text()
    assert "**REGRESSION**" in md and "-20.0%" in md and "1,000 (2026-11-27)" in md
    assert "| micro_batch_size | 8 | **4** |" in md
    assert "torch: 2.12.0 -> 2.13.0" in md
    doc = json.loads(json_path.read_text())
    assert doc["exit_code"] == 1 and doc["verdicts"]["regression"] == ["gpt-nightly"]
    assert doc["recipes"][0]["previous_config"] == {"micro_batch_size": 8, "dp": 1}


def test_seconds_until_next_daily_start():
    now = dt.datetime(2026, 11, 29, 1, 30)
    assert nl.seconds_until("02:00", now) == 30 * 60
    assert nl.seconds_until("01:00", now) == 23.5 * 3600
    assert nl.next_start("01:00", now) == dt.datetime(2026, 11, 30, 1, 0)
    with pytest.raises(nl.NightlyError, match="--daily-at"):
        nl.seconds_until("25:00", now)


@pytest.fixture
def berlin_time(monkeypatch):
    import time

    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_daily_start_across_a_clock_change_wakes_on_the_hour_for_the_night_scheduled(berlin_time):
    """The night clocks go forward is 23 hours long: sleeping a wall-clock day from 23:30 would wake
    at 00:30, a night late, and run that night twice while skipping the one scheduled."""
    now = dt.datetime(2026, 3, 28, 23, 30)  # Saturday 23:30 CET; at 02:00 on Sunday it is 03:00 CEST
    assert nl.next_start("23:30", now) == dt.datetime(2026, 3, 29, 23, 30)
    assert nl.seconds_until("23:30", now) == 23 * 3600
    autumn = dt.datetime(2026, 10, 24, 23, 30)  # the night clocks go back is 25 hours long
    assert nl.seconds_until("23:30", autumn) == 25 * 3600


def invoke(args, **kw):
    """Run the CLI; the output with rich's line wrapping undone."""
    result = CliRunner().invoke(app, args, **kw)
    return result.exit_code, " ".join(result.output.split())


def test_help_shows_examples_and_the_crontab():
    code, out = invoke(["nightly", "--help"])
    assert code == 0 and "Examples: tuner nightly recipes/nightly/ --local" in out
    assert "--night 2026-11-28" in out and "--api http://tuner:8000 --token T" in out
    assert "Crontab" in out and "0 2 * * *" in out


def test_report_folder_is_made_absolute_as_the_option_is_read(tmp_path, monkeypatch):
    import tuner.cli.nightly as cli

    passes = []
    monkeypatch.setattr(cli, "_ensure_schema", lambda storage: None)
    monkeypatch.setattr(
        cli, "_run_pass", lambda found, night, threshold, report, **kw: passes.append(report) or 0
    )
    (tmp_path / "a.yaml").write_text(
        "name: a\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 8, vocab: 64}\n"
    )
    monkeypatch.chdir(tmp_path)
    assert invoke(["nightly", "a.yaml", "--local", "--report", "reps"])[0] == 0
    assert invoke(["nightly", "a.yaml", "--local"])[0] == 0
    assert passes == [tmp_path.resolve() / "reps", tmp_path.resolve() / "nightly-reports"]


def test_bad_input_exits_2_with_the_fix(tmp_path):
    missing, missing_out = invoke(["nightly", str(tmp_path / "nope"), "--local"])
    assert missing == 2 and "no such folder" in missing_out

    (tmp_path / "a.yaml").write_text(
        "name: a\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 8, vocab: 64, x: 1}\n"
    )
    bad, bad_out = invoke(["nightly", str(tmp_path), "--local"])
    assert bad == 2 and "a.yaml: model.x: unknown field" in bad_out
    # A value PyYAML's own constructors cannot hold is bad input like any other, not a traceback.
    (tmp_path / "a.yaml").write_text("name: 2026-02-30\nmodel: {layers: 2, hidden: 64, heads: 4}\n")
    date, date_out = invoke(["nightly", str(tmp_path), "--local"])
    assert date == 2 and "a.yaml: not valid YAML or JSON" in date_out and "Traceback" not in date_out

    (tmp_path / "a.yaml").write_text(
        "name: a\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 8, vocab: 64}\n"
    )
    threshold, threshold_out = invoke(["nightly", str(tmp_path), "--fail-on-regression", "lots"])
    assert threshold == 2 and "--fail-on-regression 'lots'" in threshold_out
    night, night_out = invoke(["nightly", str(tmp_path), "--night", "yesterday"])
    assert night == 2 and "YYYY-MM-DD" in night_out
    no_token, no_token_out = invoke(
        ["nightly", str(tmp_path), "--api", "http://x:8000"], env={"TUNER_API_TOKEN": ""}
    )
    assert no_token == 2 and "--token" in no_token_out
    not_a_url, not_a_url_out = invoke(["nightly", str(tmp_path), "--api", "notaurl", "--token", "T"])
    assert not_a_url == 2 and "--api: 'notaurl' is not the service's URL" in not_a_url_out

    (tmp_path / "b.yaml").write_text(
        "name: a\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 8, vocab: 64}\n"
    )
    dup, dup_out = invoke(["nightly", str(tmp_path)])
    assert dup == 2 and "names must be unique" in dup_out


def test_a_recipe_for_a_device_this_machine_lacks_fails_with_the_fix(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "gpu.yaml").write_text(
        "name: gpu\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 8, vocab: 64}\nhardware: {device: cuda}\n"
    )
    args = ["nightly", str(tmp_path / "gpu.yaml"), "--local", "--report", str(tmp_path / "rep")]
    code, out = invoke([*args, "--storage", f"sqlite:///{tmp_path}/t.db"])
    assert code == 1 and "gpu: FAILED" in out and "set hardware.device to auto" in out
    doc = json.loads((tmp_path / "rep" / f"nightly-{dt.date.today()}.json").read_text())
    assert doc["verdicts"]["failed"] == ["gpu"]


def test_a_recipe_this_machine_cannot_hold_fails_with_the_fix_before_any_trial(tmp_path):
    """The nightly's local run checks what `tuner tune` checks first: a recipe asking for more
    devices than the machine has fails with the field and the fix, and no trial is run for it."""
    (tmp_path / "big.yaml").write_text(  # 64 ranks fit its shapes and batch, not this machine
        "name: big\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 8, vocab: 64}\n"
        "train: {global_batch_size: 64}\nhardware: {device: cpu, devices: 64}\n"
    )
    args = ["nightly", str(tmp_path / "big.yaml"), "--local", "--report", str(tmp_path / "rep")]
    code, out = invoke([*args, "--storage", f"sqlite:///{tmp_path}/t.db"])
    text = " ".join(out.split())
    assert code == 1 and "big: FAILED (hardware.devices is 64 but this machine has" in text
    assert "lower hardware.devices" in text
    import optuna

    assert not [n for n in optuna.get_all_study_names(f"sqlite:///{tmp_path}/t.db") if "big" in n]  # no study
    doc = json.loads((tmp_path / "rep" / f"nightly-{dt.date.today()}.json").read_text())
    assert doc["verdicts"]["failed"] == ["big"]


def test_one_executor_serves_the_whole_pass_and_each_recipe_still_fails_on_its_own(tmp_path, monkeypatch):
    """A pass opens one executor for all its recipes (one warm helper here, one connection to a Ray
    cluster), not one per recipe; a recipe it cannot run still fails alone, with its own fix."""
    import tuner.executors

    made = []
    real = tuner.executors.make_executor
    monkeypatch.setattr(
        tuner.executors, "make_executor", lambda name, **kw: made.append(name) or real(name, **kw)
    )
    (tmp_path / "big.yaml").write_text(  # 64 ranks fit its shapes and batch, not this machine
        "name: big\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 8, vocab: 64}\n"
        "train: {global_batch_size: 64}\nhardware: {device: cpu, devices: 64}\n"
    )
    (tmp_path / "bigger.yaml").write_text(
        "name: bigger\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 8, vocab: 64}\n"
        "train: {global_batch_size: 128}\nhardware: {device: cpu, devices: 128}\n"
    )
    args = ["nightly", str(tmp_path), "--local", "--report", str(tmp_path / "rep")]
    code, out = invoke([*args, "--storage", f"sqlite:///{tmp_path}/t.db"])
    text = " ".join(out.split())
    assert code == 1 and made == ["local"]
    assert "big: FAILED (hardware.devices is 64" in text and "bigger: FAILED (hardware.devices is 128" in text


def _flaky_service(job_states: list[str], failures: dict[int, int], calls: list[str]):
    """A stand-in service: GET /v1/jobs/1 walks through `job_states`; the Nth call (by number)
    answers `failures[N]` (an HTTP status) instead."""
    import httpx

    def service(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        if len(calls) in failures:
            return httpx.Response(failures[len(calls)], json={"detail": "upstream restarting"})
        job = {"id": 1, "trials_done": 2, "trials_total": 2, "study_name": "s-1"}
        if request.method == "POST" and request.url.path == "/v1/jobs":
            return httpx.Response(201, json={**job, "state": "queued"})
        if request.url.path.endswith("/cancel"):
            return httpx.Response(202, json={**job, "state": "cancelled"})
        if request.url.path.endswith("/best"):
            return httpx.Response(200, json={"tokens_per_s": 900.0, "config": {"micro_batch_size": 4}})
        polls = sum(c == "GET /v1/jobs/1" for c in calls)
        return httpx.Response(200, json={**job, "state": job_states[min(polls, len(job_states)) - 1]})

    return service


@pytest.mark.parametrize(("failures", "verdict"), [({3: 502, 4: 503}, "ok"), ({3: 404}, "failed")])
def test_api_night_rides_out_a_service_restart_and_cancels_a_job_it_abandons(
    db_url, monkeypatch, failures, verdict
):
    """One 502 while polling failed the night and left the job running on the service, unwatched."""
    import httpx

    calls: list[str] = []
    service = _flaky_service(["running", "running", "succeeded"], failures, calls)
    real_client = httpx.Client
    monkeypatch.setattr(
        httpx, "Client", lambda **kw: real_client(transport=httpx.MockTransport(service), **kw)
    )
    monkeypatch.setattr("time.sleep", lambda _s: None)
    tune = nl.api_tuner("http://tuner:8000", "T", night=NIGHT1, trials=2, storage_url=db_url, poll_s=0.01)
    out = nl.run_recipe(RECIPE, "r.yaml", night=NIGHT1, threshold=0.05, tune=tune, db_url=db_url)
    if verdict == "ok":
        assert out.verdict != "failed" and out.best_tokens_per_s == 900.0, out.error
        assert "POST /v1/jobs/1/cancel" not in calls
    else:
        assert out.verdict == "failed" and "HTTP 404" in out.error
        assert calls[-1] == "POST /v1/jobs/1/cancel"


def test_api_night_gives_last_nights_best_as_the_median_over_its_re_measurements(db_url, monkeypatch):
    """The local path gave the median over the trial and its re-measurements (the ranking's
    figure); through the service the same night gave the trial's one run."""
    import httpx

    def service(request: httpx.Request) -> httpx.Response:
        job = {"id": 1, "state": "succeeded", "trials_done": 2, "trials_total": 2, "study_name": "s-1"}
        if request.method == "POST":
            return httpx.Response(201, json=job)
        if request.url.path.endswith("/best"):
            return httpx.Response(
                200, json={"tokens_per_s": 1200.0, "config": {"micro_batch_size": 4, "dp": 1}}
            )
        if request.url.path.endswith("/trials"):
            last_best = {"micro_batch_size": 8, "dp": 1}
            trial = {"config": last_best, "tokens_per_s": 800.0, "remeasured_tokens_per_s": [900.0, 1000.0]}
            return httpx.Response(200, json={"items": [trial]})
        return httpx.Response(200, json=job)

    real_client = httpx.Client
    monkeypatch.setattr(
        httpx, "Client", lambda **kw: real_client(transport=httpx.MockTransport(service), **kw)
    )
    run(db_url, NIGHT1, fixed(1000.0, FP_A, mbs=8))
    out = run(
        db_url, NIGHT2, nl.api_tuner("http://tuner:8000", "T", night=NIGHT2, trials=2, storage_url=db_url)
    )
    assert out.best_tokens_per_s == 1200.0 and out.remeasured_previous_tokens_per_s == 900.0
