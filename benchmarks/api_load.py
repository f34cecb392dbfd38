"""Read latency and submission rate of the REST service with a 10,000-trial job stored.

Starts a real `tuner serve --workers 0` (API only, so submitted jobs stay queued) on a loopback
port against a fresh database, seeds one job whose study holds N trials, then drives it from a
load generator in this process (C concurrent HTTP clients, each request timed end to end):

- GET /v1/jobs/ID/trials?limit=50 at random pages (cursor), and GET /v1/jobs/ID: p50, p99, req/s;
- POST /v1/jobs with the tiny recipe as YAML: submissions per second.

    python benchmarks/api_load.py --trials 10000 --requests 400 --concurrency 4
    python benchmarks/api_load.py --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test

Load generator and server share the machine's cores; compare numbers from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def cpu_s(pid: int) -> float:
    """CPU seconds process `pid` used so far (user + system): unlike latency, barely moved by
    other work on the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(
    base: str,
    token: str,
    paths: list[str],
    concurrency: int,
    method: str = "GET",
    body=None,
    pid: int | None = None,
) -> dict:
    """Send every request in `paths` from `concurrency` threads; latency percentiles and rate, and
    the server's CPU milliseconds per request when its `pid` is given."""
    lat: list[float] = []
    errors: list[int] = []
    lock = threading.Lock()
    todo = list(paths)
    headers = {"Authorization": f"Bearer {token}"}
    if body is not None:
        headers["Content-Type"] = "application/yaml"

    def worker():
        with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    path = todo.pop()
                t0 = time.perf_counter()
                r = client.request(method, path, content=body)
                dt = time.perf_counter() - t0
                with lock:
                    lat.append(dt)
                    if r.status_code >= 400:
                        errors.append(r.status_code)

    cpu0 = cpu_s(pid) if pid else None
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    return {
        "requests": len(lat),
        "errors": len(errors),
        "p50_ms": round(1000 * statistics.median(lat), 1),
        "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1),
        "per_s": round(len(lat) / wall, 1),
        "server_cpu_ms": round(1000 * (cpu_s(pid) - cpu0) / len(lat), 1) if pid else None,
        "load": round(os.getloadavg()[0], 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10_000, help="trials stored in the job's study")
    ap.add_argument("--requests", type=int, default=400, help="requests per read endpoint")
    ap.add_argument("--submissions", type=int, default=200, help="POST /v1/jobs requests")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from api.auth import create_token

    sys.path.insert(
        0, str(Path(__file__).resolve().parent.parent / "tests")
    )  # the seeder lives with the tests
    from seed import seed_job

    from tuner.db import session_scope
    from tuner.executors.nodes import free_port
    from tuner.migrations import prepare_database

    tmp = tempfile.mkdtemp(prefix="tuner-api-load-")
    url = args.database_url or f"sqlite:///{tmp}/load.db"
    prepare_database(url)
    t0 = time.perf_counter()
    job_id = seed_job(url, args.trials, seed=random.randrange(10**6))
    print(
        f"seeded job {job_id} with {args.trials} trials in {time.perf_counter() - t0:.1f}s", file=sys.stderr
    )
    with session_scope(url) as s:
        token = create_token(s, f"load-{os.getpid()}")

    port = free_port()
    env = {**os.environ, "TUNER_DATABASE_URL": url, "TUNER_ARTIFACT_DIR": f"{tmp}/builds"}
    with open(f"{tmp}/server.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "tuner.cli.main", "serve", "--workers", "0", "--port", str(port)],
            cwd=tmp,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise SystemExit(f"server did not start; see {tmp}/server.log")
        rng = random.Random(0)
        # Warm the server's caches the way a dashboard user would before measuring.
        drive(base, token, [f"/v1/jobs/{job_id}/trials?limit=50", f"/v1/jobs/{job_id}"], 1)
        pages = [
            f"/v1/jobs/{job_id}/trials?limit=50&cursor={rng.randrange(0, args.trials)}"
            for _ in range(args.requests)
        ]
        rows = {
            "GET /v1/jobs/ID/trials?limit=50": drive(base, token, pages, args.concurrency, pid=server.pid),
            "GET /v1/jobs/ID": drive(
                base, token, [f"/v1/jobs/{job_id}"] * args.requests, args.concurrency, pid=server.pid
            ),
            "POST /v1/jobs (YAML)": drive(
                base,
                token,
                ["/v1/jobs"] * args.submissions,
                args.concurrency,
                method="POST",
                body=(ROOT / "recipes" / "gpt-tiny.yaml").read_bytes(),
                pid=server.pid,
            ),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)

    db = "PostgreSQL" if url.startswith("postgresql") else "SQLite"
    if args.json:
        for name, r in rows.items():
            print(json.dumps({"endpoint": name, "database": db, "trials": args.trials, **r}))
        return 0
    print(f"{db}, {args.trials} trials stored, {args.concurrency} concurrent clients on loopback\n")
    print("| endpoint | requests | errors | p50 ms | p99 ms | per second | server CPU ms/request | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['requests']} | {r['errors']} | {r['p50_ms']} | {r['p99_ms']} | {r['per_s']} "
            f"| {r['server_cpu_ms']} | {r['load']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
