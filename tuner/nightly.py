"""The nightly re-tune: warm-start each registered recipe from its last best, judge tonight's best
against the previous night's, keep one history row per recipe per night, and write the report."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.recipe import Recipe, RecipeError, load_recipe

# Verdicts, as stored in nightly_results.verdict and the JSON report ("regression" is the word the
# dashboard's history page looks for).
IMPROVED, UNCHANGED, REGRESSED, FIRST_RUN, FAILED = (
    "improved",
    "unchanged",
    "regression",
    "first_run",
    "failed",
)
VERDICTS = (IMPROVED, UNCHANGED, REGRESSED, FIRST_RUN, FAILED)
DEFAULT_TRIALS = 8
DEFAULT_TOP_K = 3


class NightlyError(ValueError):
    """Bad input to a nightly run (folder, threshold, date); the message names the option and the fix."""


def parse_threshold(text: str) -> float:
    """'5%' or '0.05' -> 0.05 (a fraction of the previous best)."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise NightlyError(
            f"--fail-on-regression {text!r}: expected a percentage like 5% or a fraction like 0.05"
        ) from None
    if not 0 <= value < 1:
        raise NightlyError(f"--fail-on-regression {text!r}: must be between 0% and 100% (e.g. 5%)")
    return value


def parse_night(text: str | None) -> dt.date:
    if text is None:
        return dt.date.today()
    try:
        return dt.date.fromisoformat(text.strip())
    except ValueError:
        raise NightlyError(f"--night {text!r}: expected a date like 2026-11-29 (YYYY-MM-DD)") from None


def seconds_until(hhmm: str, now: dt.datetime) -> float:
    """Seconds from `now` to the next wall-clock HH:MM (tomorrow's when today's has passed)."""
    m = re.fullmatch(r"([01]?\d|2[0-3]):([0-5]\d)", hhmm.strip())
    if not m:
        raise NightlyError(f"--daily-at {hhmm!r}: expected a time like 02:00 (24-hour HH:MM)")
    target = now.replace(hour=int(m.group(1)), minute=int(m.group(2)), second=0, microsecond=0)
    if target <= now:
        target += dt.timedelta(days=1)
    return (target - now).total_seconds()


def find_recipes(path: Path) -> list[tuple[Path, Recipe]]:
    """Every *.yaml/*.yml/*.json recipe in `path` (or `path` itself), all validated before any runs."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json") and p.is_file())
        if not files:
            raise NightlyError(f"{path}: no recipe files (*.yaml, *.yml, *.json) in this folder")
    elif path.is_file():
        files = [path]
    else:
        raise NightlyError(f"{path}: no such folder or file; pass the folder of nightly recipes")
    problems, found, seen = [], [], {}
    for f in files:
        try:
            recipe = load_recipe(f)
        except RecipeError as err:
            problems.append(str(err))
            continue
        if recipe.name in seen:
            # The history is keyed by recipe name: two files with one name would overwrite each other.
            problems.append(
                f"{f}: name {recipe.name!r} is also used by {seen[recipe.name]}; names must be unique"
            )
            continue
        seen[recipe.name] = f
        found.append((f, recipe))
    if problems:
        raise NightlyError("\n".join(problems))
    return found


@dataclass
class Previous:
    """The history row tonight is compared with."""

    night: dt.date
    best_tokens_per_s: float
    config: dict[str, Any] | None
    fingerprint_hash: str
    study_name: str | None
    fingerprint: dict[str, Any] = field(default_factory=dict)


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


@dataclass
class Outcome:
    """One recipe's line in the report and its row in nightly_results."""

    recipe: str
    source: str
    night: dt.date
    verdict: str
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

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("night", "previous_night"):
            d[key] = d[key].isoformat() if d[key] else None
        return d


def judge(new: float | None, previous: float | None, threshold: float) -> tuple[str, float | None]:
    """(verdict, change in percent). Changes within +-threshold are noise: unchanged."""
    if new is None:
        return FAILED, None
    if previous is None:
        return FIRST_RUN, None
    change = (new - previous) / previous * 100
    if change < -threshold * 100:
        return REGRESSED, change
    if change > threshold * 100:
        return IMPROVED, change
    return UNCHANGED, change


def find_previous(
    recipe_name: str, night: dt.date, fingerprint_hash: str, url: str | None
) -> Previous | None:
    """The latest earlier night with a measured best, preferring the same fingerprint; a different
    fingerprint is only used when this one has no history (the report then says so)."""
    from sqlalchemy import select

    from tuner.db import NightlyResult, session_scope

    with session_scope(url) as session:
        rows = session.scalars(
            select(NightlyResult)
            .where(NightlyResult.recipe_name == recipe_name, NightlyResult.night < night)
            .where(NightlyResult.best_tokens_per_s.is_not(None))
            .order_by(NightlyResult.night.desc())
        ).all()
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
        )


def record(outcome: Outcome, url: str | None) -> None:
    """Insert or update the (recipe, night) row: re-running a night replaces its result."""
    from sqlalchemy import select

    from tuner.db import NightlyResult, session_scope, utcnow

    values = {
        "fingerprint_hash": outcome.fingerprint_hash or "",
        "fingerprint": outcome.fingerprint,
        "best_tokens_per_s": outcome.best_tokens_per_s,
        "previous_best_tokens_per_s": outcome.previous_best_tokens_per_s,
        "change_pct": outcome.change_pct,
        "verdict": outcome.verdict,
        "config": outcome.config,
        "study_name": outcome.study_name,
    }
    with session_scope(url) as session:
        row = session.scalar(
            select(NightlyResult).where(
                NightlyResult.recipe_name == outcome.recipe, NightlyResult.night == outcome.night
            )
        )
        if row is None:
            session.add(NightlyResult(recipe_name=outcome.recipe, night=outcome.night, **values))
        else:
            for key, value in values.items():
                setattr(row, key, value)
            row.created_at = utcnow()


def warm_start_configs(
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
    import optuna

    from tuner.space import config_from_params
    from tuner.storage import get_storage

    try:
        study = optuna.load_study(study_name=study_name, storage=get_storage(storage_url))
    except KeyError:  # the study was deleted; the best config alone still warm-starts tonight
        return []
    ok = [
        t
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if t.user_attrs.get("tokens_per_s")
    ]
    ok.sort(key=lambda t: t.user_attrs["tokens_per_s"], reverse=True)
    return [config_from_params(t.params).active_params() for t in ok[:k]]


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


# A tuner: (recipe, warm-start configs) -> what tonight measured. Local and REST versions exist.
Tune = Callable[[Recipe, list[dict[str, Any]]], Tonight]


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

    `expected_fingerprint_hash` picks the warm start when the history holds several fingerprints;
    the comparison uses the fingerprint tonight's trials actually ran on.
    """
    warm_from = find_previous(recipe.name, night, expected_fingerprint_hash or "", db_url)
    enqueue = warm_start_configs(warm_from, db_url, top_k)
    try:
        tonight = tune(recipe, enqueue)
    except Exception as err:  # noqa: BLE001 - one recipe failing must not stop the others
        tonight = Tonight(
            None, None, {}, expected_fingerprint_hash or "", error=f"{type(err).__name__}: {err}"
        )
    previous = find_previous(recipe.name, night, tonight.fingerprint_hash, db_url)
    verdict, change = judge(
        tonight.best_tokens_per_s, previous.best_tokens_per_s if previous else None, threshold
    )
    outcome = Outcome(
        recipe=recipe.name,
        source=source,
        night=night,
        verdict=verdict,
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
    )
    if previous is not None:
        outcome.previous_night = previous.night
        outcome.previous_best_tokens_per_s = previous.best_tokens_per_s
        outcome.previous_config = previous.config
        outcome.previous_fingerprint_hash = previous.fingerprint_hash
        outcome.fingerprint_changed = bool(tonight.fingerprint_hash) and (
            previous.fingerprint_hash != tonight.fingerprint_hash
        )
        if outcome.fingerprint_changed:
            keys = sorted(set(previous.fingerprint) | set(tonight.fingerprint))
            outcome.fingerprint_changes = {
                k: [previous.fingerprint.get(k), tonight.fingerprint.get(k)]
                for k in keys
                if previous.fingerprint.get(k) != tonight.fingerprint.get(k)
            }
    record(outcome, db_url)
    return outcome


def exit_code(outcomes: list[Outcome]) -> int:
    """1 when any recipe regressed beyond the threshold or failed (cron mail, CI), else 0."""
    return 1 if any(o.verdict in (REGRESSED, FAILED) for o in outcomes) else 0


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1f}%"


def render_markdown(outcomes: list[Outcome], night: dt.date, threshold: float) -> str:
    """The report for people: a summary table, then each recipe's configs side by side."""
    counts = {v: sum(o.verdict == v for o in outcomes) for v in VERDICTS}
    summary = ", ".join(f"{n} {v.replace('_', ' ')}" for v, n in counts.items() if n)
    lines = [
        f"# Nightly tuning report, {night.isoformat()}",
        "",
        f"{len(outcomes)} recipe{'' if len(outcomes) == 1 else 's'}: {summary}. Exit code {exit_code(outcomes)}: a drop of more than "
        f"{threshold * 100:g}% in the best tokens/s, or a failed recipe, fails the run.",
        "",
        "| recipe | verdict | previous best tokens/s | new best tokens/s | change "
        "| previous best config, re-measured tonight | fingerprint |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for o in outcomes:
        verdict = o.verdict.replace("_", " ")
        if o.verdict in (REGRESSED, FAILED):
            verdict = f"**{verdict.upper()}**"
        prev = _rate(o.previous_best_tokens_per_s)
        if o.previous_night:
            prev += f" ({o.previous_night.isoformat()})"
        fp = f"changed ({o.fingerprint_hash})" if o.fingerprint_changed else (o.fingerprint_hash or "—")
        lines.append(
            f"| {o.recipe} | {verdict} | {prev} | {_rate(o.best_tokens_per_s)} | {_pct(o.change_pct)} "
            f"| {_rate(o.remeasured_previous_tokens_per_s)} | {fp} |"
        )
    for o in outcomes:
        lines += ["", f"## {o.recipe}: {o.verdict.replace('_', ' ')}", ""]
        where = f"job {o.job_id}, " if o.job_id is not None else ""
        lines.append(
            f"Recipe `{o.source}`; {where}study `{o.study_name or '—'}`; {o.trials} trials, "
            f"{o.warm_started} of them warm-started from the previous best configs."
        )
        if o.error:
            lines += ["", f"Error: `{o.error}`"]
        if o.fingerprint_changed:
            changes = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in o.fingerprint_changes.items())
            lines += [
                "",
                f"The hardware/software fingerprint changed since {o.previous_night} "
                f"({o.previous_fingerprint_hash} -> {o.fingerprint_hash}; {changes or 'details unknown'}); "
                "compared anyway.",
            ]
        if o.config or o.previous_config:
            lines += ["", "| knob | previous best | new best |", "| --- | --- | --- |"]
            prev_cfg, new_cfg = o.previous_config or {}, o.config or {}
            for knob in dict.fromkeys([*prev_cfg, *new_cfg]):
                a, b = prev_cfg.get(knob, "—"), new_cfg.get(knob, "—")
                mark = "**" if prev_cfg and new_cfg and a != b else ""  # what changed since last night
                lines.append(f"| {knob} | {a} | {mark}{b}{mark} |")
    return "\n".join(lines) + "\n"


def write_report(
    outcomes: list[Outcome], directory: Path, night: dt.date, threshold: float
) -> tuple[Path, Path]:
    """Write nightly-<night>.md and nightly-<night>.json into `directory`; returns both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    md = directory / f"nightly-{night.isoformat()}.md"
    js = directory / f"nightly-{night.isoformat()}.json"
    md.write_text(render_markdown(outcomes, night, threshold))
    doc = {
        "night": night.isoformat(),
        "threshold_pct": threshold * 100,
        "exit_code": exit_code(outcomes),
        "verdicts": {v: [o.recipe for o in outcomes if o.verdict == v] for v in VERDICTS},
        "recipes": [o.to_dict() for o in outcomes],
    }
    js.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return md, js


def local_fingerprint_hash(recipe: Recipe) -> str:
    from tuner.devices import resolve_family
    from tuner.fingerprint import fingerprint, fingerprint_hash

    return fingerprint_hash(fingerprint(resolve_family(recipe.hardware.device)))


def nightly_study_name(recipe: Recipe, fp: dict[str, Any], night: dt.date) -> str:
    """Tonight's own study: sharing the recipe's main study would let last night's numbers win
    again tonight and hide a regression; the warm start carries the knowledge over instead."""
    from tuner.study import study_name

    return f"{study_name(recipe, fp)}-nightly-{night.isoformat()}"


def local_tuner(
    *,
    night: dt.date,
    trials: int,
    executor: str = "local",
    storage_url: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    remeasure_top: int = 1,
) -> Tune:
    """Tune on this machine (or its Ray cluster) with `tuner.study.run_study`."""

    def tune(recipe: Recipe, enqueue: list[dict[str, Any]]) -> Tonight:
        from tuner.devices import resolve_family
        from tuner.executors import make_executor
        from tuner.fingerprint import fingerprint, fingerprint_hash
        from tuner.study import run_study

        fp = fingerprint(resolve_family(recipe.hardware.device))
        name = nightly_study_name(recipe, fp, night)
        queued = _enqueue_first(recipe, name, enqueue, storage_url)
        with make_executor(executor) as ex:
            summary = run_study(
                recipe,
                storage_url=storage_url,
                executor=ex,
                trials=trials,
                study_name=name,
                remeasure_top=remeasure_top,
                progress=_study_progress(progress),
            )
        best = summary.best
        return Tonight(
            best_tokens_per_s=best["tokens_per_s"] if best else None,
            config=best["config"] if best else None,
            fingerprint=fp,
            fingerprint_hash=fingerprint_hash(fp),
            study_name=summary.study_name,
            trials=sum(n for status, n in summary.counts.items() if status not in ("waiting", "running")),
            remeasured_previous_tokens_per_s=_measured(summary.study_name, storage_url, enqueue[:1]),
            warm_started=queued,
            error=None if best else f"no trial succeeded ({_counts(summary.counts)})",
        )

    return tune


def _enqueue_first(recipe: Recipe, name: str, configs: list[dict[str, Any]], storage_url: str | None) -> int:
    """Queue last night's configs before run_study opens the study: it queues its own baseline and
    warm start first, and a small nightly budget could run out before reaching ours. Optuna runs
    waiting trials in order, so last night's best is tonight's first trial (role previous_best)."""
    if not configs:
        return 0
    import optuna

    from tuner.space import config_from_params, trial_params
    from tuner.storage import get_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    directions = ["maximize", "minimize"] if recipe.search.objective == "throughput_memory" else ["maximize"]
    study = optuna.create_study(
        study_name=name, storage=get_storage(storage_url), directions=directions, load_if_exists=True
    )
    for i, config in enumerate(configs):
        role = "previous_best" if i == 0 else "previous_top"
        params = trial_params(config_from_params(config))
        study.enqueue_trial(params, user_attrs={"role": role}, skip_if_exists=True)
    return len(configs)


def _study_progress(progress: Callable[[int, int], None] | None):
    if progress is None:
        return None

    def on_event(event: dict[str, Any]) -> None:
        if "done" in event:
            progress(event["done"], event.get("total") or 0)

    return on_event


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {status}" for status, n in counts.items()) or "no trials ran"


def _measured(study_name: str, storage_url: str | None, configs: list[dict[str, Any]]) -> float | None:
    """Tonight's tokens/s of the first of `configs` (last night's best), if it ran."""
    if not configs:
        return None
    import optuna

    from tuner.space import config_from_params
    from tuner.storage import get_storage

    want = config_from_params(configs[0]).key()
    study = optuna.load_study(study_name=study_name, storage=get_storage(storage_url))
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if t.user_attrs.get("tokens_per_s") and config_from_params(t.params).key() == want:
            return t.user_attrs["tokens_per_s"]
    return None


class ServiceError(RuntimeError):
    """The tuning service refused a request or could not be reached."""


def api_tuner(
    base_url: str,
    token: str,
    *,
    night: dt.date,
    trials: int,
    storage_url: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    poll_s: float = 2.0,
) -> Tune:
    """Tune through the REST service: submit the recipe with tonight's budget, follow the job.

    The job is named `<recipe>@nightly-<night>`, and the service keys its study by that name, so
    tonight's best is measured tonight (a study shared across nights would keep answering with an
    old measurement). The job API takes a recipe and nothing else, so tonight's warm start is the
    service's own: the best configs of the most similar earlier study on the same fingerprint.
    """

    def tune(recipe: Recipe, enqueue: list[dict[str, Any]]) -> Tonight:
        import time

        import httpx

        doc = recipe.to_dict()
        doc["name"] = f"{recipe.name}@nightly-{night.isoformat()}"
        doc["search"]["trials"] = trials
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=30) as client:
            job = _call(client, "POST", "/v1/jobs", json=doc)
            while job["state"] not in ("succeeded", "failed", "cancelled"):
                if progress:
                    progress(job["trials_done"], job["trials_total"])
                time.sleep(poll_s)
                job = _call(client, "GET", f"/v1/jobs/{job['id']}")
            fp = _study_fingerprint(job.get("study_name"), storage_url)
            fp_hash = _hash(fp) or (job.get("study_name") or "").removesuffix("-pareto").rsplit("-", 1)[-1]
            tonight = Tonight(None, None, fp, fp_hash, study_name=job.get("study_name"), job_id=job["id"])
            tonight.trials = job["trials_done"]
            if job["state"] != "succeeded":
                tonight.error = job.get("error") or f"job {job['id']} {job['state']}"
                return tonight
            best = _call(client, "GET", f"/v1/jobs/{job['id']}/best")
            tonight.best_tokens_per_s, tonight.config = best["tokens_per_s"], best["config"]
            if enqueue:
                ok = _call(
                    client, "GET", f"/v1/jobs/{job['id']}/trials", params={"status": "ok", "limit": 500}
                )
                tonight.remeasured_previous_tokens_per_s = _tokens_of(enqueue[0], ok["items"])
            return tonight

    return tune


def _tokens_of(config: dict[str, Any], trials: list[dict[str, Any]]) -> float | None:
    """tokens/s of the trial (if any) that measured `config`."""
    from tuner.space import config_from_params

    want = config_from_params(config).key()
    for t in trials:
        try:
            if config_from_params(t["config"]).key() == want:
                return t["tokens_per_s"]
        except ValueError:
            continue
    return None


def _call(client: Any, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    import httpx

    try:
        resp = client.request(method, path, **kwargs)
    except httpx.HTTPError as err:
        raise ServiceError(f"--api {client.base_url}: cannot reach the service ({err})") from None
    if resp.status_code >= 400:
        try:
            body = resp.json()
            detail = body.get("detail", "")
            fields = "; ".join(f"{e['field']}: {e['message']}" for e in body.get("errors", []))
        except ValueError:
            detail, fields = resp.text[:200], ""
        hint = " (check --token / $TUNER_API_TOKEN)" if resp.status_code in (401, 403) else ""
        raise ServiceError(f"{method} {path}: HTTP {resp.status_code} {detail}{hint} {fields}".strip())
    return resp.json()


def _study_fingerprint(study_name: str | None, storage_url: str | None) -> dict[str, Any]:
    """The fingerprint the service's worker stored with its study (same database), or {}."""
    if not study_name:
        return {}
    import optuna

    from tuner.storage import get_storage

    try:
        study = optuna.load_study(study_name=study_name, storage=get_storage(storage_url))
    except (KeyError, ValueError):
        return {}
    fp = study.user_attrs.get("fingerprint")
    return fp if isinstance(fp, dict) else {}


def _hash(fp: dict[str, Any]) -> str:
    if not fp:
        return ""
    from tuner.fingerprint import fingerprint_hash

    return fingerprint_hash(fp)
