"""One claimed job (`JobRun`): a heartbeat and cancel watch on a thread, the study and then the
build of its winner on this one, progress and state changes recorded as job events, and the job's
figures (best, baseline, speedup) kept by the study's ranking while it runs."""

from __future__ import annotations

import logging
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError

from tuner.db import (
    CANCELLED,
    FAILED,
    FINAL_STATES,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    Build,
    DatabaseError,
    Job,
    add_event,
    session_scope,
    utcnow,
)
from tuner.record.ranking import Ranking
from tuner.record.reader import read_study
from tuner.record.snapshot import snapshot_study
from tuner.record.status import OK
from tuner.summary import StudySummary
from tuner.worker.wording import failure, one_line

log = logging.getLogger("tuner.worker")
# An outcome, never a job's stored state: another worker took the job over; this one writes nothing.
LOST = "lost"


@dataclass
class BuildOutcome:
    """The winner's build: where it is and the builds-table row, or why there is none."""

    trial: int | None = None
    path: str | None = None
    sha256: str | None = None
    size_bytes: int | None = None
    build_id: int | None = None  # build_trial registers the row; the worker links it to the job
    error: str | None = None  # one line (tuner.worker.wording): what failed, what to do next
    log: str | None = None  # the whole failure, served by GET /v1/jobs/ID/log


@dataclass
class Outcome:
    """How a job ended: its final state (or `queued`: handed back; `lost`: taken over)."""

    state: str
    summary: StudySummary | None = None
    error: str | None = None
    build: BuildOutcome | None = None
    log: str | None = None
    said: bool = False  # `queued`: the job's events already say why (a wait noted once, not each look)


class JobRun:
    """One claimed job of `worker` (a `tuner.worker.Worker`)."""

    def __init__(self, worker: Any, job_id: int):
        self.worker = worker
        self.url = worker.settings.database_url
        self.job_id = job_id
        self.cancelled = threading.Event()
        self.lost = threading.Event()  # another worker took the job over: stop without writing
        self._done = threading.Event()

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or self.lost.is_set() or self.worker.shutdown.is_set()

    def _heartbeat(self) -> None:
        stopped_trials = False
        while not self._done.wait(self.worker.settings.heartbeat_s):
            try:
                with session_scope(self.url) as s:
                    mine = (Job.id == self.job_id) & (Job.worker_id == self.worker.worker_id)
                    hit = s.execute(update(Job).where(mine, Job.state == RUNNING).values(updated_at=utcnow()))
                    if hit.rowcount == 0:
                        self.lost.set()
                    elif s.scalar(select(Job.cancel_requested).where(Job.id == self.job_id)):
                        self.cancelled.set()
            except Exception as err:  # noqa: BLE001 - a missed beat is not fatal; the next may succeed
                log.warning("job %s: heartbeat failed: %s", self.job_id, err)
            if self.should_stop() and not stopped_trials:
                # Stop the trials in flight now rather than after they finish on their own.
                stopped_trials = True
                try:
                    self.worker.cancel_trials()
                except Exception as err:  # noqa: BLE001 - the beat must go on, or the job looks dead
                    log.warning("job %s: stopping its trials failed: %s", self.job_id, err)

    def _on_progress(self, event: dict[str, Any]) -> None:
        """Record a driver event. Best effort, as the heartbeat: a write the database refuses for a
        moment (a restart, a lock held past the busy timeout) loses that one event, not the job;
        the job's final row is written from the summary either way."""
        try:
            self._record_progress(event)
        except (DatabaseError, SQLAlchemyError) as err:
            log.warning("job %s: could not record a %s event: %s", self.job_id, event.get("event"), err)

    def _record_progress(self, event: dict[str, Any]) -> None:
        kind = str(event.get("event", "progress"))
        if kind == "done":
            # The job's own `done` comes after the build; SSE clients stop at the first `done`.
            kind = "study_done"
        payload = {k: v for k, v in event.items() if k != "event"}
        # Read before the job's row is written: the write lock is not held while the study is read.
        ranking = self._ranking() if _may_change_ranking(event) else None
        with session_scope(self.url) as s:
            job = s.get(Job, self.job_id)
            if job is None or job.worker_id != self.worker.worker_id:
                self.lost.set()
                return
            if isinstance(event.get("done"), int):
                if job.trials_reused is None:
                    # The driver's first event counts what the study held before this job ran
                    # (a resumed job keeps the count its first attempt recorded).
                    job.trials_reused = event["done"]
                job.trials_done = event["done"]
            if isinstance(event.get("total"), int):
                job.trials_total = event["total"]
            if event.get("best_tokens_per_s") is not None:
                job.best_tokens_per_s = float(event["best_tokens_per_s"])
            if ranking is not None:
                apply_ranking(job, ranking)
            if "best_tokens_per_s" in event:  # the figures as the job's row holds them now
                payload.update(baseline_tokens_per_s=job.baseline_tokens_per_s, speedup=job.speedup)
            job.updated_at = utcnow()
            add_event(s, self.job_id, kind, jsonable(payload))

    def _ranking(self) -> Ranking | None:
        """The job's study as ranked now (`rank_trials`, through the one reader), or None before it
        has a study. Best effort: a read that fails leaves the job's figures as they were."""
        try:
            with session_scope(self.url) as s:
                name = s.scalar(select(Job.study_name).where(Job.id == self.job_id))
                study = read_study(s, name) if name else None
        except (DatabaseError, SQLAlchemyError) as err:
            log.warning("job %s: could not rank its study for the progress figures: %s", self.job_id, err)
            return None
        return study.ranking() if study is not None else None

    def run(self) -> str:
        """Run the job to a final state (or back to queued when the worker shuts down)."""
        beat = threading.Thread(target=self._heartbeat, name=f"job-{self.job_id}-heartbeat", daemon=True)
        beat.start()
        try:
            outcome = self._run_study()
        except Exception as err:  # noqa: BLE001 - a failing job is data; the worker keeps going
            log.exception("job %s failed", self.job_id)
            # Stopping trials can make the study raise; a stop that was asked for is not a failure,
            # nor is a cluster that stopped answering (`Worker.executor_lost`): the job goes back.
            outcome = (
                self._stopped()
                or self._executor_lost()
                or Outcome(
                    FAILED,
                    error=failure(
                        "the study failed",
                        err,
                        "see the job's log; fix the recipe or the worker and resubmit",
                    ),
                    log=traceback.format_exc(),
                )
            )
        finally:
            self._done.set()
            beat.join()
        return self._finish(outcome)

    def _run_study(self) -> Outcome:
        from tuner.recipe import recipe_from_dict
        from tuner.resume import StudyBusy
        from tuner.study import study_name
        from tuner.study.preflight import PreflightError, preflight

        with session_scope(self.url) as s:
            recipe = recipe_from_dict(s.get(Job, self.job_id).recipe)
        try:  # what the API's host could not check: this worker's devices (`tuner.study.preflight`)
            described = preflight(recipe, recipe.search.sampler, self.worker.executor)
        except PreflightError as err:
            return Outcome(FAILED, error=f"this worker cannot run the recipe: {err}; fix it and resubmit")
        name = study_name(recipe, described.fingerprint)
        if not recipe.search.reuse:
            # Fresh measurements: the job's own study (a re-queued job resumes it, same name).
            name = f"{name}-job{self.job_id}"
        with session_scope(self.url) as s:
            s.get(Job, self.job_id).study_name = name
        try:
            summary = self._tune(recipe, name)
        except StudyBusy as err:
            # Another driver holds the study (a CLI `tuner tune` of the same recipe, a worker of
            # another service): not the job's fault. It goes back to the queue, and this worker
            # looks at it again after `STUDY_BUSY_RETRY_S` (`Worker.hold_back`), running others.
            first = self.worker.hold_back(self.job_id)
            return Outcome(QUEUED, error=f"waiting for its study: {err}", said=not first)
        stopped = self._stopped()
        if stopped:
            stopped.summary = summary
            return stopped
        if summary.best is None:
            return Outcome(
                FAILED, summary, "no trial finished ok; GET the job's trials to see why each failed"
            )
        if not self.worker.settings.build:
            return Outcome(
                SUCCEEDED,
                summary,
                build=BuildOutcome(error="builds are turned off on this service (TUNER_BUILD=false)"),
            )
        build = self._build(recipe, name, summary.best.trial)
        # A cancel asked for while the winner was built (which no executor cancel stops) is a
        # cancel still: the job ends cancelled, with the build it finished.
        if self.cancelled.is_set() or self.lost.is_set():
            return Outcome(LOST if self.lost.is_set() else CANCELLED, summary, build=build)
        return Outcome(SUCCEEDED, summary, build=build)

    def _tune(self, recipe: Any, name: str) -> StudySummary:
        from tuner.study import run_study

        cfg = self.worker.settings
        return run_study(
            recipe,
            storage_url=self.url,
            executor=self.worker.executor,
            trials=min(recipe.search.trials, cfg.max_trials or recipe.search.trials),
            timeout_s=min(recipe.search.timeout_min, cfg.max_timeout_min or recipe.search.timeout_min) * 60,
            progress=self._on_progress,
            should_stop=self.should_stop,
            remeasure_top=cfg.remeasure_top,
            study_name=name,
        )

    def _stopped(self) -> Outcome | None:
        """Why the study stopped early, when it was asked to: taken over, shut down or cancelled."""
        if self.lost.is_set():
            return Outcome(LOST)
        if self.worker.shutdown.is_set() and not self.cancelled.is_set():
            return Outcome(QUEUED)
        if self.cancelled.is_set():
            return Outcome(CANCELLED)
        return None

    def _executor_lost(self) -> Outcome | None:
        """Back to the queue, when the study failed because the worker's cluster went away."""
        lost = self.worker.executor_lost()
        if lost is None:
            return None
        log.error("job %s: handing it back: %s", self.job_id, lost)
        return Outcome(QUEUED, error=lost)

    def _build(self, recipe: Any, name: str, trial_number: int) -> BuildOutcome:
        try:
            from tuner.artifacts import ArtifactStore
            from tuner.build import build_trial
        except ImportError as err:
            return BuildOutcome(error=f"build step unavailable: {err}")

        def say(step: int, total: int, message: str) -> None:
            self._on_progress(
                {"event": "build_progress", "step": step, "total_steps": total, "message": message}
            )

        try:
            record = build_trial(
                recipe,
                study_name=name,
                trial_number=trial_number,
                storage_url=self.url,
                store=ArtifactStore(self.worker.settings.artifact_dir),
                progress=say,
                executor=self.worker.executor,  # on Ray, the build runs on a node of the study's
            )
        except Exception as err:  # noqa: BLE001 - the best config stands even when its build fails
            log.exception("job %s: build failed", self.job_id)
            return BuildOutcome(
                error=failure("build failed", err, "the best config stands; the job's log has the details"),
                log=traceback.format_exc(),
            )
        return BuildOutcome(trial_number, str(record.path), record.sha256, record.size_bytes, record.build_id)

    def _snapshot(self) -> None:
        """Snapshot the study's finished trials, so the dashboard's first view of a large job reads
        one row instead of every trial. A cache: a failure here is logged, never fails the job."""
        try:
            with session_scope(self.url) as s:
                job = s.get(Job, self.job_id)
                name = job.study_name if job is not None else None
            if name:
                snapshot_study(self.url, name)
        except (DatabaseError, SQLAlchemyError) as err:
            log.warning("job %s: could not snapshot study for the dashboard: %s", self.job_id, err)

    def _finish(self, outcome: Outcome) -> str:
        state = outcome.state
        if state == LOST:
            log.warning("job %s was taken over by another worker; leaving it", self.job_id)
            return state
        if state != QUEUED:
            self._snapshot()
        with session_scope(self.url) as s:
            job = s.get(Job, self.job_id)
            if job is None or job.worker_id != self.worker.worker_id or job.state in FINAL_STATES:
                return job.state if job is not None else state
            job.updated_at = utcnow()
            if job.cancel_requested and state in (QUEUED, SUCCEEDED):
                # A cancel this worker had not yet seen (it came after the last heartbeat): it
                # wins, as during the build, and a succeeded job keeps its results. Handed back
                # (shut down, its study busy, the cluster gone), why it would have waited is no
                # error of the cancelled job (it showed "waiting for its study: ...").
                outcome.error = outcome.error if state == SUCCEEDED else None
                state = outcome.state = CANCELLED
            if state == QUEUED:
                # Graceful shutdown: hand the job back without spending one of its attempts.
                job.state, job.worker_id, job.attempts = QUEUED, None, max(0, job.attempts - 1)
                if not outcome.said:
                    add_event(s, job.id, "requeued", {"reason": outcome.error or "worker shut down"})
                return state
            _record_outcome(s, job, outcome)
        log.info("job %s: %s", self.job_id, state)
        return state


def _record_outcome(s: Any, job: Job, outcome: Outcome) -> None:
    """The job's final row: its summary and figures, its build linked, its `done` event."""
    if outcome.summary is not None:
        apply_summary(job, outcome.summary)
        job.summary = jsonable(outcome.summary.to_dict())
    build = outcome.build or BuildOutcome()
    row = s.get(Build, build.build_id) if build.build_id else None
    if row is not None:
        row.job_id = job.id
    elif build.path:
        s.add(Build(job_id=job.id, study_name=job.study_name, trial_number=build.trial, path=build.path,
                    sha256=build.sha256, size_bytes=build.size_bytes))  # fmt: skip
    if build.path:
        add_event(
            s, job.id, "build", {"trial": build.trial, "sha256": build.sha256, "size_bytes": build.size_bytes}
        )
    job.error = outcome.error or build.error
    job.log = outcome.log or build.log
    if job.log is None and job.error and one_line(job.error) != job.error:
        job.log = job.error  # views show one line of it (`one_line`); `links.log` has the whole
    job.state, job.finished_at = outcome.state, utcnow()
    done = {
        "state": outcome.state,
        "error": job.error,
        "best_tokens_per_s": job.best_tokens_per_s,
        "speedup": job.speedup,
        "done": job.trials_done,
        "total": job.trials_total,
    }
    add_event(s, job.id, "done", jsonable(done))


def _may_change_ranking(event: dict[str, Any]) -> bool:
    """A trial measured a throughput, or the study ended (after its re-measurements): the best,
    the baseline or both may have moved."""
    result = event.get("result")
    measured = isinstance(result, dict) and result.get("status") == OK
    return event.get("event") == "done" or (event.get("event") == "trial_finished" and measured)


def apply_ranking(job: Job, ranking: Ranking) -> None:
    """A running job's figures from its study's ranking so far, by the rule its final summary
    follows (`apply_summary`): the best's median, the baseline's, and the speedup as soon as the
    baseline and a trial the ranking accepts have measured."""
    if ranking.best is not None:
        job.best_tokens_per_s = ranking.best.tokens_per_s
    if ranking.baseline is not None:
        job.baseline_tokens_per_s = ranking.baseline.tokens_per_s
    job.speedup = ranking.speedup


def apply_summary(job: Job, summary: StudySummary) -> None:
    """The job's figures are the summary's: the ranked winner's median, its speedup."""
    if summary.best is not None:
        job.best_tokens_per_s = summary.best.tokens_per_s
    job.baseline_tokens_per_s = summary.baseline.tokens_per_s if summary.baseline else None
    job.speedup = summary.speedup


def jsonable(value: Any) -> Any:
    """Payloads go into a JSON column: keep numbers, strings, lists and dicts; stringify the rest."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    return str(value)
