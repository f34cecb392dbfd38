"""`benchmarks/make_table.py`, the tabular benchmark's measuring script: its shuffled passes, its
confirmation of the fastest configs, and what a resumed table keeps (its runs, its record of the machine, its order).
The resume test measures real trials of the committed table recipe."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tuner.config import Config
from tuner.result import TrialResult

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from make_table import _aggregate, _schedule, confirm_targets, main, read_table  # noqa: E402


def _row(key, runs, status="ok"):
    return {
        "key": key,
        "status": status,
        "runs": str(len(runs)),
        "tokens_per_s_runs": ";".join(map(str, runs)),
    }


def test_each_repeat_runs_as_a_pass_in_its_own_order_unless_listed():
    todo = [(i, f"c{i}") for i in range(20)]
    shuffled = _schedule(todo, 2, listed=False, seed=0)
    first, second = ([i for rep, i, _ in shuffled if rep == r] for r in (0, 1))
    assert [rep for rep, _, _ in shuffled] == [0] * 20 + [1] * 20  # one pass, then the other
    assert sorted(first) == sorted(second) == list(range(20)) and first != second != list(range(20))
    assert _schedule(todo, 2, listed=False, seed=0) == shuffled  # the seed makes it reproducible
    listed = _schedule(todo, 2, listed=True, seed=0)
    assert [(rep, i) for rep, i, _ in listed] == [(r, i) for i in range(20) for r in (0, 1)]


def test_the_fastest_by_their_first_runs_are_confirmed_and_a_resumed_confirmation_picks_the_same():
    """The fastest configs by their first `--repeats` runs (not by a mean the confirmation already
    moved) get the more runs: a config fast by two lucky runs is still the one being confirmed
    after its new runs sank it."""
    rows = [_row("lucky", [19000, 19500]), _row("steady", [15000, 15100]), _row("slow", [9000, 9100])]
    rows.append(_row("oom", [], status="oom"))
    assert confirm_targets(rows, 2, 2, 3) == {"lucky": 3, "steady": 3}
    rows[0] = _row("lucky", [19000, 19500, 13000, 13200, 12900])
    rows[1] = _row("steady", [15000, 15100, 15050])
    assert confirm_targets(rows, 2, 2, 3) == {"steady": 2}


def _earlier(config: Config) -> dict:
    return {
        **_row(config.key(), [19000.0, 19500.0]),
        "step_time_s": "0.10",
        "step_time_spread": "0.2",
        "wall_s": "4.0",
        "peak_mem_allocated_bytes": "1000",
        "peak_mem_reserved_bytes": "2000",
        "mfu": "0.3",
        "loss": "7.6",
        "error": "",
    }


def test_a_confirmed_row_holds_every_run_and_a_failed_confirmation_run_does_not_unseat_it():
    config = Config(micro_batch_size=2, dp=2)
    new = [
        TrialResult(
            "ok", step_time_s=t, step_time_spread=0.1, tokens_per_s=v, wall_s=2.0, peak_mem_allocated_bytes=m
        )
        for t, v, m in ((0.14, 13000.0, 1500), (0.15, 13200.0, 900), (0.15, 12900.0, 800))
    ]
    merged = _aggregate(config, new, 1234, _earlier(config), confirming=True)
    assert merged["runs"] == 5 and merged["status"] == "ok"
    assert merged["tokens_per_s_runs"] == "19000.0;19500.0;13000.0;13200.0;12900.0"
    assert merged["tokens_per_s"] == pytest.approx(15520.0)
    assert merged["step_time_s"] == pytest.approx(0.145) and merged["wall_s"] == pytest.approx(2.5)
    assert merged["peak_mem_allocated_bytes"] == 1500 and merged["peak_mem_reserved_bytes"] == 2000
    assert merged["mfu"] == pytest.approx(0.3) and merged["loss"] == "7.6"

    timeout = TrialResult("timeout", wall_s=120.0, error="no step in 120 s")
    kept = _aggregate(config, [new[0], timeout], 1234, _earlier(config), confirming=True)
    assert kept["status"] == "ok" and kept["runs"] == 4
    assert kept["tokens_per_s"] == pytest.approx((19000 + 19500 + 13000) / 3)
    assert kept["error"] == "1 of 2 confirmation runs failed: timeout: no step in 120 s"
    # The same failure in a table's own passes marks the row, as it always did.
    failed = _aggregate(config, [timeout], 1234, _earlier(config))
    assert (
        failed["status"] == "timeout"
        and failed["tokens_per_s"] == ""
        and failed["error"] == "no step in 120 s"
    )


@pytest.mark.parametrize("value", ["--confirm-top=-1", "--confirm-runs=0", "--repeats=0"])
def test_counts_below_their_least_are_usage_errors(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                str(ROOT / "benchmarks" / "recipes" / "gpt-tiny-table.yaml"),
                "--out",
                str(tmp_path / "t.csv"),
                value,
            ]
        )
    assert exit_.value.code == 2
    name = value.split("=")[0]
    assert f"argument {name}: must be at least" in capsys.readouterr().err
    assert not (tmp_path / "t.csv").exists()


def test_a_resumed_table_runs_only_the_passes_it_missed_and_keeps_its_machine_and_order(
    tmp_path, monkeypatch
):
    """Interrupted after its first pass, a table resumes with the second pass only; the runs it
    had stay in it, and so do its record of the machine (the priors its figures are judged with)
    and of how it was measured. Then the fastest config is confirmed, and the order says so."""
    monkeypatch.chdir(tmp_path)
    recipe = str(ROOT / "benchmarks" / "recipes" / "gpt-tiny-table.yaml")
    table = tmp_path / "t.csv"
    assert main([recipe, "--out", str(table), "--limit", "2", "--repeats", "1"]) == 0
    text = table.read_text()
    header, first = read_table(table)
    recorded = '{"bf16": 2.0, "fp16": 1.0, "fp32": 1.0}'  # the measuring machine's, not this one's
    table.write_text(text.replace(f"# peak_flops: {header['peak_flops']}", f"# peak_flops: {recorded}"))

    assert main([recipe, "--out", str(table), "--limit", "2", "--repeats", "2"]) == 0
    header, rows = read_table(table)
    assert header["peak_flops"] == recorded and header["order"] == "shuffled passes, seed 0"
    assert [r["runs"] for r in rows] == ["2", "2"]
    for before, after in zip(first, rows, strict=True):
        assert after["tokens_per_s_runs"].startswith(before["tokens_per_s_runs"] + ";")

    assert (
        main(
            [
                recipe,
                "--out",
                str(table),
                "--limit",
                "2",
                "--repeats",
                "2",
                "--confirm-top",
                "1",
                "--confirm-runs",
                "1",
            ]
        )
        == 0
    )
    header, confirmed = read_table(table)
    assert header["peak_flops"] == recorded and json.loads(header["fingerprint"])["family"] == "cpu"
    assert header["order"] == (
        "shuffled passes, seed 0; the 1 fastest by their first 2 runs confirmed by 1 more each, shuffled passes, seed 1"
    )
    fastest = max(rows, key=lambda r: float(r["tokens_per_s"]))
    assert {r["key"]: r["runs"] for r in confirmed} == {r["key"]: "3" if r is fastest else "2" for r in rows}
    # Run again without --confirm-top, nothing is measured and the order keeps the confirmation.
    assert main([recipe, "--out", str(table), "--limit", "2", "--repeats", "2"]) == 0
    assert read_table(table)[0]["order"] == header["order"]
