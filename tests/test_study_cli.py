"""`tuner tune` and `tuner show` from the outside: bad input exits 2 naming the field, and `show`
reports what a study found (a study made with the in-test executor of tests/test_study.py)."""

from __future__ import annotations

import contextlib
import json

import pytest
import yaml
from test_study import NARROW, FakeExecutor, make_recipe
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.study import run_study

runner = CliRunner()


def write_recipe(tmp_path, **changes) -> str:
    doc = {
        "name": "cli",
        "model": {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 2048},
        "hardware": {"device": "cpu", "devices": 2},
    }
    doc.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize(
    ("args", "changes", "expected"),
    [
        (["--sampler", "annealing"], {}, "--sampler: unknown sampler 'annealing'"),
        (["--trials", "0"], {}, "--trials: must be from 1 to 100,000"),
        (["--trials", "999999999"], {}, "--trials: must be from 1 to 100,000, got 999,999,999"),
        (["--top", "0"], {}, "--top: must be at least 1"),
        (["--timeout-min", "-1"], {}, "--timeout-min: must be a positive number"),
        (["--executor", "slurm"], {}, "--executor: unknown executor 'slurm'"),
        (["--storage", "nosuchdb://x"], {}, "--storage: 'nosuchdb://x' is not a database URL"),
        ([], {"search": {"overrides": {"recompute": ["sometimes"]}}}, "search.overrides.recompute"),
        ([], {"search": {"space": "tpu"}}, "search space 'tpu' not found"),
        (
            [],
            {"hardware": {"device": "cpu", "devices": 4096}},
            "hardware.devices is 4096 but this machine has",
        ),
        (["--sampler", "cmaes"], {"search": {"objective": "throughput_memory"}}, "search.sampler: cmaes"),
    ],
)
def test_tune_rejects_bad_input_with_exit_2_and_the_field(tmp_path, args, changes, expected):
    result = runner.invoke(app, ["tune", write_recipe(tmp_path, **changes), *args])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["tune", "show", "plan"])
def test_another_programs_database_is_refused_and_left_as_it_was(tmp_path, command):
    """`--storage sqlite:///mlflow.db` (another program's, with its own alembic_version): Optuna
    added its 11 tables beside the other program's, then stopped with a traceback suggesting to
    update Optuna. Refused before anything in it changes (its journal mode included)."""
    import sqlite3

    path = tmp_path / "mlflow.db"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript("create table alembic_version (version_num varchar(32) primary key);"
                         "insert into alembic_version values ('0584bdc529eb'); create table experiments (id int);")  # fmt: skip
        db.commit()
    before = path.read_bytes()
    result = runner.invoke(app, [command, write_recipe(tmp_path), "--storage", f"sqlite:///{path}"])
    assert result.exit_code == 2, result.output
    assert "holds another program's tables (alembic_version, experiments)" in " ".join(result.output.split())
    assert path.read_bytes() == before and "Traceback" not in result.output


def test_a_recipe_over_several_nodes_is_checked_per_node_not_against_this_machine_alone(tmp_path):
    """`tuner tune --executor ray` with `hardware.nodes`: each node holds its share of the devices, so
    a recipe whose total is more than this machine has passes when each node's share fits (it used
    to be refused as if one machine had to hold them all), and one whose share does not is refused
    naming the share per node. (Nodes like this machine; a real cluster's own description:
    `test_ray_cluster.py`.)"""
    from tuner.devices import describe
    from tuner.executors.base import Executor
    from tuner.recipe import load_recipe
    from tuner.study.preflight import PreflightError, preflight

    class Nodes(Executor):
        """Describes this machine, as the Ray executor does a cluster of nodes like it; runs nothing."""

        def __init__(self, name: str):
            self.name = name

        def free_slots(self, spec):
            raise NotImplementedError

        submit = wait = running = cancel = free_slots

    have = describe("cpu").count
    doc = {
        "hardware": {"device": "cpu", "devices": 2 * have, "nodes": 2},
        "train": {"global_batch_size": 16 * have},
    }
    # Each node: this machine's count.
    preflight(load_recipe(write_recipe(tmp_path, **doc)), "model", Nodes("ray"))
    with pytest.raises(PreflightError, match="needs the Ray executor"):
        preflight(load_recipe(write_recipe(tmp_path, **doc)), "model", Nodes("local"))

    doc["hardware"]["devices"] = 4 * have
    with pytest.raises(PreflightError) as err:
        preflight(load_recipe(write_recipe(tmp_path, **doc)), "model", Nodes("ray"))
    assert f"over 2 nodes, {2 * have} per node, but this machine has {have} cpu devices" in str(err.value)
    result = runner.invoke(app, ["tune", write_recipe(tmp_path, **doc), "--executor", "local"])
    assert result.exit_code == 2 and "Ray" in result.output  # the local executor runs one node only


def test_show_without_a_study_says_to_run_tune_first(tmp_path):
    result = runner.invoke(app, ["show", write_recipe(tmp_path), "--storage", f"sqlite:///{tmp_path}/x.db"])
    assert result.exit_code == 2
    assert "run `tuner tune" in " ".join(result.output.split())


def test_show_reports_best_speedup_top_k_and_cost(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/t.db"
    recipe = make_recipe("cli-show", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]})
    run_study(recipe, storage_url=url, executor=FakeExecutor(), trials=4, sampler="grid", workdir=tmp_path)
    path = tmp_path / "show.yaml"
    path.write_text(yaml.safe_dump(recipe.to_dict()))

    result = runner.invoke(app, ["show", str(path), "--storage", url, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["best"]["config"]["micro_batch_size"] == 8  # the fake is fastest at the biggest batch
    assert summary["speedup"] == pytest.approx(1.0)  # ... which is also the baseline
    assert summary["counts"] == {"ok": 4} and len(summary["top_k"]) == 4

    table = runner.invoke(app, ["show", str(path), "--storage", url, "--top", "2"])
    assert table.exit_code == 0
    text = " ".join(table.output.split())
    assert (
        "best config" in text
        and "speedup over the baseline" in text
        and "search cost" in text
        and "of device time" in text
    )
    assert "top 2 configs" in text


def test_show_reads_the_database_only_and_makes_none(tmp_path, monkeypatch):
    """Its help says it reads the database only; with no tuner.db here it created an empty one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
    recipe = write_recipe(tmp_path)
    result = runner.invoke(app, ["show", recipe])
    assert result.exit_code == 2 and "no study" in result.output and "run `tuner tune" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]
    missing = tmp_path / "none.db"
    result = runner.invoke(app, ["show", recipe, "--storage", f"sqlite:///{missing}"])
    assert result.exit_code == 2 and "no study" in result.output and not missing.exists()


def test_plan_reads_the_database_only_and_makes_none(tmp_path, monkeypatch):
    """A plan spends nothing and stores nothing: with no database yet it planned from the priors
    and left an empty tuner.db behind (at the default path or a --storage one)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
    recipe = write_recipe(tmp_path)
    result = runner.invoke(app, ["plan", recipe, "--top", "2"])
    assert result.exit_code == 0 and "configs ranked; device-table priors only" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]
    missing = tmp_path / "none.db"
    result = runner.invoke(app, ["plan", recipe, "--top", "2", "--storage", f"sqlite:///{missing}"])
    assert result.exit_code == 0 and not missing.exists()


def test_a_plan_with_nothing_to_rank_says_why(tmp_path, monkeypatch):
    """It said "0 feasible configs ranked" and nothing else: the user could not tell the memory
    budget from the shapes from the device count."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
    path = tmp_path / "tight.yaml"
    path.write_text(
        "name: tight\nmodel: {family: gpt, layers: 4, hidden: 128, heads: 4, seq_len: 128, vocab: 2048}\n"
        "hardware: {device: cpu, devices: 2, memory_budget_gb: 0.01}\n"
    )
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 0 and "0 feasible configs ranked" in result.output
    assert (
        "nothing to rank: even the config with the smallest estimated peak is refused: predicted out of memory"
        in (result.output.replace("\n", " "))
    )
    doc = json.loads(runner.invoke(app, ["plan", str(path), "--json"]).output)
    assert doc["considered"] == 0 and "exceeds the 0.010 GiB budget" in doc["why_none"]


def test_show_refuses_a_study_of_another_recipe(tmp_path):
    """`tuner show llama.yaml --study <gpt's study>` showed the gpt study under the llama recipe."""
    url = f"sqlite:///{tmp_path}/t.db"
    recipe = make_recipe("cli-show-other", overrides={**NARROW, "micro_batch_size": [1, 2]})
    summary = run_study(
        recipe, storage_url=url, executor=FakeExecutor(), trials=2, sampler="grid", workdir=tmp_path
    )
    same, other = tmp_path / "same.yaml", tmp_path / "other.yaml"
    same.write_text(
        yaml.safe_dump({**recipe.to_dict(), "name": "renamed"})
    )  # the name is not what it measures
    doc = recipe.to_dict()
    other.write_text(yaml.safe_dump({**doc, "model": {**doc["model"], "layers": 2}}))
    ok = runner.invoke(app, ["show", str(same), "--storage", url, "--study", summary.study_name, "--json"])
    assert ok.exit_code == 0 and json.loads(ok.output)["study_name"] == summary.study_name
    refused = runner.invoke(app, ["show", str(other), "--storage", url, "--study", summary.study_name])
    assert refused.exit_code == 2 and "measured another recipe than" in " ".join(refused.output.split())
