"""A recipe's nightly history: best tokens/s per night, regressions, and the fingerprint changes
(torch, driver, device, ...) that coincide with them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tuner.db import NightlyResult
from tuner.nightly.history import fingerprint_changes

# The fingerprint keys people look at first when throughput moves; the rest follow.
WATCHED = (
    "torch", "driver", "device", "cpu_model", "cuda", "torch_npu", "device_count", "family", "capability",
)  # fmt: skip
MAX_NIGHTS = 400


def recipe_history(session: Session, recipe_name: str) -> dict[str, Any]:
    rows = list(
        session.scalars(
            select(NightlyResult)
            .where(NightlyResult.recipe_name == recipe_name)
            .order_by(NightlyResult.night.desc())
            .limit(MAX_NIGHTS)
        )
    )
    rows.reverse()
    nights, previous = [], None
    for row in rows:
        said = row.fingerprint_changes  # what the report said, against the night it compared
        if said is None:  # rows from before that was recorded: against the last night that measured a best
            said = fingerprint_changes(previous.fingerprint, row.fingerprint or {}) if previous else {}
        changes = [{"key": k, "before": a, "after": b} for k, (a, b) in _watched_first(said)]
        regression = row.verdict == "regression"
        nights.append(
            {
                "night": row.night.isoformat(),
                "best_tokens_per_s": row.best_tokens_per_s,
                "previous_best_tokens_per_s": row.previous_best_tokens_per_s,
                "change_pct": row.change_pct,
                "verdict": row.verdict,
                "regression": regression,
                "fingerprint_hash": row.fingerprint_hash,
                "changes": changes,
                # A regression on a night the software or hardware changed: the likely cause.
                "suspects": [c["key"] for c in changes] if regression else [],
                "study_name": row.study_name,
                "config": row.config,
                "compared_night": row.compared_night.isoformat() if row.compared_night else None,
            }
        )
        if row.best_tokens_per_s is not None and row.fingerprint:  # a failed night measured nothing
            previous = row
    return {
        "recipe_name": recipe_name,
        "nights": nights,
        "regressions": sum(1 for n in nights if n["regression"]),
    }


def _watched_first(changes: dict[str, Any]) -> list[tuple[str, tuple[Any, Any]]]:
    order = [k for k in WATCHED if k in changes] + sorted(set(changes) - set(WATCHED))
    return [(k, tuple(changes[k])) for k in order]
