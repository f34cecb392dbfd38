"""The service's settings, read from the environment in one place; a bad value fails at startup
with the variable's name and the fix."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tuner.db import database_url


class SettingsError(ValueError):
    pass


def _int(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer; set it to e.g. {default}") from None
    if value < minimum:
        raise SettingsError(f"{name}={value} must be >= {minimum}")
    return value


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean; use true or false")


@dataclass(frozen=True)
class Settings:
    database_url: str = field(default_factory=database_url)
    ray_address: str | None = None
    public_reads: bool = False  # GETs without a token (a dashboard on a trusted network)
    max_body_bytes: int = 1_048_576
    max_trials: int = 1000
    max_timeout_min: int = 24 * 60
    artifact_dir: str = "artifacts"
    executor: str = "local"

    @classmethod
    def from_env(cls) -> Settings:
        executor = os.environ.get("TUNER_EXECUTOR") or "local"
        if executor not in ("local", "ray"):
            raise SettingsError(f"TUNER_EXECUTOR={executor!r}: use local or ray")
        return cls(
            database_url=database_url(),
            ray_address=os.environ.get("RAY_ADDRESS") or None,
            public_reads=_bool("TUNER_PUBLIC_READS", False),
            max_body_bytes=_int("TUNER_MAX_BODY_BYTES", cls.max_body_bytes),
            max_trials=_int("TUNER_MAX_TRIALS", cls.max_trials),
            max_timeout_min=_int("TUNER_MAX_TIMEOUT_MIN", cls.max_timeout_min),
            artifact_dir=os.environ.get("TUNER_ARTIFACT_DIR") or cls.artifact_dir,
            executor=executor,
        )
