"""The benchmark scripts refuse a recipe or table they cannot read with a usage error that names the
argument and the reason (exit 2), before any setup, not with a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each script's command line, with {} where the recipe or table goes.
RECIPE_SCRIPTS = [
    ["amp_priors.py", "{}"],
    ["cuda_measure.py", "{}", "--dry-run", "NVIDIA H100 80GB HBM3"],
    ["executor_overhead.py", "{}"],
    ["live_tune.py", "{}"],
    ["make_table.py", "{}", "--out", "table.csv"],
    ["measurement.py", "repeat", "{}"],
    ["measurement.py", "pair", "{}"],
    ["measurement.py", "studies", "{}"],
    ["measurement_gap.py", "{}"],
    ["perf_extrapolate.py", "{}"],
    ["trial_phases.py", "{}"],
]
TABLE_SCRIPTS = [["perf_model_eval.py", "{}"], ["replay.py", "{}"]]


def _run(script: list[str], arg: str, cwd: Path) -> subprocess.CompletedProcess:
    name, *rest = script
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *(arg if a == "{}" else a for a in rest)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", RECIPE_SCRIPTS, ids=lambda s: " ".join(a for a in s[:2] if a != "{}"))
def test_a_missing_recipe_is_a_usage_error_naming_it(script, tmp_path):
    out = _run(script, "missing.yaml", tmp_path)
    assert out.returncode == 2, out.stderr
    assert "argument recipe: missing.yaml: cannot read recipe file" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "table.csv").exists()


@pytest.mark.parametrize("script", TABLE_SCRIPTS, ids=lambda s: s[0])
def test_a_file_that_is_not_a_table_is_a_usage_error_naming_it(script, tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n1,2\n")
    for arg, reason in (("missing.csv", "cannot read the table"), ("notes.csv", "not a table written by")):
        out = _run(script, arg, tmp_path)
        assert out.returncode == 2, out.stderr
        assert f"argument table: {arg}: {reason}" in out.stderr
        assert "Traceback" not in out.stderr
