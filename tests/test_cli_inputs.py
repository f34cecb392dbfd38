"""Bad input through every command that reads a recipe (measure, tune, show, plan, build,
nightly): exit 2, one line naming the file and what is wrong, never a traceback. Also the option
names every command spells the same way, and that every command's --help shows an example."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.recipe import MAX_RECIPE_BYTES

runner = CliRunner()

GOOD = {
    "name": "inputs",
    "model": {"family": "gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256},
    "hardware": {"device": "cpu", "devices": 1},
}

# name -> (how to make the bad recipe file at `path`, what the one-line error must say)
BAD_FILES = {
    "binary": (lambda p: p.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256))), "binary file"),
    "latin-1": (lambda p: p.write_bytes("name: café\n".encode("latin-1")), "not UTF-8 text (byte 0xe9"),
    "directory": (lambda p: p.mkdir(), "is a directory"),
    "too large": (lambda p: p.write_text("#" * (MAX_RECIPE_BYTES + 1)), "larger than 1024 KiB"),
    "missing": (lambda p: None, "cannot read recipe file"),
    "not yaml": (lambda p: p.write_text("name: [unclosed\n"), "not valid YAML or JSON"),
    "bad field": (
        lambda p: p.write_text(yaml.safe_dump({**GOOD, "model": {**GOOD["model"], "layers": 0}})),
        "model.layers: Input should be greater than or equal to 1",
    ),
    "unknown field": (
        lambda p: p.write_text(yaml.safe_dump({**GOOD, "colour": "red"})),
        "colour: unknown field",
    ),
    "list as a key": (lambda p: p.write_text(yaml.safe_dump(GOOD) + "? [a, b]\n: 2\n"), "a key is a name"),
    # open() on a FIFO waits for a writer: every command hung
    "fifo": (lambda p: os.mkfifo(p), "is not a regular file"),
    # the space file a recipe names: a traceback (a directory), a hang (a FIFO), no field (not UTF-8)
    "space a directory": (
        lambda p: p.write_text(yaml.safe_dump({**GOOD, "search": {"space": str(p.parent)}})),
        "search.space: " + "{dir}: is a directory, not a search space file",
    ),
    "space a fifo": (
        lambda p: (
            os.mkfifo(p.parent / "space.yaml"),
            p.write_text(yaml.safe_dump({**GOOD, "search": {"space": str(p.parent / "space.yaml")}})),
        ),
        "search.space: {dir}/space.yaml: is not a regular file",
    ),
    "space not utf-8": (
        lambda p: (
            (p.parent / "space.yaml").write_bytes(b"\xff\xfe"),
            p.write_text(yaml.safe_dump({**GOOD, "search": {"space": str(p.parent / "space.yaml")}})),
        ),
        "search.space: {dir}/space.yaml: is not UTF-8 text (byte 0xff",
    ),
}

COMMANDS = {
    "measure": lambda path: ["measure", path],
    "tune": lambda path: ["tune", path],
    "show": lambda path: ["show", path],
    "plan": lambda path: ["plan", path],
    "build": lambda path: ["build", path],
    "nightly": lambda path: ["nightly", path, "--local"],
}


def _one_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    return lines[0]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_every_command_refuses_a_bad_recipe_file_in_one_line(tmp_path, monkeypatch, command, kind):
    monkeypatch.chdir(tmp_path)  # nothing here may be written by a refused command
    make, expected = BAD_FILES[kind]
    # nightly takes a folder of recipes (or one file): a folder holding none, or no such path.
    expected = (
        {"directory": "no recipe files", "missing": "no such folder or file"}.get(kind, expected)
        if (command == "nightly")
        else expected
    )
    path = tmp_path / "recipe.yaml"
    make(path)
    made = sorted(p.name for p in tmp_path.iterdir())
    result = runner.invoke(app, COMMANDS[command](str(path)))
    assert result.exit_code == 2, result.output
    line = _one_line(result.output)
    assert line.startswith("error: ") and expected.format(dir=tmp_path) in line, line
    assert str(path) in line or kind.startswith("space"), line
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == made


@pytest.mark.parametrize(
    ("command", "new_name"),
    [("measure", "--timeout-s"), ("build", "--timeout-s"), ("tune", "--timeout-min")],
)
def test_the_old_timeout_spelling_is_refused_naming_the_new_one(tmp_path, command, new_name):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    result = runner.invoke(app, [command, str(path), "--timeout", "5"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"--timeout was renamed: use {new_name}" in text and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("command", "option", "unit"),
    [
        ("measure", "--timeout-s", "seconds"),
        ("build", "--timeout-s", "seconds"),
        ("tune", "--timeout-min", "minutes"),
    ],
)
def test_a_timeout_option_names_its_unit_in_the_message(tmp_path, command, option, unit):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    result = runner.invoke(app, [command, str(path), option, "-1"])
    assert result.exit_code == 2, result.output
    assert f"{option}: must be a positive number of {unit}" in " ".join(result.output.split())


def _commands(group, prefix: tuple[str, ...] = ()):
    """Every command and subcommand of the CLI (typer 0.29 carries its own click: duck-typed)."""
    for name, command in sorted(group.commands.items()):
        yield (*prefix, name), command
        if getattr(command, "commands", None):
            yield from _commands(command, (*prefix, name))


ALL_COMMANDS = [path for path, _ in _commands(typer.main.get_command(app))]


def test_the_command_list_is_what_the_readme_promises():
    names = {" ".join(p) for p in ALL_COMMANDS}
    assert {
        "measure",
        "tune",
        "show",
        "build",
        "serve",
        "worker",
        "nightly",
        "token create",
        "db upgrade",
    } <= names


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=[" ".join(p) for p in ALL_COMMANDS])
def test_every_command_help_shows_an_example(path):
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Example" in result.output, result.output
    # The example names the command it belongs to, ready to copy.
    assert f"tuner {' '.join(path)}" in result.output, result.output


def test_help_of_the_root_command_lists_every_command():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in {p[0] for p in ALL_COMMANDS}:
        assert name in result.output


def test_recipe_with_a_byte_order_mark_is_read(tmp_path):
    from tuner.recipe import load_recipe

    path = Path(tmp_path / "bom.yaml")
    path.write_bytes(b"\xef\xbb\xbf" + yaml.safe_dump(GOOD).encode())
    assert load_recipe(path).name == "inputs"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--executor", "slurm"], "--executor: unknown executor 'slurm'; use local or ray"),
        (["--executor", "ray", "--device", "H100"], "--device: a catalogued device or (--executor ray)"),
    ],
)
def test_plan_refuses_an_executor_it_cannot_plan_for_before_reaching_any_cluster(tmp_path, args, expected):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    result = runner.invoke(app, ["plan", str(path), "--storage", f"sqlite:///{tmp_path}/t.db", *args])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split()) and "Traceback" not in result.output


def test_plan_for_a_device_family_this_machine_lacks_names_the_field_once_and_the_way_out(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "hardware": {**GOOD["hardware"], "device": "cuda"}}))
    result = runner.invoke(app, ["plan", str(path), "--storage", f"sqlite:///{tmp_path}/t.db"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "hardware.device: cuda requested but not available on this machine (available: cpu)" in said
    assert said.count("hardware.device:") == 1 and "--executor ray" in said and "Traceback" not in said


def _takes_executor(path) -> bool:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return any("--executor" in p.opts for p in command.params)


EXECUTOR_COMMANDS = [p for p in ALL_COMMANDS if _takes_executor(p)]


@pytest.mark.parametrize("path", EXECUTOR_COMMANDS, ids=[" ".join(p) for p in EXECUTOR_COMMANDS])
def test_every_command_that_takes_an_executor_refuses_an_unknown_one_in_the_same_words(tmp_path, path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(GOOD))
    # The commands with a RECIPE or folder argument get the recipe; serve and worker take none.
    args = [str(recipe)] if path[0] not in ("serve", "worker") else []
    env = {"TUNER_DATABASE_URL": f"sqlite:///{tmp_path}/t.db", "TUNER_ARTIFACT_DIR": str(tmp_path / "b")}
    result = runner.invoke(app, [*path, *args, "--executor", "slurm"], env=env)
    assert result.exit_code == 2, result.output
    assert "--executor: unknown executor 'slurm'; use local or ray" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_the_executor_variable_is_refused_in_the_same_words(tmp_path):
    env = {"TUNER_DATABASE_URL": f"sqlite:///{tmp_path}/t.db", "TUNER_EXECUTOR": "slurm"}
    result = runner.invoke(app, ["worker"], env=env)
    assert result.exit_code == 2, result.output
    assert "TUNER_EXECUTOR: unknown executor 'slurm'; use local or ray" in " ".join(result.output.split())


def test_measure_help_lists_every_knob_set_can_change():
    from tuner.cli.measure import HELP
    from tuner.config import KNOBS

    listed = HELP.split("Knobs: ", 1)[1].split(". ", 1)[0].split(", ")
    assert listed == list(KNOBS)


def test_plan_names_the_override_and_the_device_count_that_fits(tmp_path):
    """`tuner plan` words the same checks as POST /v1/plans for its own user: the exact override
    (and the space's file to edit, on this machine), and a device count no split fits."""

    doc = yaml.safe_load((Path(__file__).resolve().parent.parent / "recipes" / "gpt-tiny.yaml").read_text())
    doc["hardware"]["device"] = "cpu"
    doc["search"]["overrides"] = {"bucket_mb": [7]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(doc))
    storage = f"sqlite:///{tmp_path}/t.db"
    result = runner.invoke(
        app, ["plan", str(tmp_path / "r.yaml"), "--storage", storage], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 2 and "search.overrides.bucket_mb: 7 is not in the cpu space" in result.output
    assert "(or edit " in result.output and "Traceback" not in result.output
    doc["search"]["overrides"] = {}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(doc))
    args = ["plan", str(tmp_path / "r.yaml"), "--storage", storage, "--devices", "3"]
    result = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "devices: no split of 3 devices fits the model and batch" in result.output
    assert "e.g. --devices 2" in result.output


@pytest.mark.parametrize("command", ["tune", "plan", "nightly"])
def test_an_infinite_or_unknown_space_value_is_refused_before_anything_runs(tmp_path, monkeypatch, command):
    """What the REST service refuses on submit (422), every command that tunes refuses first, in
    one line: the nightly folder too, before the recipes ahead of it spend their night."""
    monkeypatch.chdir(tmp_path)
    for name, search, says in [
        ("inf", {"overrides": {"tp": [float("inf")]}}, "search.overrides.tp: tp: inf is not an integer"),
        ("space", {"space": "nosuch"}, "search space 'nosuch' not found"),
    ]:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**GOOD, "search": search}))
        result = runner.invoke(app, COMMANDS[command](str(path)))
        assert result.exit_code == 2, result.output
        assert says in _one_line(result.output)
