"""MLflow logging of a study, by the driver (never by trial ranks): each finished trial one MLflow
run (its knobs as params, its numeric result keys as metrics, its status as a tag) in an
experiment named after the study; when the study ends, the winner's run tagged `tuner.winner`.

On when `TUNER_MLFLOW_TRACKING_URI` is set; it needs `pip install 'tuner[mlflow]'`. A tracker that
cannot write (the server is down) logs a warning and the study goes on: tracking is a copy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from tuner.record import keys
from tuner.record.status import OK
from tuner.settings import SettingsError, mlflow_tracking_uri

log = logging.getLogger("tuner.tracking")

WINNER_TAG = "tuner.winner"
TRIAL_TAG = "tuner.trial"
STATUS_TAG = "tuner.status"
STUDY_TAG = "tuner.study"


def _numeric(result: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key in keys.RESULT_KEYS:
        value = result.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


class MlflowTracker:
    """Logs one study's trials to MLflow at `uri` (e.g. `file:///srv/mlruns`, `http://mlflow:5000`)."""

    def __init__(self, uri: str, study_name: str, recipe_name: str | None = None):
        try:
            import mlflow  # noqa: F401 - fail now, with the fix, rather than at the first trial
        except ImportError:
            raise SettingsError(
                "TUNER_MLFLOW_TRACKING_URI is set but MLflow is not installed: pip install 'training-tuner[mlflow]' "
                "(or unset TUNER_MLFLOW_TRACKING_URI)"
            ) from None
        # A tracking server that is down must cost a study seconds, not MLflow's default of 7
        # retries with backoff and a 120 s timeout per request (minutes per trial).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.uri = uri
        self.disabled = False  # set after the first failure: the rest of the study is not tracked
        self._client: Any = None
        self.study_name = study_name
        self.recipe_name = recipe_name
        self._experiment: str | None = None
        self.runs: dict[int, str] = {}  # trial number -> MLflow run id (this process's)

    @property
    def client(self) -> Any:
        if self._client is None:  # made on first use, where a store that cannot open only warns
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def experiment_id(self) -> str:
        if self._experiment is None:
            found = self.client.get_experiment_by_name(self.study_name)
            self._experiment = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(
                    self.study_name, tags={"tuner.recipe": self.recipe_name or ""}
                )
            )
        return self._experiment

    def trial_finished(self, event: dict[str, Any]) -> None:
        number, result = event.get("trial"), event.get("result") or {}
        if not isinstance(number, int) or number in self.runs:
            return
        status = str(result.get(keys.STATUS) or "")
        tags = {TRIAL_TAG: str(number), STATUS_TAG: status, STUDY_TAG: self.study_name}
        if result.get(keys.ERROR):
            tags["tuner.error"] = str(result[keys.ERROR])[:500]
        run = self.client.create_run(self.experiment_id(), tags=tags, run_name=f"trial {number}")
        params = {k: str(v) for k, v in (event.get("config") or {}).items()}
        from mlflow.entities import Metric, Param

        self.client.log_batch(
            run.info.run_id,
            metrics=[Metric(k, v, 0, 0) for k, v in _numeric(result).items()],
            params=[Param(k, v) for k, v in params.items()],
        )
        self.client.set_terminated(run.info.run_id, "FINISHED" if status == OK else "FAILED")
        self.runs[number] = run.info.run_id

    def study_done(self, event: dict[str, Any]) -> None:
        """Tag the winner's run with its figure (the ranking's median over re-measurements)."""
        best = ((event.get("summary") or {}).get("best")) or {}
        number = best.get("trial")
        if not isinstance(number, int):
            return
        run_id = self.runs.get(number) or self._find_run(number)
        if run_id is None:
            return
        self.client.set_tag(run_id, WINNER_TAG, "true")
        self.client.log_metric(run_id, "winner_tokens_per_s", float(best["tokens_per_s"]))
        self.client.set_experiment_tag(self.experiment_id(), "tuner.winner_trial", str(number))

    def _find_run(self, number: int) -> str | None:
        """A winner measured by an earlier run of the study (a resumed one) was logged then."""
        found = self.client.search_runs(
            [self.experiment_id()], f"tags.`{TRIAL_TAG}` = '{number}'", max_results=1
        )
        return found[0].info.run_id if found else None

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if self.disabled:
            return
        try:
            if kind == "trial_finished":
                self.trial_finished(event)
            elif kind == "done":
                self.study_done(event)
        except Exception as err:  # noqa: BLE001 - a tracker that cannot write must not stop the study
            self.disabled = True
            log.warning("MLflow logging of %s failed, not tracking the rest of it: %s", self.study_name, err)


def tracked_hooks(hooks: Any, study_name: str, recipe_name: str | None = None) -> Any:
    """`hooks` (the driver's `tuner.study.Hooks`) with MLflow logging added to its progress when
    `TUNER_MLFLOW_TRACKING_URI` is set; else `hooks` as they are."""
    uri = mlflow_tracking_uri()
    if uri is None:
        return hooks
    tracker = MlflowTracker(uri, study_name, recipe_name)
    given = hooks.progress

    def progress(event: dict[str, Any]) -> None:
        tracker(event)
        given(event)

    return dataclasses.replace(hooks, progress=progress)
