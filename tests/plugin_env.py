"""The test plugin package (tests/plugins/tuner-test-plugin, plugin `tiny-moe`) installed into the
test environment the way an operator installs one: pip, editable here."""

from __future__ import annotations

import importlib
import site
import subprocess
import sys
import sysconfig
from importlib.metadata import entry_points
from pathlib import Path

PACKAGE = Path(__file__).parent / "plugins" / "tuner-test-plugin"


def install_test_plugin() -> None:
    """pip-install the test plugin unless it is installed; this process (and every process it
    starts) then finds its entry point."""
    if any(ep.name == "tiny-moe" for ep in entry_points(group="tuner.models")):
        return
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(PACKAGE),
        ],
        check=True,
    )
    # An editable install takes effect through a .pth file, which Python reads at start-up: read
    # it now, so this process imports the plugin as a freshly started one would.
    importlib.invalidate_caches()
    site.addsitedir(sysconfig.get_paths()["purelib"])
    from tuner.models import plugins

    plugins.installed.cache_clear()
