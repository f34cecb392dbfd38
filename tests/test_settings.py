"""Settings are read and checked in one place (`tuner.settings`), paths made absolute there, and every
entry point (`tuner serve`, `tuner worker`, the API, the CLI defaults) takes them from it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.artifacts import ArtifactStore
from tuner.cli.main import app
from tuner.settings import Settings, SettingsError, absolute_database_url
from tuner.worker import WorkerSettings

PATH_VARS = ("TUNER_DATABASE_URL", "TUNER_ARTIFACT_DIR", "TUNER_RUNS_DIR")


@pytest.fixture
def no_path_settings(monkeypatch, tmp_path):
    for name in PATH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_defaults_are_absolute_paths_in_the_directory_the_command_started_in(no_path_settings):
    s = Settings.from_env()
    assert s.database_url == f"sqlite:///{no_path_settings / 'tuner.db'}"
    assert s.artifact_dir == no_path_settings / "builds"
    assert s.runs_dir == no_path_settings / "runs"
    assert ArtifactStore().root == no_path_settings / "builds"


def test_relative_settings_are_resolved_once_against_the_starting_directory(no_path_settings):
    env = {"TUNER_DATABASE_URL": "sqlite:///data/t.db", "TUNER_ARTIFACT_DIR": "out", "TUNER_RUNS_DIR": "~/r"}
    s = Settings.from_env(env, cwd="/srv/tuner")
    assert s.database_url == "sqlite:////srv/tuner/data/t.db"
    assert s.artifact_dir == Path("/srv/tuner/out")
    assert s.runs_dir == Path.home() / "r"
    # Handed to a child process, they mean the same place whatever directory it runs in.
    again = Settings.from_env(s.environ(), cwd="/elsewhere")
    assert (again.database_url, again.artifact_dir, again.runs_dir) == (
        s.database_url,
        s.artifact_dir,
        s.runs_dir,
    )


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://u:p@db:5432/tuner",
        "sqlite:////abs/t.db",
        "sqlite://",
        "sqlite:///:memory:",
        "not a url",
    ],
)
def test_only_relative_sqlite_files_change(url):
    assert absolute_database_url(url, "/x") == url


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("TUNER_MAX_TRIALS", "7x", "TUNER_MAX_TRIALS='7x' is not an integer"),
        ("TUNER_MAX_TRIALS", "0", "TUNER_MAX_TRIALS=0 must be >= 1"),
        ("TUNER_REMEASURE_TOP", "-1", "TUNER_REMEASURE_TOP=-1 must be >= 0"),
        ("TUNER_BUILD", "maybe", "TUNER_BUILD='maybe' is not a boolean"),
        ("TUNER_EXECUTOR", "slurm", "TUNER_EXECUTOR: unknown executor 'slurm'; use local or ray"),
    ],
)
def test_a_bad_value_names_the_variable(name, value, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env({name: value})


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_serve_and_worker_refuse_the_same_bad_setting(no_path_settings, monkeypatch, command):
    """The worker used to read the environment with its own rules and ignore TUNER_MAX_TRIALS=7x."""
    monkeypatch.setenv("TUNER_MAX_TRIALS", "7x")
    result = CliRunner().invoke(app, [command])
    assert result.exit_code == 2, result.output
    assert "TUNER_MAX_TRIALS='7x' is not an integer" in " ".join(result.output.split())
    assert list(no_path_settings.iterdir()) == []  # refused before touching the database


def test_the_worker_takes_the_service_settings(no_path_settings):
    s = Settings.from_env({"TUNER_MAX_TRIALS": "7", "TUNER_REMEASURE_TOP": "0", "TUNER_BUILD": "false"})
    w = WorkerSettings.from_settings(s, poll_s=0.5)
    assert (w.max_trials, w.remeasure_top, w.build, w.executor, w.poll_s) == (7, 0, False, "local", 0.5)
    assert w.database_url == f"sqlite:///{no_path_settings / 'tuner.db'}"
    assert Path(w.artifact_dir) == no_path_settings / "builds"


def test_a_relative_cache_dir_reaches_trial_ranks_as_the_directory_the_command_started_in(
    no_path_settings, monkeypatch
):
    """Ranks run in the trial's own directory: `TUNER_CACHE_DIR=cache` used to become
    runs/<trial>/cache, so every trial measured the device's peak again in a cache of its own."""
    from tuner.executors.local import trial_env

    monkeypatch.setenv("TUNER_CACHE_DIR", "cache")
    assert trial_env()["TUNER_CACHE_DIR"] == str(no_path_settings / "cache")
    assert trial_env({"TUNER_CACHE_DIR": "/srv/cache"})["TUNER_CACHE_DIR"] == "/srv/cache"
    monkeypatch.delenv("TUNER_CACHE_DIR")
    assert "TUNER_CACHE_DIR" not in trial_env()  # unset stays unset: the device layer's default
