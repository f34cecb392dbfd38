"""One recipe's night: find the night to compare with, warm-start from it, judge tonight's best,
and keep one row per recipe per night in nightly_results (re-running a night replaces its row)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tuner.nightly.verdict import (
    band,
    judge,
    judge_drift,
    night_key,
    noise_band,
)
from tuner.recipe import Recipe

DEFAULT_TOP_K = 3


@dataclass
class Previous:
    """The history row tonight is compared with."""

    night: dt.date
    best_tokens_per_s: float
    config: dict[str, Any] | None
    fingerprint_hash: str
    study_name: str | None
    fingerprint: dict[str, Any] = field(default_factory=dict)
    best_ci: float | None = None


@dataclass
class Tonight:
    """What tonight's tuning measured (locally or through the service)."""

    best_tokens_per_s: float | None
    config: dict[str, Any] | None
    fingerprint: dict[str, Any]
    fingerprint_hash: str
    study_name: str | None = None
    trials: int = 0
    # Last night's best config, measured again tonight: the fair like-for-like comparison.
    remeasured_previous_tokens_per_s: float | None = None
    warm_started: int = 0
    job_id: int | None = None
    error: str | None = None
    best_ci: float | None = None  # relative half-width of the best's 95% interval (`Ranked.ci`)


@dataclass
class Outcome:
    """One recipe's line in the report and its row in nightly_results."""

    recipe: str
    source: str
    night: dt.date
    verdict: str
    # Which run of the night (`tonight_run`): 2 and up is a re-run, measured in a study of its own.
    run: int = 1
    best_tokens_per_s: float | None = None
    config: dict[str, Any] | None = None
    previous_night: dt.date | None = None
    previous_best_tokens_per_s: float | None = None
    previous_config: dict[str, Any] | None = None
    change_pct: float | None = None
    remeasured_previous_tokens_per_s: float | None = None
    fingerprint_hash: str | None = None
    previous_fingerprint_hash: str | None = None
    fingerprint_changed: bool = False
    fingerprint: dict[str, Any] = field(default_factory=dict)
    # {key: [previous, tonight]} for what differs, e.g. {"torch": ["2.12.0", "2.13.0"]}
    fingerprint_changes: dict[str, list[Any]] = field(default_factory=dict)
    study_name: str | None = None
    job_id: int | None = None
    trials: int = 0
    warm_started: int = 0
    error: str | None = None
    recipe_hash: str | None = None
    best_ci: float | None = None
    previous_best_ci: float | None = None
    # The band (percent) a change had to leave to count: the threshold, or the two nights'
    # measurement noise where that is wider (`judge`).
    band_pct: float | None = None
    # The latest earlier night of a recipe by this name whose recipe differed: not compared with.
    recipe_changed_since: dt.date | None = None
    # Tonight against the median best of up to DRIFT_NIGHTS earlier nights (same recipe and
    # fingerprint): a slow decline that no single night's step shows (`judge_drift`).
    drift_reference_tokens_per_s: float | None = None
    drift_nights: int = 0
    drift_pct: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("night", "previous_night", "recipe_changed_since"):
            d[key] = d[key].isoformat() if d[key] else None
        return d


def run_tag(night: dt.date, run: int = 1) -> str:
    """The one naming rule for a run of a night: `nightly-<night>` for the first, `nightly-<night>-run<N>`
    for the N-th. The local tuner appends it to the study name, the REST tuner to the job name (which
    the service's study name starts with), so every run of a night measures in a study of its own."""
    if run < 1:
        raise ValueError(f"run {run}: runs of a night count from 1")
    tag = f"nightly-{night.isoformat()}"
    return tag if run == 1 else f"{tag}-run{run}"


def parse_run(study_name: str | None, night: dt.date) -> int | None:
    """The run number `run_tag` put into `study_name` for `night`; None when it holds no such tag.
    The tag ends a local study's name and sits before `-<hash>-<fingerprint>` in the service's."""
    if not study_name:
        return None
    tag = re.escape(f"nightly-{night.isoformat()}")
    found = list(re.finditer(rf"(?<![A-Za-z0-9]){tag}(?:-run(\d+))?(?![A-Za-z0-9.])", study_name))
    if not found:
        return None
    return int(found[-1].group(1) or 1)  # the last: a recipe's own name may contain a tag too


def tonight_run(recipe_name: str, night: dt.date, url: str | None) -> int:
    """Which run of `night` this one is, from the night's recorded result.

    No result recorded yet: run 1. That is also the re-run of a first run killed before it recorded,
    and it must resume that run's study (the tool's promise: kill -9, run again, it continues). A
    recorded result means its study finished: its trial budget is spent, so resuming it would
    measure nothing and report the old best as tonight's. A re-run is a new measurement, the run
    after the recorded one, in a fresh study; the earlier study stays, nothing stored is lost. A
    re-run killed before recording is resumed the same way, since the row still names the run
    before it.
    """
    from sqlalchemy import select

    from tuner.db import NightlyResult, session_scope

    with session_scope(url) as session:
        row = session.scalar(
            select(NightlyResult).where(
                NightlyResult.recipe_name == recipe_name, NightlyResult.night == night
            )
        )
        if row is None:
            return 1
        return (parse_run(row.study_name, night) or 1) + 1


def find_previous(
    recipe_name: str, night: dt.date, fingerprint_hash: str, url: str | None, recipe_hash: str | None = None
) -> Previous | None:
    """The latest earlier night with a measured best, preferring the same fingerprint; a different
    fingerprint is only used when this one has no history (the report then says so). With
    `recipe_hash`, nights of an edited recipe (another hash under the same name) are not compared
    with; rows recorded before the hash was are."""
    return _previous(_earlier(recipe_name, night, url), fingerprint_hash, recipe_hash)


def _previous(earlier: list[Any], fingerprint_hash: str, recipe_hash: str | None) -> Previous | None:
    """`find_previous` over the rows `_earlier` read."""
    rows = [r for r in earlier if r.best_tokens_per_s is not None]
    rows = [r for r in rows if recipe_hash is None or r.recipe_hash in (None, recipe_hash)]
    same = [r for r in rows if r.fingerprint_hash == fingerprint_hash]
    row = (same or rows or [None])[0]
    if row is None:
        return None
    return Previous(
        row.night,
        row.best_tokens_per_s,
        row.config,
        row.fingerprint_hash,
        row.study_name,
        row.fingerprint or {},
        row.best_ci,
    )


def recipe_changed_since(earlier: list[Any], recipe_hash: str) -> dt.date | None:
    """The latest of the `earlier` nights (`_earlier`) recorded for another recipe (edited since)."""
    return next((r.night for r in earlier if r.recipe_hash not in (None, recipe_hash)), None)


def _earlier(recipe_name: str, night: dt.date, url: str | None) -> list[Any]:
    """The recipe's rows before `night`, newest first (detached: plain attribute reads)."""
    from sqlalchemy import select

    from tuner.db import NightlyResult, session_scope

    with session_scope(url) as session:
        rows = session.scalars(
            select(NightlyResult)
            .where(NightlyResult.recipe_name == recipe_name, NightlyResult.night < night)
            .order_by(NightlyResult.night.desc())
        ).all()
        session.expunge_all()
        return list(rows)


def record(outcome: Outcome, url: str | None) -> None:
    """Insert or update the (recipe, night) row: re-running a night replaces its result, unless
    the re-run failed and the night already holds a measured one."""
    from sqlalchemy import select

    from tuner.db import NightlyResult, session_scope, utcnow

    values: dict[str, Any] = {
        "fingerprint_hash": outcome.fingerprint_hash or "",
        "fingerprint": outcome.fingerprint,
        "best_tokens_per_s": outcome.best_tokens_per_s,
        "previous_best_tokens_per_s": outcome.previous_best_tokens_per_s,
        "change_pct": outcome.change_pct,
        "verdict": outcome.verdict,
        "config": outcome.config,
        "study_name": outcome.study_name,
        "best_ci": outcome.best_ci,
        "recipe_hash": outcome.recipe_hash,
        "compared_night": outcome.previous_night,
        "fingerprint_changes": outcome.fingerprint_changes if outcome.previous_night else None,
    }
    with session_scope(url) as session:
        row = session.scalar(
            select(NightlyResult).where(
                NightlyResult.recipe_name == outcome.recipe, NightlyResult.night == outcome.night
            )
        )
        if row is None:
            session.add(NightlyResult(recipe_name=outcome.recipe, night=outcome.night, **values))
            return
        if outcome.best_tokens_per_s is None and row.best_tokens_per_s is not None:
            # A re-run that measured nothing keeps the night's measured result (later nights are
            # compared with it, and warm-start from its config); the report says the re-run
            # failed. Only a study it opened is noted, so `tonight_run` numbers the next re-run
            # after it.
            row.study_name = outcome.study_name or row.study_name
            return
        if outcome.study_name is None:
            # This run failed before it opened a study, so it measured nothing: the night's
            # trials are still in the study the row names, and `tonight_run` numbers the next
            # re-run after it (forgetting it would let a later re-run reuse a finished study).
            values["study_name"] = row.study_name
        for key, value in values.items():
            setattr(row, key, value)
        row.created_at = utcnow()


def previous_night_configs(
    previous: Previous | None, storage_url: str | None, top_k: int
) -> list[dict[str, Any]]:
    """Last night's best first (so it is re-measured tonight), then its runners-up, de-duplicated."""
    if previous is None or previous.config is None:
        return []
    configs = [previous.config]
    if previous.study_name and top_k > 1:
        configs += _top_configs(previous.study_name, storage_url, top_k)
    return _dedupe(configs)[:top_k]


def _top_configs(study_name: str, storage_url: str | None, k: int) -> list[dict[str, Any]]:
    """The study's ranked top `k` configs (`rank_trials`: the same winner every view names)."""
    from tuner.db import DatabaseError
    from tuner.summary import summarize

    try:
        return [e.config for e in summarize(study_name, storage_url, top_k=k).top_k]
    except (KeyError, DatabaseError):  # study deleted or elsewhere: the best config alone still warm-starts
        return []


def _dedupe(configs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    from tuner.config import Config, ConfigError

    seen, out = set(), []
    for c in configs:
        try:
            key = Config.from_params(c).key()
        except (ConfigError, TypeError):
            continue  # a knob renamed since last night: skip that config, not the whole night
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


# A tuner: (recipe, warm-start configs, run of the night) -> what tonight measured. Local and REST
# versions exist; both name tonight's study or job with `run_tag(night, run)`.
Tune = Callable[[Recipe, list[dict[str, Any]], int], Tonight]


def run_recipe(
    recipe: Recipe,
    source: str,
    *,
    night: dt.date,
    threshold: float,
    tune: Tune,
    expected_fingerprint_hash: str | None = None,
    db_url: str | None = None,
    top_k: int = DEFAULT_TOP_K,
) -> Outcome:
    """Tune one recipe tonight, judge it and record it. A crash becomes a `failed` verdict.

    A re-run of a night that already has a result is a new run (`tonight_run`) measured in a study
    of its own, judged against the latest earlier night like the first run, and replaces the row.

    `expected_fingerprint_hash` picks the warm start when the history holds several fingerprints;
    the comparison uses the fingerprint tonight's trials actually ran on.
    """
    recipe_hash = night_key(recipe)
    warm_from = find_previous(recipe.name, night, expected_fingerprint_hash or "", db_url, recipe_hash)
    enqueue = previous_night_configs(warm_from, db_url, top_k)
    run = tonight_run(recipe.name, night, db_url)
    try:
        tonight = tune(recipe, enqueue, run)
    except Exception as err:  # noqa: BLE001 - one recipe failing must not stop the others
        from tuner.study.preflight import PreflightError

        # A recipe this machine cannot tune says its field and fix itself; anything else is named
        # by its kind.
        said = str(err) if isinstance(err, PreflightError) else f"{type(err).__name__}: {err}"
        tonight = Tonight(None, None, {}, expected_fingerprint_hash or "", error=said)
    earlier = _earlier(recipe.name, night, db_url)  # read once: the comparison, drift, edits
    previous = _previous(earlier, tonight.fingerprint_hash, recipe_hash)
    noise = noise_band(tonight.best_tokens_per_s, tonight.best_ci, previous)
    verdict, change = judge(
        tonight.best_tokens_per_s, previous.best_tokens_per_s if previous else None, threshold, noise
    )
    outcome = Outcome(
        recipe=recipe.name,
        source=source,
        night=night,
        verdict=verdict,
        run=run,
        best_tokens_per_s=tonight.best_tokens_per_s,
        config=tonight.config,
        change_pct=change,
        remeasured_previous_tokens_per_s=tonight.remeasured_previous_tokens_per_s,
        fingerprint_hash=tonight.fingerprint_hash,
        fingerprint=tonight.fingerprint,
        study_name=tonight.study_name,
        job_id=tonight.job_id,
        trials=tonight.trials,
        warm_started=tonight.warm_started,
        error=tonight.error,
        recipe_hash=recipe_hash,
        best_ci=tonight.best_ci,
        band_pct=band(threshold, noise) if previous is not None else None,
    )
    judge_drift(outcome, earlier)
    if previous is None:
        outcome.recipe_changed_since = recipe_changed_since(earlier, recipe_hash)
    else:
        _compared(outcome, previous)
    record(outcome, db_url)
    return outcome


def _compared(outcome: Outcome, previous: Previous) -> None:
    """What the outcome says of the night it was compared with, fingerprint changes included
    (outcome.fingerprint is tonight's)."""
    outcome.previous_best_ci = previous.best_ci
    outcome.previous_night = previous.night
    outcome.previous_best_tokens_per_s = previous.best_tokens_per_s
    outcome.previous_config = previous.config
    outcome.previous_fingerprint_hash = previous.fingerprint_hash
    outcome.fingerprint_changed = bool(outcome.fingerprint_hash) and (
        previous.fingerprint_hash != outcome.fingerprint_hash
    )
    if outcome.fingerprint_changed:
        outcome.fingerprint_changes = fingerprint_changes(previous.fingerprint, outcome.fingerprint)


def fingerprint_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """{key: [before, after]} for what differs between two fingerprints, keys sorted: what the
    report names and the dashboard's history shows."""
    return {
        k: [before.get(k), after.get(k)]
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    }
