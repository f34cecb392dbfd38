"""Alembic migrations for the service's tables, shipped inside the package so an installed
`tuner db upgrade` (and the API at startup) find them without an alembic.ini."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Connection, text

from tuner.db import DatabaseError, get_engine

# Optuna keeps its own Alembic history in `alembic_version`; ours must not collide with it.
VERSION_TABLE = "tuner_alembic_version"
_PG_LOCK_KEY = 0x7475_6E65  # any constant; serialises concurrent upgrades (API + workers starting)


def _config(connection: Connection):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    cfg = _config(None)  # type: ignore[arg-type]
    return ScriptDirectory.from_config(cfg).get_current_head()


def current_revision(url: str | None = None) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with get_engine(url).connect() as conn:
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def is_current(url: str | None = None) -> bool:
    return current_revision(url) == head_revision()


def upgrade(url: str | None = None, revision: str = "head") -> tuple[str | None, str]:
    """Bring the schema to `revision`; returns (before, after). Safe to call from several processes."""
    from alembic import command
    from sqlalchemy import exc

    engine = get_engine(url)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
            from alembic.runtime.migration import MigrationContext

            before = MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE}
            ).get_current_revision()
            command.upgrade(_config(conn), revision)
            after = MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE}
            ).get_current_revision()
    except exc.OperationalError as err:
        # SQLite has no advisory lock: a second process starting at the same moment may lose the
        # race on CREATE TABLE. The winner's schema is what we wanted.
        if "already exists" in str(err.orig) and is_current(url):
            return head_revision(), head_revision()
        raise DatabaseError(f"cannot migrate the database: {err.orig}; check TUNER_DATABASE_URL") from err
    return before, after


def prepare_database(url: str | None = None, attempts: int = 3) -> tuple[str | None, str]:
    """Our schema and Optuna's, both current: what `tuner serve`, `tuner worker` and `tuner db
    upgrade` run first. Optuna creates its tables on first use, and two processes doing that at
    once on a fresh database collide ("table ... already exists"); the loser retries and finds
    them made."""
    import time

    from tuner.storage import get_storage

    result = upgrade(url)
    for attempt in range(attempts):
        try:
            get_storage(url)
            break
        except ValueError as err:
            if "already exists" not in str(err) or attempt == attempts - 1:
                raise DatabaseError(str(err)) from None
            time.sleep(0.5 * (attempt + 1))
    return result
