"""Suite-wide settings for trial processes (inherited by every rank, launcher and Ray worker)."""

import os
import sys
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


# The suite's own process ends without the interpreter's teardown once pytest has written its
# summary and exit status. One CI run (2026-12-05, 1,559 passed) ended in a segfault there, after
# the last test: the process holds torch's and transformers' models, gloo groups and Ray driver
# threads from hundreds of tests, and their C++ destructors ran in an order nobody chose. The
# product's processes do the same (ranks `os._exit` once their result is written).
# TUNER_TEST_FULL_TEARDOWN=1 keeps the teardown, to look for that crash.
_SESSION: dict[str, int] = {}


def pytest_sessionfinish(session, exitstatus):
    _SESSION["exitstatus"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if "exitstatus" in _SESSION and os.environ.get("TUNER_TEST_FULL_TEARDOWN") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_SESSION["exitstatus"])
