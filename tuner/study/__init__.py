"""The Optuna study of a recipe: an ask/tell loop over an executor (`driver`), typed budgets
(`budget`), the samplers, the study's name, and the re-measurement of the top configs before a
winner is named (`remeasure`). `run_study` runs it all."""

from tuner.study.budget import Budget, Hooks, Progress
from tuner.study.naming import study_name
from tuner.study.run import run_study
from tuner.study.samplers import SAMPLERS, make_sampler

__all__ = ["SAMPLERS", "Budget", "Hooks", "Progress", "make_sampler", "run_study", "study_name"]
