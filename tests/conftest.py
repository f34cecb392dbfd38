"""Suite-wide settings for trial processes (inherited by every rank, launcher and Ray worker)."""

import os
from pathlib import Path

import pytest

# A trial measures until its step-time interval is tight or measure.max_seconds (20 s) passes; on a
# loaded test machine most tiny test trials would run the full 20 s. Tests of the adaptive stop
# itself set their own limits.
os.environ.setdefault("TUNER_TEST_MEASURE_MAX_S", "1")


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium through Playwright, one per test module that asks (tests/chromium.py)."""
    from chromium import ARGS, CHROMIUM

    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's Chromium: apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()
