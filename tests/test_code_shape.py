"""The code stays in rooms small enough to change safely (STYLE.md): no source file of the engine
or the service over 450 lines, no function body over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(
    p for d in ("tuner", "api") for p in (ROOT / d).rglob("*.py") if "migrations/versions" not in p.as_posix()
)
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body, its docstring left out (a docstring explains, it does not do)."""
    body = fn.body
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        body = body[1:]
    if not body:
        return 0
    return body[-1].end_lineno - body[0].lineno + 1


@pytest.mark.parametrize("path", SOURCES, ids=[p.relative_to(ROOT).as_posix() for p in SOURCES])
def test_file_and_function_sizes(path):
    text = path.read_text()
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines <= MAX_FILE_LINES, f"{path.relative_to(ROOT)}: {lines} lines; split it by responsibility"
    long = [
        f"{fn.name} (line {fn.lineno}): {n} lines"
        for fn in _functions(ast.parse(text))
        if (n := body_lines(fn)) > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(ROOT)}: function bodies over {MAX_FUNCTION_LINES} lines: {long}"
