"""The dashboard in headless Chromium against a real `tuner serve` (API + one real worker) on a
free loopback port: token prompt, recipe form and its field errors, a real job's trials arriving
live, a 2,000-trial job's table and plots, comparison, build download with checksum, nightly
history. Screenshots land in test-artifacts/screenshots/."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from seed import seed_job, seed_study

from api.auth import create_token
from tuner.db import Build, Job, NightlyResult, add_event, session_scope, utcnow
from tuner.executors.nodes import free_port
from tuner.migrations import upgrade
from tuner.record.reader import read_study

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SHOTS = REPO / "test-artifacts" / "screenshots"
TINY = """\
name: gpt-tiny-live
model: {family: gpt, layers: 2, hidden: 64, heads: 2, seq_len: 64, vocab: 512}
train: {global_batch_size: 8}
hardware: {device: cpu, devices: 1}
search: {trials: 3, timeout_min: 10}
measure: {warmup_steps: 1, steps: 2}
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A fresh database with seeded jobs, served by `tuner serve` with one worker (local executor)."""
    d = tmp_path_factory.mktemp("browser")
    url = f"sqlite:///{d / 'tuner.db'}"
    upgrade(url)
    large = seed_job(url, 2000, seed=11, name="gpt-large-study")
    live = seed_job(url, 40, seed=12, state="running", name="gpt-seeded-live")
    archive = _tarball(d / "build.tar.gz")
    with session_scope(url) as s:
        token = create_token(s, "browser")
        # The seeded running job's "worker" sits on another host with a heartbeat dated ahead, so
        # the real worker's dead-worker recovery leaves it alone.
        seeded = s.get(Job, live)
        seeded.worker_id, seeded.updated_at = "elsewhere:1:seeded", utcnow() + dt.timedelta(days=1)
        fastest = read_study(s, s.get(Job, large).study_name).ranking().best.trial
        s.add(Build(job_id=large, study_name=s.get(Job, large).study_name, trial_number=fastest, path=str(archive),
                    sha256=hashlib.sha256(archive.read_bytes()).hexdigest(), size_bytes=archive.stat().st_size))  # fmt: skip
        fp = {"family": "cuda", "device": "NVIDIA H100", "torch": "2.8.0", "driver": "550.54"}
        for day, torch_version, best, verdict in (
            (1, "2.8.0", 1000.0, "ok"),
            (2, "2.9.0", 780.0, "regression"),
        ):
            s.add(NightlyResult(recipe_name="nightly-tiny", night=dt.date(2026, 11, day), fingerprint_hash=torch_version,
                                fingerprint={**fp, "torch": torch_version}, best_tokens_per_s=best, verdict=verdict))  # fmt: skip
    env = {
        "TUNER_REMEASURE_TOP": "0",
        "TUNER_PUBLIC_READS": "false",
    }  # one run names the winner: a short real job
    with _serve(d, url, env, workers=1) as base:
        yield {"base": base, "url": url, "token": token, "large": large, "live": live, "archive": archive}


@contextlib.contextmanager
def _serve(d: Path, url: str, env: dict[str, str], *, workers: int):
    """`tuner serve` on a free loopback port over the database at `url`; yields its base URL."""
    port = free_port()
    env = {**os.environ, "TUNER_DATABASE_URL": url, "TUNER_ARTIFACT_DIR": str(d / "artifacts"), **env}
    log = open(d / "serve.log", "w")  # noqa: SIM115 - closed after the server stops
    # Its own session, so stopping it stops its worker and trial processes too.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tuner.cli.main", "serve", "--port", str(port), "--workers", str(workers)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (d / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "tuner serve did not answer /healthz within 90 s"
            time.sleep(0.3)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _tarball(path: Path) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"#!/bin/sh\necho launch\n"
        info = tarfile.TarInfo("build/launch.sh")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="module")
def context(browser):
    # One context for the module: the token entered once stays in its localStorage.
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    yield ctx
    ctx.close()


@pytest.fixture
def page(context):
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    pg.close()
    assert not errors, errors


def _shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _ready(page, timeout: float = 30_000) -> None:
    page.wait_for_function("window.__dashboard && window.__dashboard.ready", timeout=timeout)


def test_jobs_page_asks_for_the_token_once_and_lists_jobs(service, page):
    page.goto(f"{service['base']}/ui/jobs")
    page.locator("#token-dialog").wait_for()
    page.fill("#token-input", service["token"])
    page.click("#token-save")
    page.locator("#jobs-table tbody tr").first.wait_for()
    assert page.locator("#jobs-table tbody tr").count() == 2
    page.reload()
    page.wait_for_selector("body[data-loaded=true]")
    assert page.locator("#token-dialog").count() == 0  # kept in localStorage
    page.select_option("#state-filter", "running")
    page.wait_for_function("document.querySelectorAll('#jobs-table tbody tr').length === 1")
    row = page.locator("#jobs-table tbody tr")
    assert row.get_attribute("data-state") == "running" and "gpt-seeded-live" in row.inner_text()
    page.select_option("#state-filter", "")
    page.wait_for_function("document.querySelectorAll('#jobs-table tbody tr').length === 2")
    assert "×" in page.locator(f"tr[data-job-id='{service['large']}']").inner_text()  # speedup column
    _shot(page, "jobs")


def test_bad_recipe_shows_the_error_next_to_the_field(service, page):
    page.goto(f"{service['base']}/ui/jobs")
    page.fill("#recipe-text", TINY.replace("trials: 3", "trials: 0"))
    page.click("#recipe-submit")
    error = page.locator("#recipe-errors li[data-field='search.trials']")
    error.wait_for()
    assert "greater than or equal to 1" in error.inner_text() and "line 5" in error.inner_text()
    assert page.get_attribute("#recipe-text", "aria-invalid") == "true"
    _shot(page, "recipe-error")


def test_large_job_table_plots_sort_filter_and_compare(service, page):
    page.goto(f"{service['base']}/ui/jobs/{service['large']}")
    _ready(page)
    assert page.locator("#trials-table tbody tr").count() == 50
    assert "of 2,000 trials" in page.inner_text("#page-info")
    for plot in ("history", "importance", "pareto", "memory"):
        assert page.locator(f"#plot-{plot} .main-svg").count() > 0, plot
    # Parallel coordinates are SVG of their own (Plotly's parcoords is WebGL): one line per trial.
    page.wait_for_function("'parallel_drawn' in window.__dashboard.timings")
    assert page.locator("#plot-parallel svg.parcoords polyline").count() > 100
    assert "Plots show" in page.inner_text("#plots-note")

    header = page.locator("th[data-sort='tokens_per_s']")
    header.click()
    page.wait_for_function("document.querySelector('th[data-sort=tokens_per_s]').textContent.includes('▲')")
    header.click()
    page.wait_for_function("document.querySelector('th[data-sort=tokens_per_s]').textContent.includes('▼')")
    top = page.locator("#trials-table tbody tr").first.get_attribute("data-number")
    assert page.inner_text("#best-summary").split("trial #")[1].startswith(top)

    page.check("#status-filter input[value='oom']")
    page.wait_for_function(
        "[...document.querySelectorAll('#trials-table tbody tr')].every(r => r.dataset.status === 'oom')"
    )
    page.uncheck("#status-filter input[value='oom']")
    page.select_option("#knob-name", "recompute")
    page.select_option("#knob-value", "full")
    page.click("#knob-add")
    page.wait_for_selector("#knob-chips .chip")
    page.click("#page-next")
    page.wait_for_function("document.querySelector('#page-info').textContent.startsWith('page 2')")
    _shot(page, "job-large")

    boxes = page.locator("#trials-table tbody input.pick")
    boxes.nth(0).check()
    boxes.nth(1).check()
    page.click("#compare-link")
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#compare-knobs tr.differs").count() >= 1
    assert (
        page.locator("#compare-metrics tr[data-metric='tokens_per_s'] td").nth(3).inner_text().endswith("%")
    )
    assert page.locator("#compare-breakdown tr[data-category='compute']").count() == 1
    _shot(page, "compare")


def test_build_download_verifies_the_checksum(service, page):
    page.goto(f"{service['base']}/ui/jobs/{service['large']}")
    _ready(page)
    expected = hashlib.sha256(service["archive"].read_bytes()).hexdigest()
    with page.expect_download() as info:
        page.click("#download-build")
    saved = info.value.path()
    assert hashlib.sha256(Path(saved).read_bytes()).hexdigest() == expected
    page.wait_for_selector("#build-status[data-verified]")
    assert page.get_attribute("#build-status", "data-verified") == expected
    _shot(page, "best-config")


def test_seeded_trials_arrive_live_without_reload(service, page):
    page.goto(f"{service['base']}/ui/jobs/{service['live']}")
    _ready(page)
    page.evaluate("window.__sameDocument = true")
    assert "of 40 trials" in page.inner_text("#page-info")
    assert page.inner_text("#job-speedup").endswith("×")  # the running job's speedup, by its progress
    with session_scope(service["url"]) as s:
        name = s.get(Job, service["live"]).study_name
    seed_study(service["url"], name, 5, seed=99)
    with session_scope(service["url"]) as s:
        job = s.get(Job, service["live"])
        job.trials_done = 45
        add_event(s, job.id, "trial_finished", {"done": 45, "total": 45, "trial": 44})
    page.wait_for_function(
        "document.querySelector('#page-info').textContent.includes('of 45 trials')", timeout=20_000
    )
    with session_scope(service["url"]) as s:
        job = s.get(Job, service["live"])
        job.state, job.finished_at = "succeeded", utcnow()
        add_event(s, job.id, "done", {"state": "succeeded"})
    page.wait_for_function(
        "document.querySelector('#live-status').textContent === 'job finished'", timeout=20_000
    )
    assert page.evaluate("window.__sameDocument") is True
    assert page.evaluate("window.__dashboard.events") >= 2


def test_real_job_trials_arrive_live(service, page):
    """Submit through the form; the real worker runs real trials; they show up without a reload."""
    page.goto(f"{service['base']}/ui/jobs")
    page.fill("#recipe-text", TINY)
    page.click("#recipe-submit")
    page.click("#new-job-link")
    _ready(page)
    page.evaluate("window.__sameDocument = true")
    # The worker may have started (even finished) a trial while the page loaded; what must hold
    # is that a trial finishing after that shows up in this same document, by SSE.
    ok_rows = "#trials-table tbody tr[data-status='ok']"
    at_load = page.locator(ok_rows).count()
    assert at_load < 3, "the whole 3-trial job finished before the page loaded; nothing left to arrive"
    page.wait_for_function(f'document.querySelectorAll("{ok_rows}").length > {at_load}', timeout=240_000)
    page.wait_for_selector("#best-card:not([hidden])")
    assert page.evaluate("window.__sameDocument") is True
    assert page.evaluate("window.__dashboard.events") >= 2
    assert float(page.inner_text("#best-tokens").split()[0].replace(",", "")) > 0
    job = httpx.get(
        f"{service['base']}/v1/jobs/{page.url.rsplit('/', 1)[1]}",
        headers={"Authorization": f"Bearer {service['token']}"},
    ).json()
    if job["state"] == "succeeded":
        assert page.is_enabled("#download-build")
    else:
        assert page.is_disabled("#download-build")
        assert "when the job succeeds" in page.inner_text("#build-status")
    _shot(page, "job-live")


def test_recipe_history_marks_the_regression_and_what_changed(service, page):
    page.goto(f"{service['base']}/ui/recipes/nightly-tiny")
    page.wait_for_selector("body[data-ready=true]")
    regression = page.locator("#nightly-table tr.regression")
    assert regression.count() == 1
    assert "torch 2.8.0 → 2.9.0" in regression.inner_text()
    assert page.locator("#nightly-plot .main-svg").count() > 0
    _shot(page, "recipe-history")


OLDER_JOBS = 330  # more than one page of /v1/jobs (200) for every filter below


@pytest.fixture(scope="module")
def many_jobs(tmp_path_factory):
    """A service (API only, public reads) over 330 finished jobs, every fifth of them failed."""
    d = tmp_path_factory.mktemp("many-jobs")
    url = f"sqlite:///{d / 'tuner.db'}"
    upgrade(url)
    with session_scope(url) as s:
        for i in range(1, OLDER_JOBS + 1):
            name = "the-oldest-job" if i == 1 else f"job-{i}"
            s.add(
                Job(
                    recipe_name=name,
                    recipe={},
                    recipe_hash="seeded",
                    state="failed" if i % 5 == 0 else "succeeded",
                )
            )
    with _serve(d, url, {"TUNER_PUBLIC_READS": "true"}, workers=0) as base:
        yield {"base": base, "url": url}


def _rows(page, n: int) -> None:
    page.wait_for_function(f"document.querySelectorAll('#jobs-table tbody tr').length === {n}")


def test_older_jobs_are_one_click_away_and_stay_live(many_jobs, page):
    page.goto(f"{many_jobs['base']}/ui/jobs")
    page.wait_for_selector("body[data-loaded=true]")
    _rows(page, 200)
    assert "newest 200 jobs" in page.inner_text("#jobs-shown")
    assert page.locator("tr[data-job-id='1']").count() == 0
    page.click("#jobs-older")
    _rows(page, OLDER_JOBS)
    assert "the-oldest-job" in page.locator("tr[data-job-id='1']").inner_text()
    assert page.inner_text("#jobs-shown") == f"Showing all {OLDER_JOBS} jobs."
    assert page.locator("#jobs-older").is_hidden()
    # The live refresh keeps the older page it did not load itself, and adds a new job on top.
    with session_scope(many_jobs["url"]) as s:
        s.add(Job(recipe_name="a-new-job", recipe={}, recipe_hash="seeded", state="queued"))
    _rows(page, OLDER_JOBS + 1)
    assert "a-new-job" in page.locator("#jobs-table tbody tr").first.inner_text()
    assert page.locator("tr[data-job-id='1']").count() == 1
    # A filter pages the same way, and its older page keeps the filter.
    page.select_option("#state-filter", "succeeded")
    _rows(page, 200)
    page.click("#jobs-older")
    succeeded = OLDER_JOBS - OLDER_JOBS // 5
    _rows(page, succeeded)
    states = page.eval_on_selector_all(
        "#jobs-table tbody tr", "rows => [...new Set(rows.map(r => r.dataset.state))]"
    )
    assert states == ["succeeded"] and page.locator("tr[data-job-id='1']").count() == 1
    assert page.inner_text("#jobs-shown") == f"Showing all {succeeded} succeeded jobs."
    _shot(page, "jobs-older")
