"""Two real nightly runs on CPU (tiny recipe, real trials, SQLite history): the second night starts
from the first night's best, and an injected per-step slowdown is reported as a regression."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import optuna
import pytest
from sqlalchemy import select

from tuner.db import NightlyResult, session_scope

pytestmark = pytest.mark.slow

RECIPE = """\
name: nightly-tiny
model: {family: gpt, layers: 2, hidden: 64, heads: 4, seq_len: 32, vocab: 256}
train: {global_batch_size: 8}
hardware: {device: cpu, devices: 1}
search: {trials: 30, timeout_min: 10}
measure: {warmup_steps: 1, steps: 3, timeout_s: 120}
"""


def nightly(tmp_path, night: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tuner.cli.main", "nightly", str(tmp_path / "recipes"), "--local"]
    cmd += ["--trials", "2", "--remeasure", "0", "--night", night, "--report", str(tmp_path / "reports")]
    base = {k: v for k, v in os.environ.items() if k != "TUNER_TEST_STEP_DELAY_S"}
    base["TUNER_DATABASE_URL"] = f"sqlite:///{tmp_path}/tuner.db"
    return subprocess.run(cmd, cwd=tmp_path, env={**base, **env}, capture_output=True, text=True, timeout=300)


def test_second_night_starts_from_the_first_best_and_reports_a_slowdown(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "tiny.yaml").write_text(RECIPE)
    url = f"sqlite:///{tmp_path}/tuner.db"

    first = nightly(tmp_path, "2026-11-27")
    assert first.returncode == 0, first.stderr
    assert "nightly-tiny: first run, best" in first.stderr
    with session_scope(url) as s:
        night1 = s.scalar(select(NightlyResult))
        best1, config1 = night1.best_tokens_per_s, night1.config
    assert night1.verdict == "first_run" and config1["micro_batch_size"] >= 1
    assert best1 > 200, f"night 1 measured {best1:.0f} tokens/s: too slow to see the slowdown below"

    # 1.5 s per step caps tonight at 256 tokens / 1.5 s = 171 tokens/s, far below what night 1
    # measures even on a busy 2-core machine (a step of this recipe takes well under a second).
    second = nightly(tmp_path, "2026-11-28", TUNER_TEST_STEP_DELAY_S="1.5")
    assert second.returncode == 1, second.stderr
    assert "nightly-tiny: REGRESSION" in second.stderr

    # Tonight's first trial re-measured last night's best config, marked as such.
    report = json.loads((tmp_path / "reports" / "nightly-2026-11-28.json").read_text())
    line = report["recipes"][0]
    study = optuna.load_study(study_name=line["study_name"], storage=url)
    first_trial, second_trial = sorted(study.trials, key=lambda t: t.number)[:2]
    assert first_trial.user_attrs["role"] == "previous_best"
    assert second_trial.user_attrs["role"] == "previous_top"  # last night's runner-up
    assert {k: first_trial.params[k] for k in config1} == config1
    # ...and the same config is now slower: the machine regressed, not the search.
    assert line["remeasured_previous_tokens_per_s"] < best1 * 0.95

    assert line["verdict"] == "regression" and line["change_pct"] < -5
    assert line["previous_best_tokens_per_s"] == pytest.approx(best1)
    assert report["exit_code"] == 1 and report["verdicts"]["regression"] == ["nightly-tiny"]
    md = (tmp_path / "reports" / "nightly-2026-11-28.md").read_text()
    assert "**REGRESSION**" in md and "2026-11-27" in md
    with session_scope(url) as s:
        rows = s.scalars(select(NightlyResult).order_by(NightlyResult.night)).all()
        assert [r.verdict for r in rows] == ["first_run", "regression"]
