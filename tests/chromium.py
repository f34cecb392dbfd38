"""Debian's Chromium for the browser tests (`apt-get install chromium`, never a test tool's own
download): where it is, how it is started, and the mark for tests that need it. The `browser`
fixture itself is in conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
NEEDS_CHROMIUM = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="needs Debian's Chromium: apt-get install -y chromium"
)
