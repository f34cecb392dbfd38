"""How tonight's trials run: locally (this machine or its Ray cluster) through `run_study`, or
through the REST service as a job. Both return a `Tonight` for `history.run_recipe` to judge."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tuner.nightly.history import Tonight, Tune, run_tag
from tuner.recipe import Recipe
from tuner.record import keys
from tuner.record.status import OK, RUNNING, WAITING

if TYPE_CHECKING:
    from tuner.executors.base import Executor


def nightly_study_name(recipe: Recipe, fp: dict[str, Any], night: dt.date, run: int = 1) -> str:
    """Tonight's own study, `<study>-nightly-<night>[-run<N>]`: sharing the recipe's main study (or
    an earlier run's) would let old numbers win again tonight and hide a regression; the warm start
    carries the knowledge over instead."""
    from tuner.study import study_name

    return f"{study_name(recipe, fp)}-{run_tag(night, run)}"


def nightly_job_name(recipe: Recipe, night: dt.date, run: int = 1) -> str:
    """The REST job's recipe name, `<recipe>@nightly-<night>[-run<N>]`. The service keys its study
    by the recipe's name, so a re-run's distinct name is what gives it a fresh study there. The
    study name keeps `SLUG_MAX` characters of it: a longer recipe name is cut to fit, with a hash
    of the whole name, so the night's tag always survives and two long names stay apart."""
    import hashlib

    from tuner.study.naming import SLUG_MAX

    tag = run_tag(night, run)
    name, room = recipe.name, SLUG_MAX - len(tag) - 1
    if len(name) > room:
        name = f"{name[: room - 7]}~{hashlib.sha256(name.encode()).hexdigest()[:6]}"
    return f"{name}@{tag}"


def history_name(job_name: str) -> str:
    """The recipe name a job's nightly history is kept under: `nightly_job_name`'s `@<run tag>`
    taken off (a name it cut to fit keeps its cut). Any other job's name is its own."""
    import re

    return re.sub(r"@nightly-\d{4}-\d{2}-\d{2}(?:-run\d+)?$", "", job_name)


def local_tuner(
    *,
    night: dt.date,
    trials: int,
    executor: str | Executor = "local",
    storage_url: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    remeasure_top: int = 1,
) -> Tune:
    """Tune on this machine (or its Ray cluster) with `tuner.study.run_study`: through `executor`,
    an executor the caller keeps for several recipes, or one made by name for each recipe."""

    def tune(recipe: Recipe, enqueue: list[dict[str, Any]], run: int) -> Tonight:
        import contextlib

        from tuner.executors import make_executor
        from tuner.fingerprint import fingerprint_hash
        from tuner.study import run_study
        from tuner.study.preflight import preflight

        runner = make_executor(executor) if isinstance(executor, str) else contextlib.nullcontext(executor)
        with runner as ex:
            # What `tuner tune` checks first, so a recipe this machine (or cluster) cannot tune
            # fails with the field and the fix, not after its trials were all pruned or refused.
            fp = preflight(recipe, recipe.search.sampler, ex).fingerprint
            name = nightly_study_name(recipe, fp, night, run)
            queued = _enqueue_first(recipe, name, enqueue, storage_url)
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
            best_tokens_per_s=best.tokens_per_s if best else None,
            config=best.config if best else None,
            best_ci=best.ci if best else None,
            fingerprint=fp,
            fingerprint_hash=fingerprint_hash(fp),
            study_name=summary.study_name,
            trials=sum(n for status, n in summary.counts.items() if status not in (RUNNING, WAITING)),
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
        role = keys.PREVIOUS_BEST if i == 0 else keys.PREVIOUS_TOP
        params = trial_params(config_from_params(config))
        study.enqueue_trial(params, user_attrs={keys.ROLE: role}, skip_if_exists=True)
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
    """Tonight's tokens/s of the first of `configs` (last night's best), if it ran: the median over
    its trial and re-measurements (`config_throughput`), the figure tonight's best is given in."""
    if not configs:
        return None
    from tuner.db import session_scope
    from tuner.record.ranking import config_throughput
    from tuner.record.reader import read_study
    from tuner.space import config_from_params

    want = config_from_params(configs[0]).key()
    with session_scope(storage_url) as session:
        study = read_study(session, study_name)
    for t in study.trials if study else []:
        config = t.config()
        if t.completed and t.tokens_per_s and config is not None and config.key() == want:
            return config_throughput(t.tokens_per_s, study.remeasured.get(t.number, []))
    return None


# How long past a recipe's `search.timeout_min` a service job may take (the trial in flight at the
# time limit, re-measurement, the build, a wait in the queue) before the nightly gives up on it.
API_GRACE_MIN = 60.0


class ServiceError(RuntimeError):
    """The tuning service refused a request or could not be reached. `transient`: it could not be
    reached, or answered that it is down for a moment (5xx, 429): worth asking again."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def api_tuner(
    base_url: str,
    token: str,
    *,
    night: dt.date,
    trials: int,
    storage_url: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    poll_s: float = 2.0,
    grace_min: float = API_GRACE_MIN,
) -> Tune:
    """Tune through the REST service: submit the recipe with tonight's budget, follow the job.

    A job not finished `grace_min` minutes after the recipe's `search.timeout_min` (no worker took
    it, or its worker died with none left to re-queue it) is cancelled and tonight fails saying so:
    a cron run never waits forever, unreported.

    The job is named `nightly_job_name(...)`, `<recipe>@nightly-<night>` and `...-run<N>` for a
    re-run, and the service keys its study by that name, so each run's best is measured by that run
    (a study shared across nights or runs would keep answering with an old measurement). The job
    API takes a recipe and nothing else, so tonight's warm start is the service's own: the best
    configs of the most similar earlier study on the same fingerprint.
    """

    def tune(recipe: Recipe, enqueue: list[dict[str, Any]], run: int) -> Tonight:
        import time

        import httpx

        from tuner.db import FINAL_STATES, SUCCEEDED

        doc = recipe.to_dict()
        doc["name"] = nightly_job_name(recipe, night, run)
        doc["search"]["trials"] = trials
        headers = {"Authorization": f"Bearer {token}"}
        allowed_min = recipe.search.timeout_min + grace_min
        deadline = time.monotonic() + allowed_min * 60
        with httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=30) as client:
            job = _call(client, "POST", "/v1/jobs", json=doc)
            late = None
            while job["state"] not in FINAL_STATES:
                if time.monotonic() > deadline:
                    late = _give_up(client, job, allowed_min)
                    job = _poll(client, job, deadline + 60, poll_s)
                    break
                if progress:
                    progress(job["trials_done"], job["trials_total"])
                time.sleep(poll_s)
                job = _poll(client, job, deadline, poll_s)
            fp = _study_fingerprint(job.get("study_name"), storage_url)
            fp_hash = _hash(fp) or (job.get("study_name") or "").removesuffix("-pareto").rsplit("-", 1)[-1]
            tonight = Tonight(None, None, fp, fp_hash, study_name=job.get("study_name"), job_id=job["id"])
            tonight.trials = job["trials_done"]
            if late or job["state"] != SUCCEEDED:
                tonight.error = late or job.get("error") or f"job {job['id']} {job['state']}"
                return tonight
            best = _call(client, "GET", f"/v1/jobs/{job['id']}/best")
            if best.get("fingerprint"):  # the service's own record (its database need not be ours)
                tonight.fingerprint, tonight.fingerprint_hash = best["fingerprint"], best["fingerprint_hash"]
            tonight.best_tokens_per_s, tonight.config = best["tokens_per_s"], best["config"]
            tonight.best_ci = best.get("interval")
            if enqueue and _same_config(enqueue[0], best["config"]):
                # The winner again: its figure is the median over its re-measurements too.
                tonight.remeasured_previous_tokens_per_s = best["tokens_per_s"]
            elif enqueue:
                ok = _call(client, "GET", f"/v1/jobs/{job['id']}/trials", params={"status": OK, "limit": 500})
                tonight.remeasured_previous_tokens_per_s = _tokens_of(enqueue[0], ok["items"])
            return tonight

    return tune


def _poll(client: Any, job: dict[str, Any], deadline: float, poll_s: float) -> dict[str, Any]:
    """The job as the service has it now. A service restarting or a proxy's 502 is asked again
    until `deadline` (the night's own); a failure that persists, or a refusal (4xx), cancels the
    job before the night fails, so no job goes on spending the service's devices unwatched."""
    import time

    while True:
        try:
            return _call(client, "GET", f"/v1/jobs/{job['id']}")
        except ServiceError as err:
            if err.transient and time.monotonic() < deadline:
                time.sleep(max(poll_s, 1.0))
                continue
            with contextlib.suppress(ServiceError):
                _call(client, "POST", f"/v1/jobs/{job['id']}/cancel")
            raise


def _give_up(client: Any, job: dict[str, Any], allowed_min: float) -> str:
    """Cancel a job past its deadline; the sentence tonight's failure reports."""
    from tuner.db import QUEUED

    why = (
        "no worker took it: is `tuner worker` (or `tuner serve`) running against the service's database?"
        if job["state"] == QUEUED
        else "its worker stopped reporting (a dead worker is re-queued only by a live one)"
    )
    try:
        _call(client, "POST", f"/v1/jobs/{job['id']}/cancel")
        what = "cancelled it"
    except ServiceError as err:
        what = f"could not cancel it ({err})"
    return f"job {job['id']} still {job['state']} after {allowed_min:g} min; {why}; {what}"


def _tokens_of(config: dict[str, Any], trials: list[dict[str, Any]]) -> float | None:
    """tokens/s of the trial (if any) that measured `config`: the median over it and its
    re-measurements (`config_throughput`), as the local path and the ranking give it."""
    from tuner.record.ranking import config_throughput

    for t in trials:
        if t["tokens_per_s"] and _same_config(config, t["config"]):
            return config_throughput(t["tokens_per_s"], t.get("remeasured_tokens_per_s") or [])
    return None


def _same_config(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two configs as stored or served set the same knobs (a config no longer valid is none)."""
    from tuner.space import config_from_params

    try:
        return config_from_params(a).key() == config_from_params(b).key()
    except (ValueError, TypeError):
        return False


def _call(client: Any, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    import httpx

    try:
        resp = client.request(method, path, **kwargs)
    except httpx.HTTPError as err:
        raise ServiceError(
            f"--api {client.base_url}: cannot reach the service ({err})", transient=True
        ) from None
    if resp.status_code >= 400:
        try:
            body = resp.json()
            detail = body.get("detail", "")
            fields = "; ".join(f"{e['field']}: {e['message']}" for e in body.get("errors", []))
        except ValueError:
            detail, fields = resp.text[:200], ""
        hint = " (check --token / $TUNER_API_TOKEN)" if resp.status_code in (401, 403) else ""
        transient = resp.status_code >= 500 or resp.status_code == 429
        raise ServiceError(
            f"{method} {path}: HTTP {resp.status_code} {detail}{hint} {fields}".strip(), transient=transient
        )
    return resp.json()


def _study_fingerprint(study_name: str | None, storage_url: str | None) -> dict[str, Any]:
    """The fingerprint the service's worker stored with its study (same database), or {}."""
    if not study_name:
        return {}
    from tuner.db import DatabaseError, session_scope
    from tuner.record.reader import read_study

    try:
        with session_scope(storage_url) as session:
            study = read_study(session, study_name)
    except (DatabaseError, ValueError):
        return {}
    return study.fingerprint if study else {}


def _hash(fp: dict[str, Any]) -> str:
    if not fp:
        return ""
    from tuner.fingerprint import fingerprint_hash

    return fingerprint_hash(fp)
