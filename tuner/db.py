"""The service's own tables (jobs, job events, builds, API tokens, nightly results, study snapshots)
and the one `session_scope()` that owns commit, rollback and error translation. Optuna's tables
share the database."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, get_args

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Engine,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    exc,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

# One default database and one rule for resolving it: tuner.settings (re-exported for callers here).
from tuner.settings import DEFAULT_DATABASE_URL, absolute_database_url, database_url  # noqa: F401

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JOB_STATES: tuple[str, ...] = get_args(JobState)
QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = JOB_STATES
FINAL_STATES = (SUCCEEDED, FAILED, CANCELLED)


class DatabaseError(RuntimeError):
    """The database refused or could not be reached; the message says which and what to check."""


def utcnow() -> dt.datetime:
    # Naive UTC: SQLite drops tzinfo anyway, so both backends store and return the same thing.
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, dt.datetime: DateTime}


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    recipe_name: Mapped[str] = mapped_column(String(200))
    recipe: Mapped[dict[str, Any]]
    recipe_hash: Mapped[str] = mapped_column(String(64), index=True)
    study_name: Mapped[str | None] = mapped_column(String(512))
    state: Mapped[str] = mapped_column(String(16), index=True, default="queued")
    trials_done: Mapped[int] = mapped_column(default=0)
    trials_total: Mapped[int] = mapped_column(default=0)
    best_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    baseline_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    speedup: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)  # one line: what failed and what to do next
    log: Mapped[str | None] = mapped_column(Text)  # the failure's full log (GET /v1/jobs/ID/log)
    # Measured trials the job found in its study when it started (same recipe and fingerprint).
    trials_reused: Mapped[int | None] = mapped_column(Integer)
    # The study summary the job ended with, so reading a finished job's best never re-reads its trials.
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    # The worker's heartbeat: a running job whose updated_at stops moving lost its worker.
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    payload: Mapped[dict[str, Any]]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Build(Base):
    __tablename__ = "builds"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    study_name: Mapped[str] = mapped_column(String(512))
    trial_number: Mapped[int]
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[dt.datetime | None]


class NightlyResult(Base):
    __tablename__ = "nightly_results"
    __table_args__ = (UniqueConstraint("recipe_name", "night", name="uq_nightly_recipe_night"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    recipe_name: Mapped[str] = mapped_column(String(200))
    night: Mapped[dt.date]
    fingerprint_hash: Mapped[str] = mapped_column(String(64))
    fingerprint: Mapped[dict[str, Any]]
    best_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    previous_best_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    change_pct: Mapped[float | None] = mapped_column(Float)
    verdict: Mapped[str] = mapped_column(String(32))  # e.g. ok | improved | regression | failed
    config: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    study_name: Mapped[str | None] = mapped_column(String(512))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    # Relative half-width of the best's 95% interval (`Ranked.ci`): the noise the next night's
    # verdict allows for. None: not measured with intervals (older rows, or a failed night).
    best_ci: Mapped[float | None] = mapped_column(Float)
    # `nightly.history.night_key` (`Recipe.hash()`, name and budget excluded, and the search space
    # where it is not the default): a night is compared only with nights of the same recipe and
    # space. None: recorded before the hash was (compared, as then).
    recipe_hash: Mapped[str | None] = mapped_column(String(64))
    # The night this one was compared with and what differed in the fingerprint between the two
    # ({key: [before, after]}), as the report said them.
    compared_night: Mapped[dt.date | None]
    fingerprint_changes: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class StudySnapshot(Base):
    """A study's finished trials as compact rows (zlib-compressed JSON, `tuner.record.snapshot`), so a
    reader skips the ~25 Optuna parameter and attribute rows per trial it would otherwise read."""

    __tablename__ = "study_snapshots"

    study_name: Mapped[str] = mapped_column(String(512), primary_key=True)
    trials: Mapped[int]
    data: Mapped[bytes] = mapped_column(LargeBinary)
    saved_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets the API read while a worker writes; the busy timeout turns lock contention into
    # a short wait instead of "database is locked".
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def get_engine(url: str | None = None) -> Engine:
    """One engine per URL per process (engines own connection pools). A relative SQLite file is
    resolved against the current directory here too, so both spellings share one engine."""
    url = absolute_database_url(url or database_url())
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None:
            try:
                if url.startswith("sqlite"):
                    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
                    event.listen(engine, "connect", _sqlite_pragmas)
                else:
                    engine = create_engine(url, pool_pre_ping=True)
            except (exc.ArgumentError, exc.NoSuchModuleError, ImportError) as err:
                raise DatabaseError(
                    f"TUNER_DATABASE_URL: cannot use {_redact(url)!r}: {err}; "
                    "expected e.g. sqlite:///tuner.db or postgresql+psycopg://user@host:5432/db"
                ) from None
            _engines[url] = engine
        return engine


def dispose_engines() -> None:
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


def _redact(url: str) -> str:
    # Never echo a password from the URL into a log or an HTTP error.
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}" if ":" in creds else url
    return url


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """A transaction: commits on success, rolls back on error, and turns driver errors into
    `DatabaseError` with a message a user can act on."""
    factory = sessionmaker(get_engine(url), expire_on_commit=False)
    session = factory()
    try:
        yield session
        session.commit()
    except exc.OperationalError as err:
        session.rollback()
        if "no such table" in str(err.orig) or "no such column" in str(err.orig):
            raise DatabaseError(
                f"database schema is missing or old ({err.orig}); run `tuner db upgrade`"
            ) from err
        raise DatabaseError(
            f"database {_redact(url or database_url())} is unavailable or locked: {err.orig}; "
            "check TUNER_DATABASE_URL and that the server is running, then `tuner db upgrade`"
        ) from err
    except exc.ProgrammingError as err:
        session.rollback()
        raise DatabaseError(
            f"database schema is missing or old ({err.orig}); run `tuner db upgrade`"
        ) from err
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def add_event(session: Session, job_id: int, kind: str, payload: dict[str, Any]) -> JobEvent:
    ev = JobEvent(job_id=job_id, kind=kind, payload=payload)
    session.add(ev)
    return ev
