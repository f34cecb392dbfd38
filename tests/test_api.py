"""The REST API in-process (real app, real SQLite database): auth, recipe validation and the
trust boundary, limits, jobs, paginated trials over 10,000 trials, SSE resume, build download."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import time

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import insert

from api import Settings, create_app
from api.auth import create_token, revoke_token
from tuner.db import Build, Job, add_event, get_engine, session_scope, utcnow
from tuner.executors.nodes import free_port
from tuner.recipe import RecipeError, parse_recipe

TINY = """\
name: gpt-tiny
model: {family: gpt, layers: 2, hidden: 64, heads: 2, seq_len: 32, vocab: 256}
hardware: {device: cpu, devices: 1}
search: {trials: 3, timeout_min: 5}
measure: {warmup_steps: 1, steps: 2}
"""

# kv_heads must divide heads, and (at search time) split whole over every tp the space allows.
LLAMA = """\
name: llama-tiny
model: {family: llama, layers: 2, hidden: 64, heads: 4, kv_heads: 2, seq_len: 32, vocab: 256, rope_theta: 500000.0}
hardware: {device: cpu, devices: 2}
search: {trials: 3, timeout_min: 5, overrides: {tp: [2]}}
"""


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'tuner.db'}"


def _client(url: str, **settings) -> TestClient:
    defaults = {"max_trials": 50, "max_timeout_min": 60, "max_body_bytes": 65536}
    return TestClient(create_app(Settings(database_url=url, **{**defaults, **settings})))


@pytest.fixture
def client(url):
    with _client(url) as c:  # entering runs the startup migration
        yield c


@pytest.fixture
def auth(client, url):
    with session_scope(url) as s:
        token = create_token(s, "tester")
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.postgres
def test_text_postgresql_cannot_store_and_a_cursor_past_any_id_are_422s_not_500s():
    """On PostgreSQL a NUL in a recipe's text (its name, or any string in it) and a 12-digit job
    cursor each answered 500: text columns refuse NUL, the jobs' key is a 32-bit integer."""
    from test_db import fresh_pg_database

    url, drop = fresh_pg_database()
    try:
        with _client(url) as client:
            with session_scope(url) as s:
                auth = {"Authorization": f"Bearer {create_token(s, 'tester')}"}
            doc = yaml.safe_load(TINY)
            for bad, field in (({**doc, "name": "a\x00b"}, "name"),
                               ({**doc, "model": {**doc["model"], "family": "g\x00pt"}}, "model.family")):  # fmt: skip
                resp = client.post(
                    "/v1/jobs", content=json.dumps(bad), headers={**auth, "Content-Type": "application/json"}
                )
                assert resp.status_code == 422 and "NUL" in _fields(resp)[field]
            resp = client.post("/v1/jobs", content=TINY.replace("name: gpt-tiny", 'name: "two\\nlines"', 1),
                               headers={**auth, "Content-Type": "application/yaml"})  # fmt: skip
            assert resp.status_code == 422 and "printable" in _fields(resp)["name"]
            assert client.get("/v1/jobs?cursor=999999999999", headers=auth).json()["items"] == []
            history = client.get("/ui/api/recipes/a%00b/history", headers=auth)
            assert history.status_code == 422
    finally:
        drop()


def test_a_new_job_is_stored_before_its_202_reaches_the_client(tmp_path, monkeypatch):
    # A real server: a client that reads the 202 follows the job's Location at once. With the
    # transaction committed after the response was sent, that GET answered 404 (a CI run of the
    # browser tests). Every commit is slowed here, so the race is certain, not occasional.
    import sqlite3
    import threading

    import httpx
    import uvicorn
    from sqlalchemy.orm import Session

    db = tmp_path / "tuner.db"
    url = f"sqlite:///{db}"
    app = create_app(Settings(database_url=url, max_trials=50, max_timeout_min=60))
    commit = Session.commit

    def slow_commit(self):
        time.sleep(0.5)
        commit(self)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:  # the lifespan migrates the database first
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        with session_scope(url) as s:
            token = create_token(s, "tester")
        monkeypatch.setattr(Session, "commit", slow_commit)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/jobs", content=TINY, timeout=30,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/yaml"},
        )  # fmt: skip
        assert r.status_code == 202, r.text
        with sqlite3.connect(db) as raw:
            stored = [row[0] for row in raw.execute("SELECT id FROM jobs")]
        assert stored == [r.json()["id"]]
        followed = httpx.get(
            f"http://127.0.0.1:{port}{r.headers['location']}", headers={"Authorization": f"Bearer {token}"}
        )
        assert followed.status_code == 200 and followed.json()["state"] == "queued"
    finally:
        server.should_exit = True
        thread.join(10)


def _submit(client, auth, text: str = TINY, content_type: str = "application/yaml"):
    return client.post("/v1/jobs", content=text, headers={**auth, "Content-Type": content_type})


def _fields(resp) -> dict[str, str]:
    return {e["field"]: e["message"] for e in resp.json()["errors"]}


# ---- auth ---------------------------------------------------------------------------------------


def test_writes_and_reads_need_a_valid_unrevoked_token(client, auth, url):
    assert _submit(client, {}).status_code == 401
    assert client.get("/v1/jobs").status_code == 401
    assert "tuner token create" in client.get("/v1/jobs").json()["detail"]
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert _submit(client, auth).status_code == 202
    with session_scope(url) as s:
        revoke_token(s, "tester")
    assert _submit(client, auth).status_code == 403
    assert client.get("/v1/jobs", headers=auth).status_code == 403


def test_public_reads_open_gets_but_not_writes(url):
    with _client(url, public_reads=True) as c:
        assert c.get("/v1/jobs").status_code == 200
        assert c.get("/v1/search-spaces").status_code == 200
        assert _submit(c, {}).status_code == 401


def test_tokens_are_stored_only_as_hashes(client, url):
    with session_scope(url) as s:
        token = create_token(s, "bot")
    with get_engine(url).connect() as conn:
        stored = conn.exec_driver_sql("SELECT token_sha256 FROM api_tokens WHERE name='bot'").scalar()
    assert stored == hashlib.sha256(token.encode()).hexdigest() and token not in stored


# ---- the recipe is data, never code -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (TINY.replace("family: gpt,", "family: gpt, module: os,"), "model.module"),
        (TINY.replace("family: gpt", "family: torch.nn.Transformer"), "model.family"),
        (TINY + "plugin: {import: subprocess}\n", "plugin"),
        (TINY + "train: {optimizer: 'os.system'}\n", "train.optimizer"),
    ],
)
def test_a_recipe_naming_python_code_is_refused(client, auth, text, field):
    resp = _submit(client, auth, text)
    assert resp.status_code == 422
    assert field in _fields(resp)


@pytest.mark.parametrize(
    ("text", "field", "says"),
    [
        ("name: x\n", "model", "required"),
        (TINY.replace("heads: 2", "heads: 3"), "model", "divisible by heads"),
        (TINY.replace("layers: 2", "layers: many"), "model.layers", "integer"),
        (TINY.replace("trials: 3", "trials: 500"), "search.trials", "at most 50 trials"),
        (TINY.replace("timeout_min: 5", "timeout_min: 999"), "search.timeout_min", "TUNER_MAX_TIMEOUT_MIN"),
        ("name: [unclosed\n", "", "not valid YAML"),
        (LLAMA.replace("kv_heads: 2", "kv_heads: 3"), "model.kv_heads", "must divide heads"),
        (LLAMA.replace("rope_theta: 500000.0", "rope_theta: -1"), "model.rope_theta", "greater than 0"),
        (LLAMA.replace("kv_heads: 2", "kv_heads: 1"), "model.kv_heads", "not divisible by tp (2)"),
        # Scalars PyYAML's constructors cannot hold, and nesting no recipe has: 422, never a 500.
        (TINY.replace("trials: 3", "seed: " + "9" * 5000), "", "thousands of digits"),
        (TINY.replace("name: gpt-tiny", "name: 2026-02-30"), "", "day is out of range"),
        (TINY + "x: !!int 'abc'\n", "", "cannot be read"),
        ("[" * 5000 + "]" * 5000, "", "nested too deeply"),
        (TINY + "name: again\n", "", "key 'name' is given twice"),
        (TINY + "? [a, b]\n: 2\n", "", "a key is a name"),
        (
            TINY.replace("trials: 3", "trials: 3, overrides: {tp: [.inf]}"),
            "search.overrides.tp",
            "not an integer",
        ),
        # Infinity is no budget and no time limit; a seed beyond what samplers take.
        (
            TINY.replace("devices: 1", "devices: 1, memory_budget_gb: .inf"),
            "hardware.memory_budget_gb",
            "finite",
        ),
        (TINY.replace("steps: 2", "steps: 2, timeout_s: .inf"), "measure.timeout_s", "finite"),
        (TINY.replace("trials: 3", "trials: 3, seed: 4294967296"), "search.seed", "less than or equal"),
        (
            TINY.replace("trials: 3", "trials: 3, sampler: cmaes, objective: throughput_memory"),
            "search",
            "cmaes",
        ),
        # Checked on every entry point before a worker takes the job (the CLI's preflight does).
        (TINY.replace("devices: 1", "devices: 3"), "hardware.devices", "set hardware.devices to 2"),
        (TINY.replace("devices: 1", "devices: 2, nodes: 2"), "hardware.nodes", "TUNER_EXECUTOR=ray"),
        (
            TINY.replace("cpu", "auto").replace("trials: 3", "trials: 3, overrides: {foo: [1]}"),
            "search.overrides.foo",
            "unknown knob",
        ),  # fmt: skip
        (
            TINY.replace("cpu", "auto").replace("trials: 3", "trials: 3, overrides: {amp: [O9]}"),
            "search.overrides.amp",
            "O9",
        ),  # fmt: skip
    ],
)
def test_bad_recipes_get_422_naming_the_field(client, auth, text, field, says):
    resp = _submit(client, auth, text)
    assert resp.status_code == 422, resp.text
    if field:
        assert says in _fields(resp)[field]
    else:
        assert resp.json()["errors"] and all("field" in e for e in resp.json()["errors"])
        assert says in json.dumps(resp.json())


def test_unknown_search_space_or_override_is_refused_at_submit(client, auth):
    resp = _submit(client, auth, TINY.replace("search: {", "search: {space: nosuch, "))
    assert resp.status_code == 422 and "unknown search space" in _fields(resp)["search.space"]
    resp = _submit(client, auth, TINY.replace("search: {", "search: {space: /etc/passwd, "))
    assert resp.status_code == 422 and "search.space" in _fields(resp)
    resp = _submit(client, auth, TINY.replace("search: {", "search: {overrides: {attention: [warp]}, "))
    assert resp.status_code == 422 and "warp" in _fields(resp)["search.overrides.attention"]
    # A value outside the space: the values to choose from and where a client can list them, not
    # a file on the server's disk to edit.
    resp = _submit(client, auth, TINY.replace("search: {", "search: {overrides: {bucket_mb: [7]}, "))
    message = _fields(resp)["search.overrides.bucket_mb"]
    assert "choose from" in message and "GET /v1/search-spaces" in message and "edit" not in message


def test_a_recipe_no_machine_could_run_is_refused_at_submit_with_device_auto(client, auth):
    """With `device: auto` the worker's machine picks the space; a model that no space's splits
    fit was queued (202) and failed on the worker, where `tuner tune` and /v1/plans refused it."""
    auto = TINY.replace("device: cpu, devices: 1", "device: auto, devices: 3000")
    resp = _submit(client, auth, auto)
    assert resp.status_code == 422 and "no split of 3000 devices" in _fields(resp)["hardware.devices"]
    assert _submit(client, auth, TINY.replace("device: cpu", "device: auto")).status_code == 202


def _json_with(overrides: dict) -> str:
    doc = yaml.safe_load(TINY)
    doc["search"]["overrides"] = overrides
    return json.dumps(doc).replace('"TP"', "1e400")  # JSON's way to infinity: a number too large


TINY_JSON_INF_TP = _json_with({"tp": ["TP"]})


def test_json_bodies_are_read_as_a_recipe_file_is(client, auth):
    doc = yaml.safe_load(TINY)
    resp = _submit(client, auth, "\ufeff" + json.dumps(doc), "application/json")  # a byte-order mark
    assert resp.status_code == 202, resp.text
    resp = _submit(client, auth, '{"name": "a", "name": "b"}', "application/json")
    assert resp.status_code == 422 and "'name' is given twice" in _fields(resp)["body"]
    resp = _submit(client, auth, '{"name": "a",\n "model": }', "application/json")
    assert resp.status_code == 422 and _fields(resp)["body"].startswith("not valid JSON at line 2, column")
    resp = _submit(client, auth, TINY_JSON_INF_TP, "application/json")
    assert resp.status_code == 422 and "not an integer" in _fields(resp)["search.overrides.tp"]
    resp = _submit(client, auth, '{"search": {"seed": ' + "9" * 5000 + "}}", "application/json")
    assert resp.status_code == 422 and "thousands of digits" in _fields(resp)["body"]
    assert "sys." not in resp.text


def _alias_bomb(levels: int) -> str:
    """About 90 bytes a level; each level's list repeats the previous one ten times."""
    lines = ["name: bomb", "model:", "  family: hf", "  config:", "    model_type: llama"]
    lines.append("    x0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]")
    for i in range(1, levels):
        lines.append(f"    x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def test_a_recipe_that_repeats_parts_by_aliases_is_refused_at_once(client, auth):
    """Seven levels, 630 bytes, kept `tuner plan` busy for 41 s walking 10^7 values (level 9: an
    hour), and a REST request as long: aliases are refused where the text is read."""
    start = time.process_time()
    resp = _submit(client, auth, _alias_bomb(7))
    assert resp.status_code == 422 and "alias *a0 repeats another part" in _fields(resp)[""]
    with pytest.raises(RecipeError, match=r"line 7, column \d+: alias \*a0"):
        parse_recipe(_alias_bomb(7))
    assert time.process_time() - start < 5


def test_oversized_and_mistyped_bodies(client, auth):
    resp = _submit(client, auth, TINY + "#" * 70_000)
    assert resp.status_code == 413 and "TUNER_MAX_BODY_BYTES" in _fields(resp)["body"]
    resp = _submit(client, auth, TINY, content_type="text/html")
    assert resp.status_code == 415 and "application/yaml" in _fields(resp)["Content-Type"]
    resp = _submit(client, auth, "{not json", content_type="application/json")
    assert resp.status_code == 422 and "not valid JSON at line 1" in _fields(resp)["body"]
    assert "reads as YAML" not in _fields(resp)["body"]
    # A YAML recipe sent as JSON: the error says which Content-Type it needs.
    resp = _submit(client, auth, TINY, content_type="application/json")
    assert resp.status_code == 422 and "send it with Content-Type: application/yaml" in _fields(resp)["body"]


def test_a_plan_refuses_a_query_parameter_it_does_not_take(client, auth):
    """A misspelt ?devcies=8 planned for the recipe's own device count, silently."""
    headers = {**auth, "Content-Type": "application/yaml"}
    resp = client.post("/v1/plans?devcies=8&top=1", content=TINY, headers=headers)
    assert resp.status_code == 422 and "takes devices, top, device" in _fields(resp)["query.devcies"]
    assert client.post("/v1/plans?devices=1&top=1", content=TINY, headers=headers).status_code == 200


def test_a_plan_while_another_is_being_made_is_told_to_come_back(client, auth):
    """Plans ran at once without limit: a reader sending several large ones starved the service."""
    from api.routes import plans

    headers = {**auth, "Content-Type": "application/yaml"}
    assert plans._PLANNING.acquire(blocking=False)  # a plan in progress
    try:
        busy = client.post("/v1/plans?devices=1&top=1", content=TINY, headers=headers)
    finally:
        plans._PLANNING.release()
    assert busy.status_code == 429 and busy.headers["Retry-After"] == "5"
    assert "another plan is being made" in busy.json()["detail"]
    assert client.post("/v1/plans?devices=1&top=1", content=TINY, headers=headers).status_code == 200


# ---- jobs ---------------------------------------------------------------------------------------


def test_submit_list_read_and_cancel_jobs(client, auth):
    resp = _submit(client, auth)
    assert resp.status_code == 202
    job = resp.json()
    assert resp.headers["Location"] == job["links"]["self"] == f"/v1/jobs/{job['id']}"
    assert (job["state"], job["trials_total"], job["name"]) == ("queued", 3, "gpt-tiny")
    as_json = json.dumps(yaml.safe_load(TINY))
    assert _submit(client, auth, as_json, "application/json").status_code == 202
    ids = [job["id"]] + [_submit(client, auth).json()["id"] for _ in range(3)]

    page = client.get("/v1/jobs?limit=3", headers=auth).json()
    assert len(page["items"]) == 3 and page["next_cursor"]
    rest = client.get(f"/v1/jobs?limit=3&cursor={page['next_cursor']}", headers=auth).json()
    assert rest["next_cursor"] is None
    assert len({j["id"] for j in page["items"] + rest["items"]}) == 5

    cancelled = client.post(f"/v1/jobs/{ids[0]}/cancel", headers=auth)
    assert cancelled.status_code == 202 and cancelled.json()["state"] == "cancelled"
    again = client.post(f"/v1/jobs/{ids[0]}/cancel", headers=auth)
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]
    only = client.get("/v1/jobs?state=cancelled", headers=auth).json()["items"]
    assert [j["id"] for j in only] == [ids[0]]
    missing = client.get("/v1/jobs/999999", headers=auth)
    assert missing.status_code == 404 and "not found" in missing.json()["detail"]
    assert client.get("/v1/jobs?state=bogus", headers=auth).status_code == 422
    assert "state" in _fields(client.get("/v1/jobs?state=bogus", headers=auth))


def test_build_is_409_while_running_and_404_with_reason_when_absent(client, auth, url):
    job_id = _submit(client, auth).json()["id"]
    resp = client.get(f"/v1/jobs/{job_id}/build", headers=auth)
    assert resp.status_code == 409 and "built when the job succeeds" in resp.json()["detail"]
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        job.state, job.error = "failed", "no trial finished ok"
    resp = client.get(f"/v1/jobs/{job_id}/build", headers=auth)
    assert resp.status_code == 404 and "no trial finished ok" in resp.json()["detail"]


def test_build_download_carries_its_checksum_and_filename(client, auth, url, tmp_path):
    job_id = _submit(client, auth).json()["id"]
    tarball = tmp_path / "7.tar.gz"
    tarball.write_bytes(b"\x1f\x8b" + bytes(range(256)) * 40)
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    with session_scope(url) as s:
        s.get(Job, job_id).state = "succeeded"
        s.add(
            Build(
                job_id=job_id, study_name="s", trial_number=7, path=str(tarball), sha256=digest, size_bytes=1
            )
        )
    resp = client.get(f"/v1/jobs/{job_id}/build", headers=auth)
    assert resp.status_code == 200
    assert resp.headers["X-Checksum-Sha256"] == digest == hashlib.sha256(resp.content).hexdigest()
    assert 'filename="7.tar.gz"' in resp.headers["Content-Disposition"]
    # A byte flipped on disk: it was served as before, under the stored checksum.
    damaged = bytearray(tarball.read_bytes())
    damaged[100] ^= 0xFF
    tarball.write_bytes(bytes(damaged))
    os.utime(tarball, ns=(1, 1))  # a new modification time, as any write gives
    resp = client.get(f"/v1/jobs/{job_id}/build", headers=auth)
    assert resp.status_code == 409 and "no longer matches its checksum" in resp.json()["detail"]
    tarball.unlink()
    resp = client.get(f"/v1/jobs/{job_id}/build", headers=auth)
    assert resp.status_code == 404 and "missing from the artifact store" in resp.json()["detail"]


# ---- trials straight from Optuna's tables -------------------------------------------------------


def _fill_study(url: str, name: str, n: int) -> None:
    """A real Optuna study with `n` trials, inserted in bulk (the Optuna API would take minutes)."""
    import optuna
    from optuna.distributions import CategoricalDistribution, distribution_to_json

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=url, direction="maximize")
    sid = study._study_id
    mbs = distribution_to_json(CategoricalDistribution([1, 2, 4, 8]))
    split = distribution_to_json(CategoricalDistribution(["dp1-tp1-pp1"]))
    start = dt.datetime(2026, 1, 1)
    trials, values, params, attrs = [], [], [], []
    for i in range(n):
        tid = i + 1
        status = "oom" if i % 10 == 9 else "ok"
        state = "FAIL" if status == "oom" else "COMPLETE"
        trials.append(
            {
                "trial_id": tid,
                "number": i,
                "study_id": sid,
                "state": state,
                "datetime_start": start,
                "datetime_complete": start + dt.timedelta(seconds=i % 20),
            }
        )
        if state == "COMPLETE":
            values.append({"trial_id": tid, "objective": 0, "value": float(i), "value_type": "FINITE"})
        params += [
            {
                "trial_id": tid,
                "param_name": "micro_batch_size",
                "param_value": float(i % 4),
                "distribution_json": mbs,
            },
            {"trial_id": tid, "param_name": "parallel", "param_value": 0.0, "distribution_json": split},
        ]
        attrs += [{"trial_id": tid, "key": "status", "value_json": json.dumps(status)},
                  {"trial_id": tid, "key": "tokens_per_s", "value_json": json.dumps(float(i))}]  # fmt: skip
    # Through the declarations pinned to Optuna's schema (tests/test_optuna_tables.py), not
    # Optuna's private models.
    from tuner import optuna_tables as t

    with get_engine(url).begin() as conn:
        conn.execute(insert(t.trials), trials)
        conn.execute(insert(t.values), values)
        conn.execute(insert(t.params), params)
        conn.execute(insert(t.user_attrs), attrs)


def test_trials_page_fast_over_ten_thousand_trials(client, auth, url):
    job_id = _submit(client, auth).json()["id"]
    with session_scope(url) as s:
        s.get(Job, job_id).study_name = "big"
    _fill_study(url, "big", 10_000)
    base = f"/v1/jobs/{job_id}/trials"
    client.get(base, headers=auth)  # warm the connection pool
    t0 = time.perf_counter()
    page = client.get(f"{base}?limit=50", headers=auth).json()
    elapsed = time.perf_counter() - t0
    print(f"GET one page of 10,000 trials: {elapsed * 1000:.0f} ms")
    assert elapsed < 1.0, f"one page of 10,000 trials took {elapsed:.2f}s"
    assert page["total"] == 10_000 and [t["number"] for t in page["items"]] == list(range(50))
    first = page["items"][1]
    assert first["config"]["micro_batch_size"] == 2 and first["status"] == "ok" and first["duration_s"] == 1.0
    nxt = client.get(f"{base}?limit=50&cursor={page['next_cursor']}", headers=auth).json()
    assert nxt["items"][0]["number"] == 50
    # Items are built by hand for speed: exactly what the TrialPublic model would send.
    from api.schemas import TrialPublic

    assert all(TrialPublic(**t).model_dump(mode="json") == t for t in page["items"] + nxt["items"])

    fastest = client.get(f"{base}?limit=3&sort=-tokens_per_s", headers=auth).json()["items"]
    assert [t["number"] for t in fastest] == [9998, 9997, 9996]
    oom = client.get(f"{base}?status=oom&limit=500", headers=auth).json()
    assert oom["total"] == 1000 and {t["status"] for t in oom["items"]} == {"oom"}
    assert {t["state"] for t in oom["items"]} == {"fail"}
    bad = client.get(f"{base}?sort=speed", headers=auth)
    assert bad.status_code == 422 and "sort" in _fields(bad)

    metrics = client.get("/metrics").text
    assert 'tuner_trials{status="oom"} 1000' in metrics
    assert "tuner_trial_duration_seconds_count 10000" in metrics
    assert 'tuner_jobs{state="queued"} 1' in metrics


def test_a_trials_re_measurements_are_served_with_it(client, auth, url):
    """A trial's page gave one run's tokens/s while the ranking (and /best) took the median over
    its re-measurements too: a client comparing the two, as the nightly does, could not tell."""
    import optuna

    from tuner.record.keys import remeasured_key

    job_id = _submit(client, auth).json()["id"]
    with session_scope(url) as s:
        s.get(Job, job_id).study_name = "again"
    _fill_study(url, "again", 4)
    study = optuna.load_study(study_name="again", storage=url)
    study.set_user_attr(remeasured_key(2), [3.0, 2.5])
    items = client.get(f"/v1/jobs/{job_id}/trials", headers=auth).json()["items"]
    assert [t["remeasured_tokens_per_s"] for t in items] == [[], [], [3.0, 2.5], []]
    assert items[2]["tokens_per_s"] == 2.0


def test_best_of_a_finished_job_comes_from_its_stored_summary(client, auth, url):
    job_id = _submit(client, auth).json()["id"]
    assert client.get(f"/v1/jobs/{job_id}/best", headers=auth).status_code == 404
    best = {"trial": 4, "config": {"micro_batch_size": 8}, "tokens_per_s": 900.0, "metrics": {"mfu": 0.4}}
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        job.state, job.study_name = "succeeded", "gone-from-optuna"
        job.summary = {"best": best, "baseline": {"tokens_per_s": 300.0}, "speedup": 3.0, "counts": {"ok": 5}}
    resp = client.get(f"/v1/jobs/{job_id}/best", headers=auth).json()
    assert (resp["trial"], resp["speedup"], resp["baseline_tokens_per_s"]) == (4, 3.0, 300.0)


def test_best_of_a_running_job_follows_new_trials(client, auth, url):
    job_id = _submit(client, auth).json()["id"]
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        job.state, job.study_name = "running", "live"
    _fill_study(url, "live", 30)
    first = client.get(f"/v1/jobs/{job_id}/best", headers=auth).json()
    assert first["trial"] == 28 and first["counts"]["ok"] == 27  # 29 is an oom
    import optuna

    study = optuna.load_study(study_name="live", storage=url)
    trial = study.ask({"micro_batch_size": optuna.distributions.CategoricalDistribution([1, 2, 4, 8])})
    trial.set_user_attr("tokens_per_s", 1e6)
    study.tell(trial, 1e6)  # a new best arrives: the cached summary must not hide it
    assert client.get(f"/v1/jobs/{job_id}/best", headers=auth).json()["trial"] == 30


def test_a_trials_result_says_where_it_ran(client, auth, url):
    """A multi-node trial's listing names its node count and each rank's node, so a user sees
    which ranks shared a machine."""
    job_id = _submit(client, auth).json()["id"]
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        job.state, job.study_name = "running", "spread"
    import optuna

    study = optuna.create_study(study_name="spread", storage=url, direction="maximize")
    trial = study.ask({"micro_batch_size": optuna.distributions.CategoricalDistribution([1, 2])})
    for key, value in {"status": "ok", "tokens_per_s": 10.0, "nodes": 2, "rank_nodes": ["a", "b"]}.items():
        trial.set_user_attr(key, value)
    study.tell(trial, 10.0)
    [row] = client.get(f"/v1/jobs/{job_id}/trials", headers=auth).json()["items"]
    assert (row["result"]["nodes"], row["result"]["rank_nodes"]) == (2, ["a", "b"])


# ---- events -------------------------------------------------------------------------------------


def _sse(text: str) -> list[dict]:
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        events.append({"id": int(fields["id"]), "event": fields["event"], "data": json.loads(fields["data"])})
    return events


def test_events_stream_until_done_and_resume_from_last_event_id(client, auth, url):
    job_id = _submit(client, auth).json()["id"]
    with session_scope(url) as s:
        for n in range(3):
            add_event(s, job_id, "trial_finished", {"trial": n, "done": n + 1, "total": 3})
        add_event(s, job_id, "done", {"state": "succeeded"})
        job = s.get(Job, job_id)
        job.state, job.finished_at = "succeeded", utcnow()
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=auth) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _sse(resp.read().decode())
    assert [e["event"] for e in events] == [
        "queued",
        "trial_finished",
        "trial_finished",
        "trial_finished",
        "done",
    ]
    assert events[2]["data"]["trial"] == 1
    resumed = client.get(f"/v1/jobs/{job_id}/events", headers={**auth, "Last-Event-ID": str(events[2]["id"])})
    assert [e["data"].get("trial") for e in _sse(resumed.text)] == [2, None]


def test_health_readiness_and_search_spaces(client, auth, url):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["checks"]["database"]["ok"]
    spaces = {s["name"]: s for s in client.get("/v1/search-spaces", headers=auth).json()}
    assert "cpu" in spaces and 1 in spaces["cpu"]["knobs"]["micro_batch_size"]
    with _client(url, executor="ray", ray_address="127.0.0.1:1") as c:
        resp = c.get("/readyz")
        assert resp.status_code == 503 and "RAY_ADDRESS" in resp.json()["checks"]["executor"]["detail"]
    assert client.get("/", follow_redirects=False).status_code in (302, 307)


def test_a_422_says_what_to_send_instead_of_showing_a_regex(client, auth):
    """`cursor=abc` answered "String should match pattern '^[0-9]{1,12}$'"."""
    cursor = client.get("/v1/jobs?cursor=abc", headers=auth)
    assert (
        cursor.status_code == 422 and _fields(cursor)["cursor"] == "must be a whole number of 1 to 12 digits"
    )
    job_id = _submit(client, auth).json()["id"]
    sort = client.get(f"/v1/jobs/{job_id}/trials?sort=speed", headers=auth)
    assert _fields(sort)["sort"] == "must be one of number, -number, tokens_per_s, -tokens_per_s"
