"""The columns of Optuna's own tables that this project reads (and, for seeded test studies,
writes) with SQL directly. Optuna owns the tables and their migrations; tests/test_optuna_tables.py
pins these declarations to the schema a fresh Optuna storage creates, so an Optuna upgrade that
changes them fails a test instead of a reader.

Its storage API builds a FrozenTrial per trial, 0.4 to 1 ms each: seconds for a 10,000-trial
study, where the readers here need a handful of columns in bulk.
"""

from __future__ import annotations

from sqlalchemy import Column, DateTime, Enum, Float, Integer, MetaData, String, Table, Text

# Optuna stores enums by member name; on PostgreSQL they are native enum types of these names.
TRIAL_STATES = ("RUNNING", "COMPLETE", "PRUNED", "FAIL", "WAITING")
VALUE_TYPES = ("FINITE", "INF_POS", "INF_NEG")

metadata = MetaData()
studies = Table("studies", metadata, Column("study_id", Integer), Column("study_name", String))
trials = Table(
    "trials",
    metadata,
    Column("trial_id", Integer),
    Column("number", Integer),
    Column("study_id", Integer),
    Column("state", Enum(*TRIAL_STATES, name="trialstate", create_constraint=False)),
    Column("datetime_start", DateTime),
    Column("datetime_complete", DateTime),
)
values = Table(
    "trial_values",
    metadata,
    Column("trial_id", Integer),
    Column("objective", Integer),
    Column("value", Float),
    Column("value_type", Enum(*VALUE_TYPES, name="trialvaluetype", create_constraint=False)),
)
params = Table(
    "trial_params",
    metadata,
    Column("trial_id", Integer),
    Column("param_name", String),
    Column("param_value", Float),
    Column("distribution_json", Text),
)
user_attrs = Table(
    "trial_user_attributes",
    metadata,
    Column("trial_id", Integer),
    Column("key", String),
    Column("value_json", Text),
)
system_attrs = Table(
    "trial_system_attributes",
    metadata,
    Column("trial_id", Integer),
    Column("key", String),
    Column("value_json", Text),
)
study_attrs = Table(
    "study_user_attributes",
    metadata,
    Column("study_id", Integer),
    Column("key", String),
    Column("value_json", Text),
)
