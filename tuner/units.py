"""Durations in the units a person reads them in, to two significant digits (`3.1 min`, `45 s`,
`2.0 h`, `1.5 days`): what the CLI and reports print for search cost and payback."""

from __future__ import annotations

import math

_UNITS = ((86400.0, "days"), (3600.0, "h"), (60.0, "min"), (1.0, "s"))


def two_significant(value: float) -> str:
    """`value` rounded to two significant digits, without an exponent: 3.14 -> 3.1, 123 -> 120."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    rounded = float(f"{value:.2g}")  # may carry into the next power of ten: 0.9995 -> 1.0
    digits = 1 - math.floor(math.log10(abs(rounded)))
    return f"{rounded:.{max(0, digits)}f}"


def human_duration(seconds: float) -> str:
    """`seconds` in the largest unit (s, min, h, days) that keeps the number at 1 or more."""
    if seconds < 0 or not math.isfinite(seconds):
        raise ValueError(f"a duration must be a finite number of seconds >= 0, got {seconds}")
    if seconds < 1:
        return f"{two_significant(seconds)} s" if seconds else "0 s"
    for i, (size, unit) in enumerate(_UNITS):
        if seconds >= size:
            text = two_significant(seconds / size)
            if i > 0 and float(text) * size >= _UNITS[i - 1][0]:
                # Rounding carried into the next unit (59.97 s -> "60 s"): say "1.0 min" instead.
                size, unit = _UNITS[i - 1]
                text = two_significant(seconds / size)
            return f"{text} {unit}"
    raise AssertionError("unreachable: seconds >= 1 matches the unit 's'")
