"""How fast the job page of a 10,000-trial study becomes interactive in Chromium.

Seeds a job whose study holds N trials into a temporary SQLite database, starts the API server
(uvicorn, the real app) on a free loopback port, and opens the job page in headless Chromium. The
page is interactive when the trials table and every plot first rendered (`window.__dashboard.ready`,
timed from navigation start). The first load meets a cold server (no study cached); the reloads
meet a warm one. Also times each aggregate endpoint and its payload.

    python benchmarks/dashboard_load.py --trials 10000 --reloads 3

Target: under 2 s. Other work on the machine inflates every number.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api.dashboard.seed import seed_job  # noqa: E402
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
ENDPOINTS = ("overview", "trials?size=50", "trials?size=50&sort=-tokens_per_s&status=ok", "plots")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _page_loads(base: str, job_id: int, reloads: int, server_pid: int) -> list[tuple[float, float, float]]:
    """Per load: seconds to interactive, to the last plot (parallel coordinates) drawn, and the
    server's CPU seconds for the load."""
    from playwright.sync_api import sync_playwright

    times = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        for i in range(reloads + 1):
            cpu = _cpu_s(server_pid)
            if i == 0:
                page.goto(f"{base}/ui/jobs/{job_id}")
            else:
                page.reload()
            page.wait_for_function("window.__dashboard && window.__dashboard.ready", timeout=120_000)
            page.wait_for_function("'parallel_drawn' in window.__dashboard.timings", timeout=120_000)
            timings = page.evaluate("window.__dashboard.timings")
            ready = page.evaluate("window.__dashboard.readyAt") / 1000
            times.append((ready, timings["parallel_drawn"] / 1000, _cpu_s(server_pid) - cpu))
            rows = page.locator("#trials-table tbody tr").count()
            assert rows == 50, f"expected a 50-row table page, got {rows}"
        browser.close()
    return times


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
        job_id = seed_job(url, args.trials, seed=0)
        seed_s = time.perf_counter() - t0

        port = _free_port()
        proc = _start_server(url, port)
        try:
            loads = _page_loads(f"http://127.0.0.1:{port}", job_id, args.reloads, proc.pid)
        finally:
            _stop(proc)
        # A second server, cold again, for the endpoint timings.
        proc = _start_server(url, port)
        try:
            endpoints = _endpoints(f"http://127.0.0.1:{port}", job_id)
        finally:
            _stop(proc)

    cold, cold_all, cold_cpu = loads[0]
    warm, warm_all, warm_cpu = (
        (statistics.median(x[k] for x in loads[1:]) for k in range(3))
        if len(loads) > 1
        else [float("nan")] * 3
    )
    print(
        f"\nJob page of a {args.trials:,}-trial study (seeded in {seed_s:.1f} s), "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    head = (
        f"{'page load (s from navigation start)':<40}{'interactive':>12}{'all plots':>11}{'server CPU s':>14}"
    )
    print(f"{head}{'target':>8}")
    print(
        f"{'first load, cold server':<40}{cold:>12.2f}{cold_all:>11.2f}{cold_cpu:>14.2f}{'<' + str(args.target_s):>8}"
    )
    label = f"reload, warm server (median of {len(loads) - 1})"
    print(f"{label:<40}{warm:>12.2f}{warm_all:>11.2f}{warm_cpu:>14.2f}{'<' + str(args.target_s):>8}")
    print(f"\n{'endpoint /ui/api/jobs/ID/...':<46}{'cold s':>12}{'warm s':>12}{'bytes':>10}")
    for ep, c, w, size in endpoints:
        print(f"{ep:<46}{c:>12.2f}{w:>12.3f}{size:>10,}")
    verdict = "meets" if max(cold, warm) < args.target_s else "misses"
    print(f"\n{verdict} the {args.target_s} s target to interactive (cold {cold:.2f} s, warm {warm:.2f} s)")
    print("'interactive': table and history, importance, Pareto and memory plots drawn; 'all plots' adds")
    print("parallel coordinates, a WebGL trace that Chromium without a GPU renders in software.")


if __name__ == "__main__":
    main()
