"""Bad input to `tuner db` and to the time limits of `tuner tune` and `tuner build`: exit 2 with one
line naming the option and the fix, never a traceback, and nothing started or written first."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli.main import app

runner = CliRunner()
RECIPE = str(Path(__file__).resolve().parent.parent / "recipes" / "gpt-tiny.yaml")


def _text(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.mark.parametrize("command", ["current", "upgrade"])
@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("foo", "Could not parse SQLAlchemy URL"),
        ("postgresql+nodriver://tuner@db/tuner", "Can't load plugin"),
    ],
)
def test_db_refuses_a_bad_database_url_naming_the_option(tmp_path, monkeypatch, command, url, expected):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
    line = _text(runner.invoke(app, ["db", command, "--database-url", url]))
    assert line.startswith(f"error: --database-url: cannot use {url!r}: "), line
    assert expected in line and "expected e.g. sqlite:///tuner.db" in line, line
    assert "TUNER_DATABASE_URL" not in line, line
    assert list(tmp_path.iterdir()) == []


def test_db_names_the_environment_variable_when_the_url_came_from_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TUNER_DATABASE_URL", "foo")
    line = _text(runner.invoke(app, ["db", "current"]))
    assert line.startswith("error: TUNER_DATABASE_URL: cannot use 'foo': "), line


def test_db_current_names_the_option_when_the_database_cannot_be_opened(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
    url = f"sqlite:///{tmp_path}/no/such/folder/tuner.db"
    line = _text(runner.invoke(app, ["db", "current", "--database-url", url]))
    assert "cannot read the database: unable to open database file; check --database-url" in line


def test_db_current_still_reads_a_good_url(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
    result = runner.invoke(app, ["db", "current", "--database-url", "sqlite:///fresh.db"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("empty (behind "), result.output
    # The relative file, in the current folder; a look at it does not make it.
    assert f"no database at {tmp_path / 'fresh.db'} yet" in result.output
    assert not (tmp_path / "fresh.db").exists()


def _no_start(*args, **kwargs):
    raise AssertionError("a refused time limit must fail before anything starts")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0"])
def test_tune_refuses_a_time_limit_that_is_not_a_positive_number(tmp_path, monkeypatch, value):
    # NaN passes `<= 0`: the study ran with no time limit at all (the driver's deadline was NaN).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tuner.executors.make_executor", _no_start)
    monkeypatch.setattr("tuner.study.run_study", _no_start)
    storage = f"sqlite:///{tmp_path}/study.db"
    result = runner.invoke(app, ["tune", RECIPE, "--timeout-min", value, "--storage", storage])
    line = _text(result)
    assert f"--timeout-min: must be a positive number of minutes, got {float(value):g}" in line
    assert "e.g. --timeout-min 30" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0"])
def test_build_refuses_a_time_limit_that_is_not_a_positive_number(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tuner.build.build_trial", _no_start)
    monkeypatch.setattr("tuner.cli.build.storage_or_exit", _no_start)
    storage = f"sqlite:///{tmp_path}/study.db"
    args = ["build", RECIPE, "--timeout-s", value, "--storage", storage, "--out", str(tmp_path / "b")]
    line = _text(runner.invoke(app, args))
    assert f"--timeout-s: must be a positive number of seconds, got {float(value):g}" in line
    assert "e.g. --timeout-s 900" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["nan", "inf", "0"])
def test_measure_refuses_a_time_limit_that_is_not_a_positive_number(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tuner.cli.measure.executor_or_exit", _no_start)
    line = _text(runner.invoke(app, ["measure", RECIPE, "--timeout-s", value]))
    assert f"--timeout-s: must be a positive number of seconds, got {float(value):g}" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["show"], ["plan"]])
def test_a_sqlite_file_in_a_folder_that_does_not_exist_is_refused_naming_storage(
    tmp_path, monkeypatch, command
):
    monkeypatch.chdir(tmp_path)
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "gpt-tiny.yaml"
    url = f"sqlite:///{tmp_path}/no/such/folder/tuner.db"
    line = _text(runner.invoke(app, [*command, str(recipe), "--storage", url]))
    assert line.startswith("error: --storage: cannot open the SQLite database") and "folder exists" in line


def test_token_commands_say_the_database_cannot_be_opened(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TUNER_DATABASE_URL", f"sqlite:///{tmp_path}/no/such/folder/tuner.db")
    for args in (["token", "list"], ["token", "create", "--name", "ci"], ["token", "revoke", "ci"]):
        line = _text(runner.invoke(app, args))
        assert (
            line == "error: cannot open the database: unable to open database file; check TUNER_DATABASE_URL"
        )


@pytest.mark.parametrize("seed", ["-1", str(2**31)])
def test_tune_refuses_a_seed_samplers_cannot_take_before_anything_starts(tmp_path, monkeypatch, seed):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tuner.study.run_study", _no_start)
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "gpt-tiny.yaml"
    result = runner.invoke(app, ["tune", str(recipe), "--seed", seed])
    assert result.exit_code == 2 and "--seed" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "env", "names"),
    [
        (["tune", RECIPE, "--trials", "1"], {"TUNER_RUNS_DIR": "{bad}"}, "TUNER_RUNS_DIR"),
        (["measure", RECIPE, "--workdir", "{bad}"], {}, "--workdir"),
        (["measure", RECIPE, "--profile", "{bad}"], {}, "--profile"),
        (["measure", RECIPE], {"TUNER_RUNS_DIR": "{bad}"}, "TUNER_RUNS_DIR"),
        (["build", RECIPE, "--out", "{bad}"], {}, "--out"),
        (["build", RECIPE], {"TUNER_ARTIFACT_DIR": "{bad}"}, "TUNER_ARTIFACT_DIR"),
        (["nightly", str(Path(RECIPE).parent / "nightly"), "--local", "--report", "{bad}"], {}, "--report"),
        (["worker", "--once"], {"TUNER_RUNS_DIR": "{bad}"}, "TUNER_RUNS_DIR"),
        (["worker", "--once"], {"TUNER_ARTIFACT_DIR": "{bad}"}, "TUNER_ARTIFACT_DIR"),
    ],
)
def test_a_folder_that_cannot_be_written_is_refused_before_any_work_naming_its_option(
    tmp_path, monkeypatch, args, env, names
):
    """A runs folder that could not be made was stored as the baseline trial's `error` (the study
    never measured its baseline again); a report folder failed the night after its tuning, with a
    traceback; build and measure folders ended in tracebacks."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = str(blocker / "below")  # a folder under a file: no one can make it
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(bad=bad))
    line = _text(runner.invoke(app, [a.format(bad=bad) for a in args]))
    assert line.startswith(f"error: {names}") and f"cannot write to the folder {bad}" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing ran, nothing stored


@pytest.mark.parametrize("command", ["plan", "show", "build", "tune"])
@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://x@localhost/y", "needs a database driver that is not installed"),
        ("sqlite:///:memory:", "is an in-memory database"),
    ],
)
def test_a_storage_url_no_study_can_live_in_is_one_line_naming_storage(
    tmp_path, monkeypatch, command, url, says
):
    """A dialect without its driver ended in an ImportError traceback; an in-memory SQLite
    database (one per connection) in `no such table: studies`."""
    monkeypatch.chdir(tmp_path)
    line = _text(
        runner.invoke(
            app, [command, RECIPE, "--storage", url, *(["--trials", "1"] if command == "tune" else [])]
        )
    )
    assert line.startswith("error: --storage: ") and says in line


def test_a_knob_set_twice_is_refused_and_one_the_config_does_not_use_is_named(tmp_path, monkeypatch):
    """`--set tp=1 --set tp=2` ran the last silently; `--set sequence_parallel=true` with tp=1 was
    dropped from the config without a word."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tuner.cli.measure.executor_or_exit", _no_start)
    line = _text(runner.invoke(app, ["measure", RECIPE, "--set", "tp=1", "--set", "tp=2"]))
    assert line == "error: --set tp given twice (1 and 2); give it once"
    result = runner.invoke(app, ["measure", RECIPE, "--set", "sequence_parallel=true", "--set", "tp=1"])
    assert "note: --set sequence_parallel has no effect here; it applies with tp > 1" in result.output


def test_db_upgrade_refuses_another_programs_database_and_db_current_makes_none(tmp_path, monkeypatch):
    """`tuner db upgrade` migrated into a database holding another program's tables, which plan,
    show and tune refuse; `tuner db current` of a file not there created it empty."""
    import sqlite3

    monkeypatch.chdir(tmp_path)
    other = tmp_path / "mlflow.db"
    with sqlite3.connect(other) as con:
        con.execute("CREATE TABLE experiments (id INTEGER)")
    line = _text(runner.invoke(app, ["db", "upgrade", "--database-url", f"sqlite:///{other}"]))
    assert (
        line.startswith("error: --database-url: ") and "holds another program's tables (experiments)" in line
    )
    with sqlite3.connect(other) as con:
        assert [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")] == [
            "experiments"
        ]
    result = runner.invoke(app, ["db", "current", "--database-url", f"sqlite:///{tmp_path}/none.db"])
    assert result.exit_code == 0 and "empty (behind " in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_token_list_and_revoke_make_no_database(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TUNER_DATABASE_URL", "sqlite:///tokens.db")
    listed = runner.invoke(app, ["token", "list"])
    assert listed.exit_code == 0 and listed.output.startswith("no tokens")
    line = _text(runner.invoke(app, ["token", "revoke", "ci"]))
    assert line == "error: no token named 'ci': there is no database yet (see TUNER_DATABASE_URL)"
    assert list(tmp_path.iterdir()) == []
