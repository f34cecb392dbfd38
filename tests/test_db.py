"""The service tables and their migration: on SQLite (WAL) and PostgreSQL, next to Optuna's own
tables, with session_scope's rollback and its readable errors."""

from __future__ import annotations

import os
import uuid

import pytest
from sqlalchemy import create_engine, inspect, select, text

from tuner.db import DatabaseError, Job, JobEvent, add_event, get_engine, session_scope
from tuner.migrations import VERSION_TABLE, current_revision, head_revision, is_current, upgrade

PG_URL = os.environ.get("TUNER_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SERVICE_TABLES = {"jobs", "job_events", "builds", "api_tokens", "nightly_results"}


def fresh_pg_database() -> tuple[str, callable]:
    """A new, empty database on the test server (other test runs share the server); and its dropper."""
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"tuner_test_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as err:  # noqa: BLE001
        admin.dispose()
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}: {err}")
    url = PG_URL.rsplit("/", 1)[0] + f"/{name}"

    def drop() -> None:
        from tuner.db import dispose_engines

        dispose_engines()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return url, drop


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tuner.db'}"
        return
    url, drop = fresh_pg_database()
    yield url
    drop()


def test_upgrade_creates_service_tables_and_is_idempotent(db_url):
    assert current_revision(db_url) is None
    before, after = upgrade(db_url)
    assert (before, after) == (None, head_revision())
    assert set(inspect(get_engine(db_url)).get_table_names()) >= SERVICE_TABLES
    assert upgrade(db_url) == (head_revision(), head_revision())
    assert is_current(db_url)


def test_the_migrations_build_every_column_the_code_reads(db_url):
    """A column added to `tuner.db` without a migration would fail on every upgraded database."""
    from tuner.db import Base

    upgrade(db_url)
    found = inspect(get_engine(db_url))
    for table in Base.metadata.sorted_tables:
        assert {c["name"] for c in found.get_columns(table.name)} == set(table.columns.keys()), table.name


def test_upgrade_from_the_first_revision_keeps_the_jobs(db_url):
    upgrade(db_url, "0001")
    with get_engine(db_url).begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (recipe_name, recipe, recipe_hash, state, trials_done, trials_total,"
                " cancel_requested, attempts, created_at, updated_at) VALUES ('old', '{}', 'h', 'succeeded',"
                " 3, 3, false, 1, '2026-01-01 00:00:00', '2026-01-01 00:00:00')"
            )
        )
    assert upgrade(db_url) == ("0001", head_revision())
    with session_scope(db_url) as s:
        job = s.scalars(select(Job)).one()
        assert (job.recipe_name, job.trials_done, job.summary) == ("old", 3, None)


def test_service_and_optuna_share_a_database_without_clashing(db_url):
    import optuna

    upgrade(db_url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=db_url, direction="maximize")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    # Optuna's history lives in alembic_version, ours in our own table: neither overwrites the other.
    assert upgrade(db_url) == (head_revision(), head_revision())
    names = set(inspect(get_engine(db_url)).get_table_names())
    assert {"alembic_version", VERSION_TABLE, "trials"} | SERVICE_TABLES <= names
    assert len(optuna.load_study(study_name="s", storage=db_url).trials) == 2


def test_session_scope_commits_or_rolls_back(db_url):
    upgrade(db_url)
    with session_scope(db_url) as s:
        job = Job(recipe_name="r", recipe={"name": "r"}, recipe_hash="h")
        s.add(job)
        s.flush()
        add_event(s, job.id, "queued", {"state": "queued"})
    with pytest.raises(ZeroDivisionError), session_scope(db_url) as s:
        s.add(Job(recipe_name="lost", recipe={}, recipe_hash="h"))
        s.flush()
        1 / 0  # noqa: B018
    with session_scope(db_url) as s:
        assert [j.recipe_name for j in s.scalars(select(Job))] == ["r"]
        assert s.scalars(select(JobEvent)).one().payload == {"state": "queued"}


def test_sqlite_uses_wal_so_readers_do_not_block_the_worker(tmp_path):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    with get_engine(url).connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000


def test_unreachable_database_gives_an_actionable_error():
    url = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere"
    with pytest.raises(DatabaseError, match="TUNER_DATABASE_URL"), session_scope(url) as s:
        s.execute(text("SELECT 1"))


def test_missing_schema_says_to_run_upgrade(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    with (
        pytest.raises(DatabaseError, match="schema is missing or old.*tuner db upgrade"),
        session_scope(url) as s,
    ):
        s.execute(select(Job))
