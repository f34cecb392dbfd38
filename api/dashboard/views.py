"""What the job page shows, for a REST job and for a study with no job (a `tuner tune` run, a
nightly) alike: the header, the best card with the one winner figure and its interval, the build,
recent failures; one trials page; the plots; one trial whole."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.dashboard import plots, table
from api.responses import FiniteJSONResponse
from api.routes.studies import latest_build, study_verdict
from api.schemas import JobPublic
from api.trials import winner
from tuner.db import Build, Job
from tuner.record import keys
from tuner.record.reader import StudyRecord, with_all_attrs
from tuner.record.status import RUNNING
from tuner.record.winner import Verdict

EMPTY = StudyRecord(study_name="", version=(), trials=[])


def study_header(study: StudyRecord) -> dict[str, Any]:
    """A study with no job, in the shape of a job's header (`JobPublic`'s fields the page reads)."""
    finished = sum(t.finished for t in study.trials)
    running = any(t.status == RUNNING for t in study.trials)
    recipe = study.recipe
    return {
        "id": None,
        "kind": "study",
        "study_name": study.study_name,
        "name": str(recipe.get("name") or study.study_name),
        "history_name": str(recipe.get("name") or study.study_name),
        "state": "running" if running else "finished",
        "trials_done": finished,
        "trials_total": finished,
        "trials_reused": 0,
        "progress": f"{finished} finished",
        "error": None,
    }


def overview(session: Session, job: Job | None, study: StudyRecord | None) -> FiniteJSONResponse:
    """The header, the winner's card, the build and recent failures of a job or a jobless study."""
    if job is not None:
        verdict, study = winner(session, job, with_study=True)
        build = session.scalar(select(Build).where(Build.job_id == job.id).order_by(Build.id.desc()).limit(1))
        header = {**JobPublic.from_row(job).model_dump(mode="json"), "kind": "job"}
        # The worker's figure when the winner's study holds no baseline trial (it recorded one).
        speedup = verdict.speedup if verdict.speedup is not None else job.speedup
        download = f"/v1/jobs/{job.id}/build"
    else:
        verdict, build = study_verdict(session, study), latest_build(session, study.study_name)
        header, speedup = study_header(study), verdict.speedup
        header["best_tokens_per_s"] = verdict.best.tokens_per_s if verdict.best else None
        download = f"/v1/studies/{study.study_name}/build"
    best = study.find(verdict.best.trial) if study is not None and verdict.best is not None else None
    failed, latest = table.failures(study) if study else (0, [])
    # With their logs: the best card and the failure list show trials whole.
    whole = with_all_attrs(session, ([best] if best else []) + latest)
    if best:
        best, latest = whole[0], whole[1:]
    return FiniteJSONResponse(
        {
            "job": header,
            "best": best_card(best, verdict) if best else None,
            "speedup": speedup,
            "build": {
                "ready": build is not None and Path(build.path).is_file(),
                "url": download,
                "sha256": build.sha256 if build else None,
                "size_bytes": build.size_bytes if build else None,
                "trial_number": build.trial_number if build else None,
            },
            "failures": {"total": failed, "items": [r.detail() for r in latest]},
        }
    )


def best_card(best, verdict: Verdict) -> dict[str, Any]:
    """The winner's trial whole, with the figure every view shows: its median tokens/s over every
    measurement (`tokens_per_s`) and its 95% interval (± `interval`, relative: the steps' interval
    and the run-to-run noise; `noise`, the larger spread over measurements and within the trial's
    steps, for trials measured before intervals existed), next to its first measurement."""
    card = best.detail()
    card.update(
        measured_tokens_per_s=card["tokens_per_s"],
        tokens_per_s=verdict.best.tokens_per_s,
        remeasured_tokens_per_s=verdict.best.remeasured_tokens_per_s,
        noise=verdict.best.noise,
        interval=verdict.best.ci,
        winner_source=verdict.source,
    )
    return card


def trials_page(study: StudyRecord | None, **query: Any) -> FiniteJSONResponse:
    """One page of the trials table; no study yet (a queued job) shows the same, empty, table."""
    study = study or EMPTY
    knobs = table.parse_knob_filters(query.pop("knob"), study)
    return FiniteJSONResponse(table.page(study, knobs=knobs, **query))


def plot_data(study: StudyRecord | None) -> FiniteJSONResponse | dict[str, int]:
    return FiniteJSONResponse(plots.plot_data(study)) if study is not None else {"total": 0, "sampled": 0}


# One plan computed at a time in this process: it takes a second or two of CPU for a large study,
# and is computed outside the study's lock so the table and plots of that version never wait on it.
_plan_lock = threading.Lock()


def plan(study: StudyRecord | None, job: Job | None = None) -> FiniteJSONResponse:
    """The plan of the study's recipe fitted to its own trials, next to what the study measured
    (`tuner.perf.study_plan`), once per version of the study."""
    from tuner.perf.study_plan import study_plan, unavailable

    if study is None or not study.trials:
        none_yet = unavailable("no trials yet: the plan is fitted to the study's own measurements")
        return FiniteJSONResponse(none_yet.to_dict())
    cached = study.derived.get("plan")
    if cached is None:
        with _plan_lock:
            cached = study.derived.get("plan")
            if cached is None:
                recipe = study.recipe or (job.recipe if job is not None else None) or {}
                made = study_plan(
                    recipe, study.fingerprint, study.trials, study.ranking(),
                    priors_attr=study.user_attrs.get(keys.DEVICE_PRIORS),
                )  # fmt: skip
                cached = study.derived.setdefault("plan", made.to_dict())
    return FiniteJSONResponse(cached)


def trial(session: Session, study: StudyRecord, number: int) -> dict[str, Any]:
    (record,) = with_all_attrs(session, [table.find(study, number)])
    return record.detail()
