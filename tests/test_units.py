"""Durations printed for people: two significant digits in the unit that reads naturally."""

import pytest

from tuner.units import human_duration, two_significant


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 s"),
        (0.5, "0.50 s"),
        (45, "45 s"),
        (59.97, "1.0 min"),  # rounding carries into the next unit
        (186, "3.1 min"),
        (5400, "1.5 h"),
        (3 * 86400, "3.0 days"),
    ],
)
def test_human_duration(seconds, text):
    assert human_duration(seconds) == text


def test_a_tiny_payback_is_not_zero():
    """A 10x speedup that pays for a 2-minute search within seconds of training says so."""
    assert human_duration(0.0012 * 3600) == "4.3 s"


@pytest.mark.parametrize(
    ("value", "text"), [(3.14159, "3.1"), (123, "120"), (0.0999, "0.10"), (99.96, "100")]
)
def test_two_significant(value, text):
    assert two_significant(value) == text


def test_negative_durations_are_refused():
    with pytest.raises(ValueError, match="finite number of seconds"):
        human_duration(-1)


def test_tune_and_show_print_search_cost_and_payback_in_human_units():
    """What `tuner tune` and `tuner show` print (a 10x speedup once printed `after 0.00 h`)."""
    from rich.console import Console

    from tuner.cli.tune import _print_cost
    from tuner.summary import StudySummary

    summary = StudySummary("s", "sqlite://", speedup=10.0, payback_hours=0.0012)
    summary.device_seconds = {"ok": 150.0, "oom": 36.0, "total": 186.0}
    out = Console(record=True, width=200)
    _print_cost(out, summary)
    text = out.export_text()
    assert "search cost: 3.1 min of device time (ok 2.5 min, oom 36 s)" in text
    assert "pays for itself after 4.3 s of training" in text and " h " not in text
