"""The /v1 query string over HTTP (real app, SQLite database): an unknown query parameter is a 422
on every /v1 operation, and the jobs and trials lists page by position (keyset cursors), so
what is added while a client pages shifts none of its later pages."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, insert, select

from api import Settings, create_app
from api.auth import create_token
from tuner import optuna_tables as tables
from tuner.db import Job, get_engine, session_scope

TINY = """\
name: gpt-tiny
model: {family: gpt, layers: 2, hidden: 64, heads: 2, seq_len: 32, vocab: 256}
hardware: {device: cpu, devices: 1}
search: {trials: 3, timeout_min: 5}
"""


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'tuner.db'}"


@pytest.fixture
def client(url):
    settings = Settings(database_url=url, max_trials=50, max_timeout_min=60, max_body_bytes=65536)
    with TestClient(create_app(settings)) as c:  # entering runs the startup migration
        yield c


@pytest.fixture
def auth(client, url):
    with session_scope(url) as s:
        return {"Authorization": f"Bearer {create_token(s, 'tester')}"}


def _submit(client, auth) -> int:
    resp = client.post("/v1/jobs", content=TINY, headers={**auth, "Content-Type": "application/yaml"})
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def _fields(resp) -> dict[str, str]:
    return {e["field"]: e["message"] for e in resp.json()["errors"]}


def _add_trials(url: str, study_name: str, throughputs: dict[int, float | None]) -> None:
    """Trials (number -> tokens/s; None: a failed trial, without a value) added to the study,
    which is made on first use, as a running study's driver adds them."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sid = optuna.create_study(study_name=study_name, storage=url, load_if_exists=True)._study_id
    start = dt.datetime(2026, 1, 1)
    with get_engine(url).begin() as conn:
        first_id = (conn.scalar(select(func.max(tables.trials.c.trial_id))) or 0) + 1
        trials, values, attrs = [], [], []
        for trial_id, (number, value) in enumerate(throughputs.items(), first_id):
            trials.append({"trial_id": trial_id, "number": number, "study_id": sid,
                           "state": "FAIL" if value is None else "COMPLETE",
                           "datetime_start": start, "datetime_complete": start})  # fmt: skip
            status = "error" if value is None else "ok"
            attrs.append({"trial_id": trial_id, "key": "status", "value_json": json.dumps(status)})
            if value is not None:
                values.append({"trial_id": trial_id, "objective": 0, "value": value, "value_type": "FINITE"})
        conn.execute(insert(tables.trials), trials)
        conn.execute(insert(tables.user_attrs), attrs)
        if values:
            conn.execute(insert(tables.values), values)


def _job_with_study(client, auth, url, throughputs: dict[int, float | None]) -> str:
    job_id = _submit(client, auth)
    with session_scope(url) as s:
        s.get(Job, job_id).study_name = "paged"
    _add_trials(url, "paged", throughputs)
    return f"/v1/jobs/{job_id}/trials"


# ---- unknown query parameters -------------------------------------------------------------------


def test_every_v1_operation_refuses_a_query_parameter_it_does_not_take(client, auth, url):
    """`GET /v1/jobs?staus=failed` listed every job: FastAPI ignores what a route does not declare."""
    job_id = _submit(client, auth)
    doc = client.get("/openapi.json").json()
    seen = 0
    for path, operations in doc["paths"].items():
        if not path.startswith("/v1/"):
            continue
        concrete = path.replace("{job_id}", str(job_id)).replace("{study_name}", "paged")
        for method, op in operations.items():
            takes = [p["name"] for p in op.get("parameters", []) if p["in"] == "query"]
            resp = client.request(method, f"{concrete}?staus=failed", content=TINY,
                                  headers={**auth, "Content-Type": "application/yaml"})  # fmt: skip
            assert resp.status_code == 422, (method, path, resp.text)
            assert resp.json()["detail"] == "unknown query parameter: staus", (method, path)
            assert _fields(resp) == {
                "query.staus": f"unknown; this endpoint takes {', '.join(takes) or 'no query parameters'}"
            }, (method, path)
            assert "422" in op["responses"], (method, path)  # and the document says so
            seen += 1
    assert seen >= 14  # every /v1 operation: jobs, trials, best, build, log, events, plans, ...
    # The misspelt filter queued nothing and listed nothing; spelt right, it filters.
    with session_scope(url) as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 1
    assert client.get("/v1/jobs?state=failed", headers=auth).json()["items"] == []


def test_each_unknown_query_parameter_is_named(client, auth):
    resp = client.get("/v1/jobs?limit=2&staus=failed&sort=-id", headers=auth)
    assert resp.status_code == 422 and resp.json()["detail"] == "unknown query parameters: sort, staus"
    assert set(_fields(resp)) == {"query.sort", "query.staus"}
    assert "takes state, limit, cursor" in _fields(resp)["query.sort"]


# ---- jobs ---------------------------------------------------------------------------------------


def test_jobs_pages_do_not_shift_when_jobs_are_submitted_meanwhile(client, auth):
    ids = [_submit(client, auth) for _ in range(5)]
    first = client.get("/v1/jobs?limit=2", headers=auth).json()
    assert [j["id"] for j in first["items"]] == ids[:-3:-1]
    newer = [_submit(client, auth) for _ in range(2)]  # an offset would now repeat ids[3], ids[2]
    second = client.get(f"/v1/jobs?limit=2&cursor={first['next_cursor']}", headers=auth).json()
    assert [j["id"] for j in second["items"]] == [ids[2], ids[1]]
    last = client.get(f"/v1/jobs?limit=2&cursor={second['next_cursor']}", headers=auth).json()
    assert [j["id"] for j in last["items"]] == [ids[0]] and last["next_cursor"] is None
    top = client.get("/v1/jobs?limit=2", headers=auth).json()["items"]
    assert [j["id"] for j in top] == newer[::-1]  # the first page shows them


# ---- trials -------------------------------------------------------------------------------------


def _pages(client, auth, base: str, query: str) -> list[list[int]]:
    """Every page's trial numbers, following next_cursor as a client does."""
    pages, cursor = [], None
    while True:
        page = client.get(f"{base}?{query}" + (f"&cursor={cursor}" if cursor else ""), headers=auth).json()
        pages.append([t["number"] for t in page["items"]])
        cursor = page["next_cursor"]
        if cursor is None:
            return pages


def test_trials_pages_do_not_shift_when_trials_are_added_meanwhile(client, auth, url):
    base = _job_with_study(client, auth, url, {n: 100.0 * (n + 1) for n in range(10)})
    newest = client.get(f"{base}?limit=4&sort=-number", headers=auth).json()
    assert [t["number"] for t in newest["items"]] == [9, 8, 7, 6]
    fastest = client.get(f"{base}?limit=4&sort=-tokens_per_s", headers=auth).json()
    assert [t["number"] for t in fastest["items"]] == [9, 8, 7, 6]
    # Two trials finish while the client reads page 1: one the fastest yet, one without a value.
    _add_trials(url, "paged", {10: 5000.0, 11: None})
    # With offsets, page 2 began with 7 and 6 again.
    for sort, cursor in (("-number", newest["next_cursor"]), ("-tokens_per_s", fastest["next_cursor"])):
        second = client.get(f"{base}?limit=4&sort={sort}&cursor={cursor}", headers=auth).json()
        assert [t["number"] for t in second["items"]] == [5, 4, 3, 2] and second["total"] == 12
    # The ascending list's cursor is the number its page starts at, as the offset cursors of an
    # unfiltered list were: a client holding one from before carries on where it was.
    assert [t["number"] for t in client.get(f"{base}?limit=2&cursor=7", headers=auth).json()["items"]] == [
        7,
        8,
    ]


def test_trials_page_through_every_throughput_once_in_every_sort(client, auth, url):
    # 2.5e+20 in a cursor would reach the server as "2.5e 20": a query string reads `+` as a space.
    throughputs = {0: 2.5e20, 1: 1e-7, 2: None, 3: 300.0, 4: 300.0, 5: None, 6: -0.0, 7: 12.5}
    base = _job_with_study(client, auth, url, throughputs)
    by_value = sorted((n for n, v in throughputs.items() if v is not None), key=lambda n: (throughputs[n], n))
    failed = [2, 5]
    for sort, expected in (
        ("number", list(range(8))),
        ("-number", list(range(7, -1, -1))),
        ("tokens_per_s", by_value + failed),
        ("-tokens_per_s", sorted(by_value, key=lambda n: (-throughputs[n], n)) + failed),
    ):
        for limit in (1, 3):
            pages = _pages(client, auth, base, f"limit={limit}&sort={sort}")
            assert [n for page in pages for n in page] == expected, (sort, limit)
    ok = _pages(client, auth, base, "limit=2&status=ok&sort=-tokens_per_s")
    assert [n for page in ok for n in page] == sorted(by_value, key=lambda n: (-throughputs[n], n))


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("cursor=abc", "pass a page's next_cursor unchanged"),
        ("cursor=-5", "pass a page's next_cursor unchanged"),
        ("cursor=nan_3", "pass a page's next_cursor unchanged"),
        ("cursor=300.0_3", "a cursor of a page sorted by tokens_per_s, not number"),
        ("sort=-tokens_per_s&cursor=50", "a cursor of a page sorted by number, not -tokens_per_s"),
        ("cursor=" + "1" * 41, "at most 40 characters"),
    ],
)
def test_a_cursor_no_page_gave_is_a_422_naming_the_cursor(client, auth, url, query, says):
    base = _job_with_study(client, auth, url, {0: 1.0, 1: 2.0})
    resp = client.get(f"{base}?{query}", headers=auth)
    assert resp.status_code == 422 and says in _fields(resp)["cursor"], resp.text
    assert "cursor" in resp.json()["detail"]


# ---- filters ------------------------------------------------------------------------------------


def test_a_status_filter_lists_the_trials_of_that_status_and_no_other(client, auth, url):
    """`?status=pruned` (and the dashboard's `pruned (N)` box) listed the duplicates too: Optuna
    keeps a duplicate in state `pruned`, and the filter took a trial whose state matched, so the
    page held trials whose status said `duplicate`, more than the count beside the box. An Optuna
    state no status word spells (complete, fail) still filters by state."""
    import optuna

    job_id = _submit(client, auth)
    with session_scope(url) as s:
        s.get(Job, job_id).study_name = "filtered"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="filtered", storage=url)
    State = optuna.trial.TrialState
    done, pruned, failed = State.COMPLETE, State.PRUNED, State.FAIL
    for state, attrs, value in (
        (done, {"status": "ok"}, 100.0),
        (pruned, {}, None),  # infeasible: never ran
        (pruned, {"duplicate_of": 0}, None),
        (pruned, {"duplicate_of": 0}, None),
        (failed, {"status": "oom"}, None),
        (failed, {}, None),  # stopped without a measurement
        (done, {"status": "ok"}, 200.0),
    ):
        study.add_trial(optuna.trial.create_trial(state=state, value=value, user_attrs=attrs))
    expected = {
        "ok": [0, 6], "pruned": [1], "duplicate": [2, 3], "oom": [4], "failed": [5],
        "complete": [0, 6], "fail": [4, 5],
    }  # fmt: skip
    for word, numbers in expected.items():
        page = client.get(f"/v1/jobs/{job_id}/trials?status={word}", headers=auth).json()
        assert ([t["number"] for t in page["items"]], page["total"]) == (numbers, len(numbers)), word
        table = client.get(f"/ui/api/jobs/{job_id}/trials?status={word}", headers=auth).json()
        assert [t["number"] for t in table["items"]] == numbers, word
        if word in table["status_counts"]:
            assert table["total"] == table["status_counts"][word], word  # the box's count
    both = client.get(f"/ui/api/jobs/{job_id}/trials?status=pruned&status=oom", headers=auth).json()
    assert [t["number"] for t in both["items"]] == [1, 4]
