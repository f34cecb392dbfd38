"""The docker-compose deployment, checked without a Docker engine: the file parses, every service
runs a real `tuner` or `ray` command, settings are documented and no secret is baked in."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tuner.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"db", "migrate", "api", "worker", "ray-head", "ray-worker", "ray-worker-gpu", "nightly"}
_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::?([-?])([^}]*))?\}")


def load_compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} substitution, and $$ -> $."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.groups()
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"{name} must be set: {arg}")
        return arg if op == "-" else ""

    return _VAR.sub(sub, text).replace("$$", "$")


def commands(env: dict[str, str]) -> dict[str, list[str]]:
    """Each service's command after interpolation (services without one use their image's)."""
    out = {}
    for name, svc in load_compose()["services"].items():
        if "command" in svc:
            out[name] = [interpolate(str(a), env) for a in svc["command"]]
    return out


def env_example() -> dict[str, str]:
    values = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        m = re.match(r"^#?\s*([A-Z][A-Z0-9_]+)=(\S*)", line)
        if m:
            values.setdefault(m.group(1), m.group(2))
    return values


def test_compose_declares_every_service_and_postgres_is_checked_and_kept():
    compose = load_compose()
    assert set(compose["services"]) == SERVICES
    db = compose["services"]["db"]
    assert db["image"] == "postgres:16"
    assert "pg_isready" in " ".join(db["healthcheck"]["test"])
    assert any(v.endswith(":/var/lib/postgresql/data") for v in db["volumes"])
    migrate = compose["services"]["migrate"]
    assert migrate["depends_on"]["db"]["condition"] == "service_healthy"
    for svc in ("api", "worker", "nightly"):
        assert (
            compose["services"][svc]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        )
    gpu = compose["services"]["ray-worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert "/dev/davinci" in (ROOT / "docker-compose.yml").read_text()


def test_every_service_runs_a_real_command_with_real_options():
    cmds = commands(env_example())
    assert set(cmds) == SERVICES - {"db"}
    for name, argv in cmds.items():
        # --help is eager, but click parses every option first: a misspelled option still fails.
        if argv[0] == "tuner":
            result = CliRunner().invoke(app, [*argv[1:], "--help"])
            assert result.exit_code == 0, f"{name}: {' '.join(argv)}\n{result.output}"
        else:
            assert argv[0] == "ray", f"{name}: {argv[0]} is neither tuner nor ray"
            ray = shutil.which("ray") or str(Path(__import__("sys").executable).parent / "ray")
            done = subprocess.run([ray, *argv[1:], "--help"], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{name}: {' '.join(argv)}\n{done.stderr[-2000:]}"


def test_every_setting_is_in_env_example_and_no_secret_is_baked_in():
    documented = env_example()
    compose_text = (ROOT / "docker-compose.yml").read_text()
    used = {m.group(1) for m in _VAR.finditer(compose_text)}
    settings_text = (ROOT / "tuner" / "settings.py").read_text()  # every setting is read there
    read_by_service = set(re.findall(r'"(TUNER_[A-Z_]+|RAY_ADDRESS)"', settings_text))
    missing = (used | read_by_service | {"TUNER_DATABASE_URL", "TUNER_API_TOKEN"}) - set(documented)
    assert not missing, f"add these to .env.example: {sorted(missing)}"

    # One image for all services: CPU torch by default, a build arg for a CUDA one.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    assert "-c constraints/cpu.txt" in dockerfile
    assert load_compose()["x-tuner"]["build"]["args"]["TORCH_INDEX_URL"].startswith("${TORCH_INDEX_URL")

    # The password is required from .env, never defaulted in the compose file or the image.
    assert "${POSTGRES_PASSWORD:?" in compose_text and "${RAY_AUTH_TOKEN:?" in compose_text
    assert not re.search(r"(?i)^\s*(ENV|ARG)\s+\S*(PASSWORD|TOKEN|SECRET)", dockerfile, re.M)
    assert ".env" in (ROOT / ".dockerignore").read_text().split()
    with pytest.raises(KeyError, match="POSTGRES_PASSWORD"):
        interpolate(compose_text, {})
