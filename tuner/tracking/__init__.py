"""Experiment trackers the study driver reports to through its hooks (`tuner.study.Hooks`):
MLflow when `TUNER_MLFLOW_TRACKING_URI` is set (the optional extra `tuner[mlflow]`)."""

from tuner.tracking.mlflow import MlflowTracker, tracked_hooks

__all__ = ["MlflowTracker", "tracked_hooks"]
