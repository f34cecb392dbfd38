"""The settings of every entry point (CLI, `tuner serve`, `tuner worker`), read from the environment and
checked in one place, with every path resolved to an absolute one once, here.

Nothing downstream depends on the current working directory: a trial's launcher and ranks run in the
trial's own directory, a worker may be started from anywhere, so a relative `builds` or
`sqlite:///tuner.db` would mean a different place to each of them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import sqlalchemy

DEFAULT_DATABASE_URL = "sqlite:///tuner.db"
DEFAULT_ARTIFACT_DIR = "builds"
DEFAULT_RUNS_DIR = "runs"


class SettingsError(ValueError):
    """A setting that cannot be used; the message names the variable and the fix."""


def absolute_database_url(url: str, cwd: str | Path | None = None) -> str:
    """`url` with a relative SQLite file made absolute against `cwd` (default: the current directory).

    Other databases, in-memory SQLite and unparsable URLs come back unchanged (the code that opens
    them reports the error with the option's name)."""
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        return url
    path = parsed.database
    if (
        not parsed.drivername.startswith("sqlite")
        or not path
        or path == ":memory:"
        or path.startswith("file:")
    ):
        return url
    if Path(path).is_absolute():
        return url
    absolute = Path(cwd or os.getcwd(), path).absolute()
    return parsed.set(database=str(absolute)).render_as_string(hide_password=False)


def shown_url(url: str) -> str:
    """`url` as a message or an output may show it: its password replaced by `***` (a cron mails
    its log, and TUNER_DATABASE_URL usually carries one). One rule for every command."""
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError:  # not a URL SQLAlchemy reads: hide what looks like one
        return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)
    # Rendering escapes the path (`:memory:` becomes `%3Amemory%3A`): only a password's URL is.
    return url if parsed.password is None else parsed.render_as_string(hide_password=True)


def absolute_path(path: str | Path, cwd: str | Path | None = None) -> Path:
    """`path` made absolute against `cwd` (default: the current directory), `~` expanded."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(cwd or os.getcwd(), p).absolute()


def database_url(environ: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> str:
    """`TUNER_DATABASE_URL`, else the SQLite file `tuner.db` in the current directory; absolute."""
    env = os.environ if environ is None else environ
    return absolute_database_url(env.get("TUNER_DATABASE_URL") or DEFAULT_DATABASE_URL, cwd)


def artifact_dir(environ: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> Path:
    """`TUNER_ARTIFACT_DIR`, else `./builds`; absolute."""
    env = os.environ if environ is None else environ
    return absolute_path(env.get("TUNER_ARTIFACT_DIR") or DEFAULT_ARTIFACT_DIR, cwd)


def runs_dir(environ: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> Path:
    """Where trials write their logs and results: `TUNER_RUNS_DIR`, else `./runs`; absolute."""
    env = os.environ if environ is None else environ
    return absolute_path(env.get("TUNER_RUNS_DIR") or DEFAULT_RUNS_DIR, cwd)


def cache_dir(environ: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> Path | None:
    """`TUNER_CACHE_DIR` (the device layer's measured peaks), absolute; None: not set (the device
    layer then uses ~/.cache/tuner). Trial ranks read it in their own directory, so a relative
    value must be resolved here, before a trial starts."""
    env = os.environ if environ is None else environ
    raw = (env.get("TUNER_CACHE_DIR") or "").strip()
    return absolute_path(raw, cwd) if raw else None


def mlflow_tracking_uri(
    environ: Mapping[str, str] | None = None, cwd: str | Path | None = None
) -> str | None:
    """`TUNER_MLFLOW_TRACKING_URI` (None: no MLflow logging); a plain or relative `file:` path made
    absolute, so the driver logs to the same store wherever it runs."""
    env = os.environ if environ is None else environ
    uri = (env.get("TUNER_MLFLOW_TRACKING_URI") or "").strip()
    if not uri:
        return None
    if "://" not in uri:
        return absolute_path(uri.removeprefix("file:"), cwd).as_uri()
    return uri


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 1) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer; set it to e.g. {default}") from None
    if value < minimum:
        raise SettingsError(f"{name}={value} must be >= {minimum}; set it to e.g. {default}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean; use true or false")


@dataclass(frozen=True)
class Settings:
    """Everything the service and the CLI read from the environment. Paths are absolute."""

    # TUNER_DATABASE_URL: Optuna's tables and the service's share this one database.
    database_url: str = field(default_factory=database_url)
    # TUNER_ARTIFACT_DIR: the artifact store of builds (`<dir>/<study>/<trial>.tar.gz`).
    artifact_dir: Path = field(default_factory=artifact_dir)
    # TUNER_RUNS_DIR: each trial's working directory (logs, result.json, profile) lives under it.
    runs_dir: Path = field(default_factory=runs_dir)
    # TUNER_EXECUTOR: where a worker runs trials, local or ray.
    executor: str = "local"
    # RAY_ADDRESS: the Ray cluster of the ray executor (None: a local Ray runtime).
    ray_address: str | None = None
    # TUNER_PUBLIC_READS: GETs without a token (a dashboard on a trusted network).
    public_reads: bool = False
    # TUNER_MAX_BODY_BYTES: the largest request body the API accepts.
    max_body_bytes: int = 1_048_576
    # TUNER_MAX_TRIALS, TUNER_MAX_TIMEOUT_MIN: a job's caps on this service.
    max_trials: int = 1000
    max_timeout_min: int = 24 * 60
    # TUNER_REMEASURE_TOP: configs measured again before a job names its winner (0: trust one run).
    remeasure_top: int = 3
    # TUNER_BUILD: build the winner's kernels (false: e.g. no compiler on the workers).
    build: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> Settings:
        """Read and check every setting; a bad value raises SettingsError naming the variable."""
        env = os.environ if environ is None else environ
        executor = (env.get("TUNER_EXECUTOR") or "local").strip()
        from tuner.executors import unknown_executor

        if (why := unknown_executor(executor, "TUNER_EXECUTOR")) is not None:
            raise SettingsError(why)
        return cls(
            database_url=database_url(env, cwd),
            artifact_dir=artifact_dir(env, cwd),
            runs_dir=runs_dir(env, cwd),
            executor=executor,
            ray_address=env.get("RAY_ADDRESS") or None,
            public_reads=_bool(env, "TUNER_PUBLIC_READS", cls.public_reads),
            max_body_bytes=_int(env, "TUNER_MAX_BODY_BYTES", cls.max_body_bytes),
            max_trials=_int(env, "TUNER_MAX_TRIALS", cls.max_trials),
            max_timeout_min=_int(env, "TUNER_MAX_TIMEOUT_MIN", cls.max_timeout_min),
            remeasure_top=_int(env, "TUNER_REMEASURE_TOP", cls.remeasure_top, minimum=0),
            build=_bool(env, "TUNER_BUILD", cls.build),
        )

    def with_paths(self, cwd: str | Path | None = None, **changes: object) -> Settings:
        """A copy with `changes`; paths and SQLite files among them resolved against `cwd`."""
        if "database_url" in changes:
            changes["database_url"] = absolute_database_url(str(changes["database_url"]), cwd)
        for name in ("artifact_dir", "runs_dir"):
            if name in changes:
                changes[name] = absolute_path(changes[name], cwd)  # type: ignore[arg-type]
        return replace(self, **changes)  # type: ignore[arg-type]

    def environ(self) -> dict[str, str]:
        """These settings as environment variables, for child processes (a worker of `tuner serve`)."""
        env = {
            "TUNER_DATABASE_URL": self.database_url,
            "TUNER_ARTIFACT_DIR": str(self.artifact_dir),
            "TUNER_RUNS_DIR": str(self.runs_dir),
            "TUNER_EXECUTOR": self.executor,
            "TUNER_PUBLIC_READS": str(self.public_reads).lower(),
            "TUNER_MAX_BODY_BYTES": str(self.max_body_bytes),
            "TUNER_MAX_TRIALS": str(self.max_trials),
            "TUNER_MAX_TIMEOUT_MIN": str(self.max_timeout_min),
            "TUNER_REMEASURE_TOP": str(self.remeasure_top),
            "TUNER_BUILD": str(self.build).lower(),
        }
        if self.ray_address:
            env["RAY_ADDRESS"] = self.ray_address
        return env
