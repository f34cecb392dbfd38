"""A build in the builds table (the service's download finds it there)."""

from __future__ import annotations

from tuner.build.base import BuildRecord


def register(url: str, record: BuildRecord) -> int:
    """Insert the build's row (bringing the schema up to date first); returns its id."""
    from tuner.db import Build, session_scope
    from tuner.migrations import is_current, upgrade

    if not is_current(url):
        upgrade(url)
    with session_scope(url) as s:
        row = Build(
            study_name=record.study_name,
            trial_number=record.trial_number,
            path=record.path,
            sha256=record.sha256,
            size_bytes=record.size_bytes,
        )
        s.add(row)
        s.flush()
        return row.id
