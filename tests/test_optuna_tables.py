"""`tuner.optuna_tables` declares the columns of Optuna's tables that the readers use; this pins
those declarations to what a fresh Optuna storage creates (on SQLite and PostgreSQL), so an Optuna
upgrade that renames or retypes one fails here rather than in a reader."""

from __future__ import annotations

import optuna
import pytest
from sqlalchemy import DateTime, Enum, Float, Integer, String, Text, inspect

from tuner import optuna_tables
from tuner.record import keys

_KINDS = {
    Integer: "INT",
    String: ("CHAR", "TEXT"),
    Text: ("TEXT", "CHAR"),
    Float: ("FLOAT", "DOUBLE", "REAL", "NUMERIC"),
    DateTime: ("DATETIME", "TIMESTAMP"),
}


def _compatible(declared, reflected) -> bool:
    name = str(reflected).upper()
    if isinstance(declared, Enum):
        enums = getattr(reflected, "enums", None)
        # SQLite keeps the names as VARCHAR; PostgreSQL has a native enum type of that name.
        return (enums is not None and set(enums) == set(declared.enums)) or "CHAR" in name
    for kind, marks in _KINDS.items():
        if isinstance(declared, kind):
            return any(m in name for m in ((marks,) if isinstance(marks, str) else marks))
    raise AssertionError(f"no rule for a declared {declared!r}")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def optuna_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'optuna.db'}"
        return
    from test_db import fresh_pg_database

    url, drop = fresh_pg_database()
    yield url
    drop()


def test_declared_columns_match_a_fresh_optuna_storage(optuna_url):
    storage = optuna.storages.RDBStorage(optuna_url)
    try:
        insp = inspect(storage.engine)
        for table in optuna_tables.metadata.sorted_tables:
            assert insp.has_table(table.name), f"Optuna no longer has the table {table.name}"
            columns = {c["name"]: c["type"] for c in insp.get_columns(table.name)}
            for column in table.columns:
                assert column.name in columns, f"{table.name}.{column.name} is gone from Optuna's schema"
                assert _compatible(column.type, columns[column.name]), (
                    f"{table.name}.{column.name}: declared {column.type}, Optuna has {columns[column.name]}"
                )
    finally:
        storage.engine.dispose()


def test_the_enum_names_and_the_constraint_key_are_optunas():
    from optuna.trial import TrialState

    assert set(optuna_tables.TRIAL_STATES) == {s.name for s in TrialState}
    study = optuna.create_study()
    trial = study.ask()
    trial.set_constraint(keys.MEMORY_CONSTRAINT, 0.5)
    study.tell(trial, 1.0)
    frozen = study.trials[0]
    assert frozen.system_attrs == {f"{keys.CONSTRAINT_PREFIX}{keys.MEMORY_CONSTRAINT}": 0.5}
    assert frozen.constraints == {keys.MEMORY_CONSTRAINT: 0.5}


def test_a_seeded_study_reads_back_through_optuna(tmp_path):
    """Rows written through these declarations are trials Optuna itself loads."""
    from seed import seed_study

    url = f"sqlite:///{tmp_path / 't.db'}"
    seed_study(url, "pinned", 12, seed=4)
    trials = optuna.load_study(study_name="pinned", storage=url).get_trials(deepcopy=False)
    assert len(trials) == 12 and {t.state.name for t in trials} <= {"COMPLETE", "FAIL"}
    assert all(t.values for t in trials if t.state.name == "COMPLETE")
