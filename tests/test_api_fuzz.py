"""Property-based fuzzing of the OpenAPI document (schemathesis, in-process ASGI): no request,
valid or not, gets a 5xx or a response that breaks the documented schema."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import negative_data_rejection, positive_data_acceptance

from api import Settings, create_app
from api.auth import create_token
from tuner.db import session_scope
from tuner.migrations import upgrade

_DB = f"sqlite:///{Path(tempfile.mkdtemp(prefix='tuner-fuzz-')) / 'tuner.db'}"
upgrade(_DB)  # schemathesis calls the app without running its startup
with session_scope(_DB) as _s:
    TOKEN = create_token(_s, "fuzzer")

import tuner.space  # noqa: E402, F401 - imports torch; warm it so the first request is not slow

app = create_app(Settings(database_url=_DB, max_trials=20, max_timeout_min=10, max_body_bytes=65536))
schema = (
    schemathesis.openapi.from_asgi("/openapi.json", app)
    # The event stream of a queued job stays open until the job ends, which no worker here does.
    .exclude(path_regex="/events$")
    # The dashboard's JSON routes belong to its own tests.
    .exclude(path_regex="^/ui")
)


@schema.auth()
class _Bearer:
    def get(self, case, ctx):
        return TOKEN

    def set(self, case, data, ctx):
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_no_schema_violations(case):
    # A recipe has rules a JSON Schema cannot state (heads divide hidden), so a schema-valid
    # recipe may rightly get 422. And real-valued recipe fields take numeric text (YAML 1.1 reads
    # `lr: 3e-4` as a string), so some schema-invalid recipes are accepted; tests/test_recipe.py
    # and tests/test_api.py cover the recipe errors that matter (types, unknown fields, code).
    excluded = [positive_data_acceptance]
    if case.method == "POST" and case.path == "/v1/jobs":
        excluded.append(negative_data_rejection)
    case.call_and_validate(excluded_checks=excluded)
