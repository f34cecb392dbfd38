"""`tuner db upgrade|current` and `tuner token create|list|revoke` as a user runs them."""

from __future__ import annotations

import hashlib

from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.db import ApiToken, session_scope
from tuner.migrations import head_revision


def _run(url: str, *args: str):
    return CliRunner().invoke(app, list(args), env={"TUNER_DATABASE_URL": url})


def test_db_upgrade_then_current(tmp_path):
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    first = _run(url, "db", "upgrade")
    assert first.exit_code == 0 and f"empty -> {head_revision()}" in first.output
    assert "(current)" in _run(url, "db", "upgrade").output
    assert "current" in _run(url, "db", "current").output


def test_db_upgrade_on_an_unreachable_server_is_a_clean_error(tmp_path):
    result = _run("postgresql+psycopg://postgres@127.0.0.1:1/none", "db", "upgrade")
    assert result.exit_code == 2 and "TUNER_DATABASE_URL" in result.output
    assert "Traceback" not in result.output


def test_token_is_shown_once_and_stored_hashed(tmp_path):
    url = f"sqlite:///{tmp_path / 'tuner.db'}"
    created = _run(url, "token", "create", "--name", "ci-bot")
    assert created.exit_code == 0
    token = created.stdout.strip().splitlines()[0]
    assert token.startswith("tnr_")
    with session_scope(url) as s:
        row = s.query(ApiToken).one()
        assert row.token_sha256 == hashlib.sha256(token.encode()).hexdigest()
    again = _run(url, "token", "create", "--name", "ci-bot")
    assert again.exit_code == 2 and "exists" in again.output
    assert "active" in _run(url, "token", "list").output
    assert _run(url, "token", "revoke", "ci-bot").exit_code == 0
    assert "revoked" in _run(url, "token", "list").output
    missing = _run(url, "token", "revoke", "nobody")
    assert missing.exit_code == 2 and "tuner token list" in missing.output
    bad = _run(url, "token", "create", "--name", "has space")
    assert bad.exit_code == 2 and "--name" in bad.output
