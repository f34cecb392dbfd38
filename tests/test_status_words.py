"""A trial's status words are spelled once, in `tuner.record.status` (issue 14): code that compares
a status, builds a trial record or asks for trials by status uses its constants, never the bare
word, so renaming or adding a status cannot miss a file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tuner.record.status import STATES, STATUSES

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / "tuner" / "record" / "status.py"
SOURCES = sorted(
    p
    for d in ("tuner", "api")
    for p in (ROOT / d).rglob("*.py")
    if "migrations/versions" not in p.as_posix() and p != HOME
)
WORDS = set(STATUSES)
# Not a trial's status: the health endpoint's answer, {"status": "ok"}.
NOT_TRIAL_STATUS = {("api/routes/system.py", "ok")}


def _names_a_status(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return "status" in node.id
    if isinstance(node, ast.Attribute):
        return "status" in node.attr
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and node.slice.value == "status"
    )


def _words(node: ast.AST) -> list[str]:
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def bare_status_words(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, word) of each status word written out where a status is compared, given or built."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_a_status(s) for s in sides):
                found += [(node.lineno, w) for s in sides for w in _words(s) if w in WORDS]
        elif isinstance(node, ast.keyword) and node.arg == "status":
            found += [(node.value.lineno, w) for w in _words(node.value) if w in WORDS]
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "status":
                    found += [(value.lineno, w) for w in _words(value) if w in WORDS]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) == "TrialRecord"
        ):
            found += [(a.lineno, w) for a in node.args for w in _words(a) if w in WORDS | set(STATES)]
    return found


def test_the_scan_finds_what_it_should():
    code = 'if r.status == "ok": pass\nx = {"status": "oom"}\nTrialRecord(0, "complete", "waiting")\nf(status="pruned")'
    assert [w for _, w in bare_status_words(ast.parse(code))] == [
        "ok",
        "oom",
        "complete",
        "waiting",
        "pruned",
    ]


@pytest.mark.parametrize("path", SOURCES, ids=[p.relative_to(ROOT).as_posix() for p in SOURCES])
def test_status_words_come_from_tuner_record_status(path):
    rel = path.relative_to(ROOT).as_posix()
    bare = [
        f"line {n}: {w!r}"
        for n, w in bare_status_words(ast.parse(path.read_text()))
        if (rel, w) not in NOT_TRIAL_STATUS
    ]
    assert not bare, f"{rel}: use tuner.record.status's constants, not {bare}"
