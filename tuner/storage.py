"""Optuna storage: which database a study lives in, and one shared RDBStorage per URL."""

from __future__ import annotations

import os
import sqlite3
import threading
from typing import Any

import optuna
import sqlalchemy

from tuner.settings import absolute_database_url, database_url, shown_url

_SQLITE_BUSY_TIMEOUT_S = 60

_lock = threading.Lock()
_storages: dict[str, optuna.storages.RDBStorage] = {}


def default_storage_url() -> str:
    """`TUNER_DATABASE_URL`, else a SQLite file `tuner.db` in the current directory (absolute).

    Optuna's tables and the service's share one database, so this is `tuner.settings.database_url`."""
    return database_url()


def sqlite_path(url: str) -> str | None:
    """The file of a SQLite URL; None for another database or an in-memory one."""
    path = sqlalchemy.engine.make_url(url).database
    return path if path and path != ":memory:" else None


def _enable_wal(path: str, source: str = "--storage") -> None:
    # WAL lets readers (dashboard, `tuner show`, the REST service) run while a driver writes.
    # It is a property of the file, so set it once before the engine opens the database.
    try:
        con = sqlite3.connect(path, timeout=_SQLITE_BUSY_TIMEOUT_S)
        try:
            con.execute("PRAGMA journal_mode=WAL")
        finally:
            con.close()
    except sqlite3.Error as err:  # a folder that does not exist, a file that is not a database
        raise ValueError(
            f"{source}: cannot open the SQLite database {path!r}: {err}; check that its folder exists "
            "and is writable, or give another database (--storage URL or TUNER_DATABASE_URL)"
        ) from None


# Tables that make a database the tuner's: Optuna's (its studies) or the service's (its jobs).
OWN_TABLES = ("studies", "jobs")


def refuse_another_programs(
    url: str, name: str = "--storage", other: str = "another --storage, or TUNER_DATABASE_URL"
) -> None:
    """Refuse a database that holds tables and none of the tuner's (another program's, such as
    MLflow's `sqlite:///mlflow.db`): Optuna would add its tables beside them, then stop on the
    other program's schema version with a traceback that suggests updating Optuna."""
    try:
        engine = sqlalchemy.create_engine(url)
    except (sqlalchemy.exc.SQLAlchemyError, ImportError):
        return  # the open below says what is wrong with the URL
    try:
        tables = set(sqlalchemy.inspect(engine).get_table_names())
    except sqlalchemy.exc.SQLAlchemyError:
        return  # or with the database
    finally:
        engine.dispose()
    if tables and not tables & set(OWN_TABLES):
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise ValueError(
            f"{name}: {shown_url(url)!r} holds another program's tables ({shown}) and none of the tuner's; "
            f"give the tuner a database of its own ({other})"
        )


def _on_sqlite_connect(dbapi_con: Any, _record: Any) -> None:
    dbapi_con.execute(f"PRAGMA busy_timeout = {_SQLITE_BUSY_TIMEOUT_S * 1000}")
    dbapi_con.execute("PRAGMA synchronous = NORMAL")


def get_storage(url: str | None = None, source: str = "--storage") -> optuna.storages.RDBStorage:
    """The process-wide RDBStorage for `url` (default: `default_storage_url()`).

    One object per URL per process: each RDBStorage owns an engine and a connection pool. A URL
    that cannot be opened is a ValueError naming `source`, where the URL came from (the option, or
    TUNER_DATABASE_URL), with the URL's password hidden.
    """
    url = absolute_database_url(url or default_storage_url())
    if url.startswith("sqlite") and sqlite_path(url) is None:
        raise ValueError(
            f"{source}: {shown_url(url)!r} is an in-memory database, gone with its connection (and every "
            "connection gets its own); give a file, e.g. sqlite:///tuner.db"
        )
    with _lock:
        storage = _storages.get(url)
        if storage is not None:
            return storage
        refuse_another_programs(url, source)  # before anything changes in it (WAL mode is the file's)
        if url.startswith("sqlite"):
            path = sqlite_path(url)
            if path:
                _enable_wal(path, source)
            engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": _SQLITE_BUSY_TIMEOUT_S}}
        else:
            engine_kwargs = {"pool_pre_ping": True, "pool_size": 5, "max_overflow": 5}
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
        except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError) as err:
            raise ValueError(
                f"{source}: {shown_url(url)!r} is not a database URL SQLAlchemy knows: {err}"
            ) from None
        except sqlalchemy.exc.OperationalError as err:
            raise ValueError(f"{source}: cannot connect to {shown_url(url)!r}: {err.orig}") from None
        except ImportError as err:  # a dialect whose driver is not installed (mysql://, oracle://)
            raise ValueError(
                f"{source}: {shown_url(url)!r} needs a database driver that is not installed ({err}); use "
                "sqlite:///PATH or postgresql+psycopg://USER@HOST/DB, or install the driver"
            ) from None
        if url.startswith("sqlite"):
            sqlalchemy.event.listen(storage.engine, "connect", _on_sqlite_connect)
            storage.engine.dispose()  # reconnect so every pooled connection gets the pragmas
        _storages[url] = storage
        return storage


def missing_database(url: str) -> bool:
    """Whether `url` is a SQLite file that does not exist (opening it would create it empty)."""
    path = sqlite_path(url) if url.startswith("sqlite") else None
    return bool(path) and not os.path.exists(path)


def not_made_yet(url: str) -> bool:
    """Whether `url` is a SQLite file that does not exist in a folder that does: a command that
    only reads finds nothing there and must not create it. (A folder that does not exist is a
    mistyped path, which opening the database refuses, naming the option.)"""
    path = sqlite_path(url) if url.startswith("sqlite") else None
    return bool(path) and not os.path.exists(path) and os.path.isdir(os.path.dirname(path))
