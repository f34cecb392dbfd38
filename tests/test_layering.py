"""The layering of DESIGN.md, enforced: a trial rank (`tuner.workload`) loads none of Optuna,
SQLAlchemy, FastAPI or Ray, and the engine (`tuner/` outside the CLI) imports nothing from the
service (`api/`)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_IN_RANKS = ("optuna", "sqlalchemy", "fastapi", "ray", "starlette", "uvicorn", "alembic", "psycopg")

# What a rank process imports: the rank entry point, the training and the build rank.
RANK_MODULES = (
    "tuner.workload",
    "tuner.workload.__main__",
    "tuner.workload.run",
    "tuner.workload.build_rank",
)


@pytest.mark.parametrize("module", RANK_MODULES)
def test_a_trial_rank_loads_no_service_or_search_library(module):
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        "import tuner.workload.train, tuner.workload.model, tuner.workload.apply\n"
        "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert not loaded & set(FORBIDDEN_IN_RANKS), f"{module} loads {sorted(loaded & set(FORBIDDEN_IN_RANKS))}"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


ENGINE = sorted(p for p in (ROOT / "tuner").rglob("*.py") if "cli" not in p.relative_to(ROOT / "tuner").parts)


@pytest.mark.parametrize("path", ENGINE, ids=[p.relative_to(ROOT).as_posix() for p in ENGINE])
def test_the_engine_imports_nothing_from_the_service(path):
    service = sorted(n for n in _imports(path) if n == "api" or n.startswith("api."))
    assert not service, f"{path.relative_to(ROOT)} imports {service}: the engine must not depend on api/"


WORKLOAD = sorted((ROOT / "tuner" / "workload").rglob("*.py"))


@pytest.mark.parametrize("path", WORKLOAD, ids=[p.relative_to(ROOT).as_posix() for p in WORKLOAD])
def test_workload_sources_never_name_the_forbidden_libraries(path):
    """Even an import inside a function would load them in a rank."""
    named = sorted(n for n in _imports(path) if n.split(".")[0] in FORBIDDEN_IN_RANKS)
    assert not named, f"{path.relative_to(ROOT)} imports {named}"
