"""A database a command cannot use, and an API address `tuner serve` cannot listen on, as a user
meets them: one line naming where the value came from (the option or the variable) and the fix,
the database's password never printed, and nothing started first."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli.main import app

runner = CliRunner()
RECIPE = str(Path(__file__).resolve().parent.parent / "recipes" / "gpt-tiny.yaml")
PG_HOST = "127.0.0.1"
# A PostgreSQL URL with a password, on a port where nothing listens (refused at once).
DEAD_PG = f"postgresql+psycopg://postgres:s3cret-pw@{PG_HOST}:1/test"


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error: "), result.output
    return " ".join(" ".join(lines).split())


COMMANDS = {
    "show": ["show", RECIPE],
    "plan": ["plan", RECIPE],
    "build": ["build", RECIPE],
    "nightly": ["nightly", RECIPE, "--local", "--report", "{tmp}/reports"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_bad_database_url_is_named_by_where_it_came_from(tmp_path, monkeypatch, command):
    """`TUNER_DATABASE_URL=foo tuner show` said `--storage: 'foo' ...` to a user who never typed
    --storage; `tuner nightly --storage foo` said `TUNER_DATABASE_URL: cannot use 'foo'`, after
    its progress bars had started."""
    monkeypatch.chdir(tmp_path)
    args = [a.format(tmp=tmp_path) for a in COMMANDS[command]]
    monkeypatch.setenv("TUNER_DATABASE_URL", "foo")
    line = _one_error_line(runner.invoke(app, args))
    assert line.startswith("error: TUNER_DATABASE_URL: 'foo' is not a database URL"), line
    monkeypatch.delenv("TUNER_DATABASE_URL")
    result = runner.invoke(app, [*args, "--storage", "foo"])
    line = _one_error_line(result)
    assert line.startswith("error: --storage: 'foo' is not a database URL"), line
    assert len([x for x in result.output.splitlines() if x.strip()]) == 1, result.output


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("given", ["--storage", "TUNER_DATABASE_URL"])
def test_a_database_that_does_not_answer_is_one_line_without_its_password(
    tmp_path, monkeypatch, command, given
):
    """The URL, password and all, was printed into the error (and so into the nightly's mailed
    log); `tuner build` and the service already hid it."""
    monkeypatch.chdir(tmp_path)
    args = [a.format(tmp=tmp_path) for a in COMMANDS[command]]
    if given == "--storage":
        monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
        args += ["--storage", DEAD_PG]
    else:
        monkeypatch.setenv("TUNER_DATABASE_URL", DEAD_PG)
    line = _one_error_line(runner.invoke(app, args))
    assert line.startswith(f"error: {given}: cannot connect to "), line
    assert "postgres:***@" in line and "s3cret-pw" not in line, line


def test_show_of_a_study_not_there_hides_the_password(monkeypatch):
    """Real PostgreSQL (trust auth takes any password): the 'no study' line printed it."""
    url = os.environ.get("TUNER_TEST_PG_URL", f"postgresql+psycopg://postgres@{PG_HOST}:5432/test")
    with_password = url.replace("postgres@", "postgres:s3cret-pw@", 1)
    result = runner.invoke(app, ["show", RECIPE, "--storage", with_password, "--study", "no-such-study"])
    line = _one_error_line(result)
    assert "no study 'no-such-study' in " in line and "s3cret-pw" not in line, line


def test_a_study_report_hides_the_password(capsys):
    from tuner.cli.tune import _report
    from tuner.summary import StudySummary

    summary = StudySummary(study_name="s", storage_url=DEAD_PG)
    _report(summary, as_json=False, top=5)
    _report(summary, as_json=True, top=5)
    out = capsys.readouterr().out
    assert "postgres:***@" in out and "s3cret-pw" not in out, out
    # What a job stores in its row (`jobs.summary`) is the same dict.
    assert "s3cret-pw" not in str(summary.to_dict()) and "postgres:***@" in summary.to_dict()["storage_url"]


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TUNER_DATABASE_URL": f"sqlite:///{tmp_path}/t.db", "COLUMNS": "300"}
    return subprocess.run(
        [sys.executable, "-m", "tuner.cli.main", "serve", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_serve_on_a_port_in_use_exits_2_naming_port_before_any_worker_starts(tmp_path):
    """uvicorn's own `ERROR: [Errno 98] ... address already in use` and exit code 3, after the
    workers had started (and could claim a job) and the schema had been migrated."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve(tmp_path, "--port", str(port), "--workers", "1")
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr
    assert f"error: --port {port}: 127.0.0.1:{port} is already in use" in said and "another --port" in said
    assert "waiting for jobs" not in said and "Traceback" not in said, done.stderr
    assert not (tmp_path / "t.db").exists()  # nothing migrated for a server that cannot listen


def test_serve_on_a_host_that_is_not_this_machine_exits_2_naming_host(tmp_path):
    done = _serve(tmp_path, "--host", "999.1.1.1", "--workers", "0")
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr
    assert said.startswith("error: --host 999.1.1.1: cannot listen there") and "--host 0.0.0.0" in said


def test_measure_prints_the_whole_log_path_in_an_80_column_log(tmp_path):
    """Printed to a file or a narrow terminal, the table cut the log's path to `.../gpt-tiny-2026…`:
    the one line that says where to look when a trial failed could not be copied."""
    workdir = tmp_path / "a-folder-name-long-enough-that-the-path-cannot-fit-in-one-cell" / "trial"
    env = {**os.environ, "TUNER_DATABASE_URL": f"sqlite:///{tmp_path}/t.db", "COLUMNS": "80"}
    done = subprocess.run(
        [sys.executable, "-m", "tuner.cli.main", "measure", RECIPE, "--device", "cpu", "--workdir", str(workdir)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr  # the trial ran (its status is not the point)
    assert "…" not in done.stdout, done.stdout
    cells = "".join(ch for ch in done.stdout if ch not in "│┃ \n")  # the table's text, its folds joined
    assert str(workdir / "trial.log") in cells, done.stdout


def test_nightly_refuses_a_report_folder_that_is_the_recipe_folder(tmp_path, monkeypatch):
    """`tuner nightly recipes/nightly/ --report recipes/nightly/` ran its first night, wrote
    nightly-<date>.json beside the recipes, and every later night stopped with exit 2 reading that
    report as a broken recipe (`name: required field is missing`, `night: unknown field`, ...)."""
    import datetime as dt

    import tuner.cli.nightly as cli
    from tuner.nightly import write_report

    passes = []
    monkeypatch.setattr(cli, "_run_pass", lambda *a, **kw: passes.append(a) or 0)  # nothing tunes
    folder = tmp_path / "nightly"
    folder.mkdir()
    (folder / "a.yaml").write_text(
        "name: a\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 8, vocab: 64}\n"
    )
    monkeypatch.chdir(folder)
    storage = ["--storage", f"sqlite:///{tmp_path}/t.db"]
    for report in (str(folder), "."):
        line = _one_error_line(
            runner.invoke(app, ["nightly", str(folder), "--local", "--report", report, *storage])
        )
        assert line.startswith(f"error: --report {folder}: is the recipe folder"), line
        assert "--report nightly-reports" in line and sorted(p.name for p in folder.iterdir()) == ["a.yaml"]
    assert passes == []
    # A report already written there (by an earlier version) is named as what it is.
    write_report([], folder, dt.date(2026, 12, 6), 0.05)
    result = runner.invoke(
        app, ["nightly", str(folder), "--local", "--report", str(tmp_path / "r"), *storage]
    )
    line = _one_error_line(result)
    said = f"error: {folder}/nightly-2026-12-06.json: is a nightly report (--report), not a recipe"
    assert line == f"{said}; move it out of this folder", line
    assert passes == []


def test_nightly_with_api_checks_a_recipe_as_the_service_will_before_the_first_recipe(tmp_path):
    """The service takes a search space by name only (a file here is not one on its workers), and
    refused such a recipe with a 422 every night, as a failed recipe (exit 1), after the recipes
    before it had spent the night; the folder is checked by the service's rule first now."""
    space = tmp_path / "my-space.yaml"
    space.write_text((Path(RECIPE).parent.parent / "search_spaces" / "cpu.yaml").read_text())
    folder = tmp_path / "nightly"
    folder.mkdir()
    (folder / "a.yaml").write_text(
        "name: a\nmodel: {layers: 2, hidden: 64, heads: 4, seq_len: 8, vocab: 64}\n"
        f"hardware: {{device: cpu}}\nsearch: {{space: {space}}}\n"
    )
    args = [
        "nightly",
        str(folder),
        "--report",
        str(tmp_path / "r"),
        "--storage",
        f"sqlite:///{tmp_path}/t.db",
    ]
    line = _one_error_line(runner.invoke(app, [*args, "--api", "http://127.0.0.1:1", "--token", "t"]))
    assert (
        line
        == f"error: {folder}/a.yaml: search.space: unknown search space; this service has: cpu, cuda, npu"
    )
    assert not (tmp_path / "r").exists()


def test_a_nightly_folder_skips_hidden_files_that_only_look_like_recipes(tmp_path):
    """macOS leaves `._NAME.yaml` resource forks beside a copied folder's files (binary, not YAML):
    read as recipes, one stopped every night before the first recipe ran."""
    from tuner.nightly.inputs import find_recipes

    folder = tmp_path / "nightly"
    folder.mkdir()
    (folder / "gpt.yaml").write_text(Path(RECIPE).read_text())
    (folder / "._gpt.yaml").write_bytes(b"\x00\x05\x16\x07Mac OS X        \x00\x02\xff\xfe")
    assert [f.name for f, _ in find_recipes(folder)] == ["gpt.yaml"]
