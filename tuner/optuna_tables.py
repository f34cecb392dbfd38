"""The columns of Optuna's own tables that the service reads with SQL directly (Optuna owns the
tables and their migrations). Its storage API builds a FrozenTrial per trial, 0.4 to 1 ms each:
seconds for a 10,000-trial study, where the readers here need a handful of columns in bulk."""

from __future__ import annotations

from sqlalchemy import Column, DateTime, Float, Integer, MetaData, String, Table, Text

_md = MetaData()
studies = Table("studies", _md, Column("study_id", Integer), Column("study_name", String))
trials = Table(
    "trials",
    _md,
    Column("trial_id", Integer),
    Column("number", Integer),
    Column("study_id", Integer),
    Column("state", String),
    Column("datetime_start", DateTime),
    Column("datetime_complete", DateTime),
)
values = Table(
    "trial_values", _md, Column("trial_id", Integer), Column("objective", Integer), Column("value", Float)
)
params = Table(
    "trial_params",
    _md,
    Column("trial_id", Integer),
    Column("param_name", String),
    Column("param_value", Float),
    Column("distribution_json", Text),
)
user_attrs = Table(
    "trial_user_attributes",
    _md,
    Column("trial_id", Integer),
    Column("key", String),
    Column("value_json", Text),
)
study_attrs = Table(
    "study_user_attributes",
    _md,
    Column("study_id", Integer),
    Column("key", String),
    Column("value_json", Text),
)
