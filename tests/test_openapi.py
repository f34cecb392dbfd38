"""The OpenAPI document tells the truth about errors: every error of every operation is declared
with the body the API really sends (ErrorBody), so a client generated from it reads them right."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from api import Settings, create_app
from api.auth import create_token
from tuner.db import Job, session_scope

ERROR_BODY = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'tuner.db'}"


@pytest.fixture
def client(url):
    with TestClient(create_app(Settings(database_url=url))) as c:  # entering runs the migration
        yield c


@pytest.fixture
def doc(client):
    return client.get("/openapi.json").json()


def _errors(doc: dict) -> dict[str, set[int]]:
    """'METHOD /path' -> the error statuses (4xx, 5xx) its operation declares."""
    return {
        f"{method.upper()} {path}": {int(s) for s in op["responses"] if s[0] in "45"}
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
    }


def test_every_4xx_of_every_operation_is_an_error_body(doc):
    assert "HTTPValidationError" not in json.dumps(doc)
    assert "ValidationError" not in doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for status, response in op["responses"].items():
                if status.startswith("4"):
                    assert response.get("content") == ERROR_BODY, (method, path, status)
                    assert response["description"], (method, path, status)
    body = doc["components"]["schemas"]["ErrorBody"]
    assert set(body["required"]) == {"detail", "errors"}  # the API always sends both


def test_each_operation_declares_the_errors_it_can_answer(doc):
    errors = _errors(doc)
    assert errors["POST /v1/jobs"] == {401, 403, 413, 415, 422, 503}
    assert errors["GET /v1/jobs"] == {401, 403, 422, 503}  # a list has no job to miss: no 404
    assert errors["POST /v1/jobs/{job_id}/cancel"] == {401, 403, 404, 409, 422, 503}
    assert errors["GET /v1/jobs/{job_id}/events"] == {401, 403, 404, 422, 503}
    # No parameters, but a /v1 operation refuses a query parameter it does not take.
    assert errors["GET /v1/search-spaces"] == {401, 403, 422, 503}
    assert errors["GET /ui/api/compare"] == {401, 403, 404, 422, 503}
    assert errors["GET /ui/api/recipes/{recipe_name}/history"] == {401, 403, 422, 503}
    assert errors["GET /metrics"] == {503}  # no token needed
    assert errors["GET /healthz"] == set()  # touches nothing that can fail
    # Readiness reports "not ready" as data, not as an ErrorBody.
    ready = doc["paths"]["/readyz"]["get"]["responses"]["503"]["content"]["application/json"]
    assert ready["schema"] == {"$ref": "#/components/schemas/Readiness"}


def test_a_bad_event_cursor_is_the_documented_422(client, doc, url):
    with session_scope(url) as s:
        token = create_token(s, "reader")
        job = Job(recipe_name="r", recipe={}, recipe_hash="h", state="queued", trials_total=1)
        s.add(job)
        s.flush()
        job_id = job.id
    resp = client.get(f"/v1/jobs/{job_id}/events?after=-1", headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 422
    body = resp.json()
    assert set(body) == {"detail", "errors"} and isinstance(body["detail"], str)
    assert [e["field"] for e in body["errors"]] == ["after"] and body["errors"][0]["message"]
    declared = doc["paths"]["/v1/jobs/{job_id}/events"]["get"]["responses"]["422"]
    assert declared["content"] == ERROR_BODY
