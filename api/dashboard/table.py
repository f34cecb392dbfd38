"""The trials table (sorted, filtered by status and knob value, paged on the server), the failure
list, and the side-by-side comparison of two trials."""

from __future__ import annotations

from typing import Any

from api.errors import ApiError
from api.trials import matches_status
from tuner.record import keys
from tuner.record.reader import StudyRecord
from tuner.record.trial import TrialRecord
from tuner.result import BREAKDOWN_CATEGORIES as CATEGORIES

COLUMNS = (
    "number",
    "status",
    "tokens_per_s",
    "mfu",
    "peak_mem_allocated_bytes",
    "estimated_peak_mem_bytes",
    "step_time_s",
    "duration_s",
    "node",
)
METRICS = (
    "tokens_per_s",
    "samples_per_s",
    "step_time_s",
    "mfu",
    "tflops",
    "peak_mem_allocated_bytes",
    "peak_mem_reserved_bytes",
    "estimated_peak_mem_bytes",
)
MAX_PAGE_SIZE = 200


def parse_knob_filters(raw: list[str], study: StudyRecord) -> dict[str, str]:
    """`knob=name:value` query values into {name: value}; an unknown knob is a 422 naming it."""
    out: dict[str, str] = {}
    for item in raw:
        name, sep, value = item.partition(":")
        if not sep or not name:
            raise ApiError(
                422, f"knob filter {item!r} is not name:value", [("knob", "use e.g. knob=recompute:full")]
            )
        if name not in study.distributions:
            known = ", ".join(sorted(study.distributions)) or "none yet"
            raise ApiError(
                422, f"unknown knob {name!r} in filter", [("knob", f"knobs of this study: {known}")]
            )
        out[name] = value
    return out


def label(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _sort_key(v: Any) -> tuple[int, float, str]:
    # Numbers (and booleans) before text; missing values are split off by the caller.
    if isinstance(v, (bool, int, float)):
        return (0, float(v), "")
    return (1, 0.0, str(v))


ORDERS_KEPT = 32  # sorted and filtered orders kept per study version: paging one is then free


def _ordered(
    study: StudyRecord, column: str, desc: bool, statuses: list[str], knobs: dict[str, str]
) -> list[TrialRecord]:
    orders = study.derived.setdefault("orders", {})
    key = (column, desc, tuple(sorted(statuses)), tuple(sorted(knobs.items())))
    cached = orders.get(key)
    if cached is not None:
        return cached
    rows = study.trials
    if statuses:
        rows = [r for r in rows if any(matches_status(r, word) for word in statuses)]  # as /v1's
    for name, want in knobs.items():
        rows = [r for r in rows if name in r.params and label(r.params[name]) == want]
    keyed = [(_value(r, column), r) for r in rows]  # each value once: this runs over every trial
    present = [(_sort_key(v), r) for v, r in keyed if v is not None]
    present.sort(key=lambda kr: kr[0], reverse=desc)
    ordered = [r for _, r in present] + [r for v, r in keyed if v is None]
    if len(orders) < ORDERS_KEPT:
        orders[key] = ordered
    return ordered


def _counts(study: StudyRecord) -> dict[str, int]:
    counts = study.derived.get("status_counts")
    if counts is None:
        counts = {}
        for r in study.trials:
            counts[r.status] = counts.get(r.status, 0) + 1
        study.derived["status_counts"] = counts
    return counts


def page(
    study: StudyRecord,
    *,
    page: int,
    size: int,
    sort: str,
    statuses: list[str],
    knobs: dict[str, str],
) -> dict[str, Any]:
    """One page of the trials table, plus what the filter controls offer.

    Paged by offset, not by /v1's keyset cursor (`api.trials.cursor_key`), whose rule does not
    fit this order: it keys only the trial number and objective 0, while this table sorts by any
    column or knob, text ones too (status, node, `recompute: full`), and its tokens_per_s is the
    measured one (`TrialRecord.tokens_per_s`), which a pruned or failed trial can have too; and
    the page shows "page N of M", which a cursor cannot jump to."""
    desc = sort.startswith("-")
    column = sort.lstrip("-")
    if column not in COLUMNS and column not in study.distributions:
        valid = ", ".join(COLUMNS + tuple(sorted(study.distributions)))
        raise ApiError(
            422, f"cannot sort by {column!r}", [("sort", f"one of {valid}, with '-' for descending")]
        )
    ordered = _ordered(study, column, desc, statuses, knobs)
    total = len(ordered)
    pages = max(1, -(-total // size))
    start = (page - 1) * size
    return {
        "total": total,
        "total_all": len(study.trials),
        "page": page,
        "size": size,
        "pages": pages,
        "sort": sort,
        "items": [r.summary() for r in ordered[start : start + size]],
        "status_counts": _counts(study),
        "knobs": {
            name: sorted({label(c) for c in getattr(d, "choices", ())})
            for name, d in sorted(study.distributions.items())
        },
    }


def _value(r: TrialRecord, column: str) -> Any:
    return r.metric(column) if column in COLUMNS else r.params.get(column)


def failures(study: StudyRecord, limit: int = 50) -> tuple[int, list[TrialRecord]]:
    """How many trials failed, and the latest `limit` of them, newest first."""
    failed = [r for r in study.trials if r.failed]
    return len(failed), list(reversed(failed[-limit:]))


def find(study: StudyRecord, number: int) -> TrialRecord:
    for r in study.trials:
        if r.number == number:
            return r
    raise ApiError(
        404, f"trial {number} not found in study {study.study_name}", [("number", "no such trial")]
    )


def compare(a: TrialRecord, b: TrialRecord) -> dict[str, Any]:
    """Which knobs differ between two trials, what each metric did (b relative to a), and the
    step-time breakdown category by category."""
    names = sorted(set(a.params) | set(b.params))
    knobs = [
        {"name": n, "a": a.params.get(n), "b": b.params.get(n), "differs": a.params.get(n) != b.params.get(n)}
        for n in names
    ]
    metrics = []
    for m in METRICS:
        va, vb = a.metric(m), b.metric(m)
        change = None
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va:
            change = (vb - va) / abs(va)
        metrics.append({"name": m, "a": va, "b": vb, "change": change})
    ba, bb = a.attrs.get(keys.BREAKDOWN) or {}, b.attrs.get(keys.BREAKDOWN) or {}
    categories = [c for c in CATEGORIES if c in ba or c in bb] + sorted((set(ba) | set(bb)) - set(CATEGORIES))
    breakdown = [{"category": c, "a": ba.get(c), "b": bb.get(c)} for c in categories]
    return {"knobs": knobs, "metrics": metrics, "breakdown": breakdown}
