"""How fast the job page of a 10,000-trial study becomes interactive in Chromium.

Seeds a job whose study holds N trials into a temporary SQLite database, starts the API server
(uvicorn, the real app) on a free loopback port, and opens the job page in headless Chromium. The
page is interactive when the trials table and every plot first rendered (`window.__dashboard.ready`,
timed from navigation start). The performance model's plan is asked for after that (its time to
drawn is reported beside it). The first load meets a cold server (no study cached); the reloads
meet a warm one. Also times each aggregate endpoint and its payload.

    python benchmarks/dashboard_load.py --trials 10000 --reloads 3

Target: under 2 s. Other work on the machine inflates every number.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the seeder of synthetic studies lives with the tests

from seed import seed_job  # noqa: E402

from tuner.executors.nodes import free_port  # noqa: E402
from tuner.migrations import upgrade  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ENDPOINTS = ("overview", "trials?size=50", "trials?size=50&sort=-tokens_per_s&status=ok", "plots", "plan")


def _start_server(url: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "TUNER_DATABASE_URL": url, "TUNER_PUBLIC_READS": "true"}
    cmd = [sys.executable, "-m", "uvicorn", "api:create_app", "--factory", "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--log-level", "warning"], cwd=REPO, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    _stop(proc)
    raise SystemExit("the server did not answer /healthz within 60 s")


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(20)


def _cpu_s(pid: int) -> float:
    """CPU seconds a process used so far (user + system): unlike wall time, not inflated by load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Load:
    scenario: str
    table_s: float  # the first table page rendered
    interactive_s: float  # table and the history, importance, Pareto and memory plots drawn
    all_plots_s: float  # plus parallel coordinates (SVG)
    plan_s: float  # the plan's table, asked for once everything above was drawn
    server_cpu_s: float


def _load(page, scenario: str, url: str | None, server_pid: int) -> Load:
    cpu = _cpu_s(server_pid)
    if url:
        page.goto(url)
    else:
        page.reload()
    page.wait_for_function("window.__dashboard && window.__dashboard.ready", timeout=120_000)
    page.wait_for_function("'parallel_drawn' in window.__dashboard.timings", timeout=120_000)
    page.wait_for_function("'plan_drawn' in window.__dashboard.timings", timeout=120_000)
    timings = page.evaluate("window.__dashboard.timings")
    ready = page.evaluate("window.__dashboard.readyAt") / 1000
    rows = page.locator("#trials-table tbody tr").count()
    assert rows == 50, f"expected a 50-row table page, got {rows}"
    steps = ", ".join(f"{k} {v / 1000:.2f}" for k, v in sorted(timings.items(), key=lambda kv: kv[1]))
    print(f"{scenario}: s from navigation start: {steps}", flush=True)
    return Load(
        scenario, timings["table"] / 1000, ready, timings["parallel_drawn"] / 1000, timings["plan_drawn"] / 1000,
        _cpu_s(server_pid) - cpu,
    )  # fmt: skip


def _plotly_alone(p, base: str) -> float:
    """Seconds a fresh browser takes to load and run Plotly's bundle on a page with nothing else."""
    browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    page = browser.new_page()
    page.route(
        f"{base}/plotly-alone",
        lambda route: route.fulfill(
            content_type="text/html",
            body='<script src="/ui/static/plotly.min.js" onload="window.t = performance.now()"></script>',
        ),
    )
    page.goto(f"{base}/plotly-alone")
    page.wait_for_function("window.t !== undefined", timeout=120_000)
    seconds = page.evaluate("window.t") / 1000
    browser.close()
    return seconds


def _page_loads(url: str, job_id: int, reloads: int) -> tuple[list[Load], float]:
    """The job page in three situations: a fresh browser meeting a server that just started
    (nothing cached on either side); the same browser after the server restarted (a returning
    user: Plotly compiled before, the study not cached on the server); reloads (both warm)."""
    from playwright.sync_api import sync_playwright

    loads = []
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    job = f"{base}/ui/jobs/{job_id}"
    with sync_playwright() as p:
        proc = _start_server(url, port)
        try:
            plotly_s = _plotly_alone(p, base)
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            loads.append(_load(page, "fresh browser, cold server", job, proc.pid))
            for _ in range(reloads):
                loads.append(_load(page, "reload, warm server", None, proc.pid))
        finally:
            _stop(proc)
        proc = _start_server(url, port)
        try:
            page.goto(f"{base}/ui/jobs")  # where a returning user starts
            loads.append(_load(page, "returning browser, cold server", job, proc.pid))
        finally:
            browser.close()
            _stop(proc)
    return loads, plotly_s


def _reads(url: str, job_id: int) -> dict[str, float]:
    """Seconds to read the study into rows, in this process: from Optuna's tables alone, and from
    the snapshot the worker wrote when the job ended (what a freshly started server does)."""
    from tuner.db import Job, session_scope
    from tuner.record.reader import read_trials as read_rows
    from tuner.record.reader import study_id
    from tuner.record.snapshot import load as load_snapshot

    out = {}
    with session_scope(url) as s:
        name = s.get(Job, job_id).study_name
        sid = study_id(s, name)
        for label in ("Optuna's tables", "snapshot"):
            t0 = time.perf_counter()
            read_rows(s, sid, load_snapshot(s, name) if label == "snapshot" else None)
            out[label] = time.perf_counter() - t0
    return out


def _endpoints(base: str, job_id: int) -> list[tuple[str, float, float, int]]:
    """Per endpoint: cold-server seconds, warm seconds, bytes."""
    out = []
    for ep in ENDPOINTS:
        t0 = time.perf_counter()
        first = httpx.get(f"{base}/ui/api/jobs/{job_id}/{ep}", timeout=120)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        httpx.get(f"{base}/ui/api/jobs/{job_id}/{ep}", timeout=120)
        warm = time.perf_counter() - t0
        first.raise_for_status()
        out.append((ep, cold, warm, len(first.content)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10_000, help="trials in the seeded study")
    ap.add_argument("--reloads", type=int, default=3, help="warm page loads after the first")
    ap.add_argument("--target-s", type=float, default=2.0)
    args = ap.parse_args()
    if not Path(CHROMIUM).exists():
        raise SystemExit("needs Debian's Chromium: apt-get install -y chromium")

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'tuner.db'}"
        upgrade(url)
        t0 = time.perf_counter()
        # With the predictions the model sampler (the default) records before every trial.
        job_id = seed_job(url, args.trials, seed=0, predictions=True)
        seed_s = time.perf_counter() - t0

        reads = _reads(url, job_id)
        loads, plotly_s = _page_loads(url, job_id, args.reloads)
        # A server of its own, cold again, for the endpoint timings.
        port = free_port()
        proc = _start_server(url, port)
        try:
            endpoints = _endpoints(f"http://127.0.0.1:{port}", job_id)
        finally:
            _stop(proc)

    print(
        f"\nJob page of a {args.trials:,}-trial study (seeded in {seed_s:.1f} s), "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"{'page load (s from navigation start)':<34}{'table':>7}{'interactive':>13}{'all plots':>11}"
        f"{'plan':>7}{'server CPU s':>14}"
    )
    for scenario in ("fresh browser, cold server", "returning browser, cold server", "reload, warm server"):
        group = [x for x in loads if x.scenario == scenario]
        label = scenario if len(group) == 1 else f"{scenario} (median of {len(group)})"
        row = [
            statistics.median(getattr(x, k) for x in group)
            for k in ("table_s", "interactive_s", "all_plots_s", "plan_s", "server_cpu_s")
        ]
        print(f"{label:<34}{row[0]:>7.2f}{row[1]:>13.2f}{row[2]:>11.2f}{row[3]:>7.2f}{row[4]:>14.2f}")
    print(f"Plotly's bundle alone, fresh browser: {plotly_s:.2f} s to load and run")
    print("reading the study into rows: " + ", ".join(f"from {k} {v:.2f} s" for k, v in reads.items()))
    print(f"\n{'endpoint /ui/api/jobs/ID/...':<46}{'cold s':>12}{'warm s':>12}{'bytes':>10}")
    for ep, c, w, size in endpoints:
        print(f"{ep:<46}{c:>12.2f}{w:>12.3f}{size:>10,}")
    worst = max(x.interactive_s for x in loads)
    server_bound = max(x.interactive_s for x in loads if not x.scenario.startswith("fresh"))
    verdict = "meets" if worst < args.target_s else "misses"
    print(f"\n{verdict} the {args.target_s} s target to interactive in every situation (worst {worst:.2f} s)")
    if worst >= args.target_s:
        verdict = "meets" if server_bound < args.target_s else "misses"
        print(f"{verdict} it once the browser has run Plotly before (worst {server_bound:.2f} s)")
    print("'interactive': table and history, importance, Pareto, memory and predicted-vs-measured plots")
    print("drawn; 'all plots' adds parallel coordinates; 'plan': the plan's table, asked for after those.")


if __name__ == "__main__":
    main()
