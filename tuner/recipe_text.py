"""A recipe's text, before it is a recipe: the bounded read of a file (`read_text_file`, also
what search-space files are read with), YAML and JSON parsed to plain data with a key given twice,
an alias or nesting too deep refused (`load_document`, `load_json`), and the error every entry
point reports a bad recipe with (`RecipeError`, one (field, message) pair per fault)."""

from __future__ import annotations

import json
import stat
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml


class RecipeError(ValueError):
    """A recipe that cannot be used. `problems` holds one (field, message) pair per fault."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        lines = [f"{where}{field}: {msg}" if field else f"{where}{msg}" for field, msg in problems]
        super().__init__("\n".join(lines))


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (YAML and JSON both let the
    last one win silently: `search:` twice would drop the first block), and aliases (`*name`): a
    recipe never needs them, and ten levels of lists of ten aliases each, 700 bytes, expand to
    10^9 values that the checks would walk for hours, from any entry point."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"alias *{event.anchor} repeats another part; write the value out",
                event.start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # `? [a, b]`: YAML allows it, no recipe field is one
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is a list or mapping; a key is a name", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_RecipeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _RecipeLoader.construct_mapping)


def load_document(text: str, source: str | None = None) -> Any:
    """YAML or JSON text (JSON is YAML) as plain data, or a RecipeError saying where it is broken.
    Also what PyYAML's own constructors raise past their YAMLError (a date like 2026-02-30, a
    `!!int` that is none, a number of thousands of digits) and nesting too deep to read."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or err
        raise RecipeError([("", f"not valid YAML or JSON{where}: {problem}")], source) from None
    except (ValueError, OverflowError) as err:  # a scalar its tag cannot hold
        why = f"not valid YAML or JSON: a value cannot be read ({_value_reason(err)})"
        raise RecipeError([("", why)], source) from None
    except RecursionError:
        raise RecipeError([("", f"not valid YAML or JSON: {TOO_DEEP}")], source) from None


TOO_DEEP = "nested too deeply to be a recipe"


def _value_reason(err: Exception) -> str:
    """Why a value cannot be read, as a recipe's author can act on it (Python's own message for a
    number of thousands of digits names a sys call)."""
    return "a number of thousands of digits" if "digits" in str(err) else str(err)


def load_json(text: str, source: str | None = None) -> Any:
    """JSON text as plain data, or a RecipeError saying where it is broken (a key given twice
    included, as `load_document` refuses it in YAML)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"key {key!r} is given twice; keep one")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as err:
        where = f"line {err.lineno}, column {err.colno}"
        raise RecipeError([("body", f"not valid JSON at {where}: {err.msg}")], source) from None
    except ValueError as err:  # a duplicate key, or a number of thousands of digits
        raise RecipeError([("body", f"not valid JSON: {_value_reason(err)}")], source) from None
    except RecursionError:
        raise RecipeError([("body", f"not valid JSON: {TOO_DEEP}")], source) from None


# A recipe is a page of YAML; anything larger is the wrong file (the REST API caps bodies at 1 MiB).
MAX_RECIPE_BYTES = 1_048_576


def read_text_file(path: str | Path, what: str = "recipe", limit: int = MAX_RECIPE_BYTES) -> str:
    """The text of a small YAML or JSON file (a recipe, a search space), or a ValueError saying what
    is wrong with it, for the caller to name its field: missing, a directory, not a regular file (a
    FIFO would block the open until something writes to it), unreadable, too large, binary, not
    UTF-8."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError as err:
        raise ValueError(f"cannot read {what} file: {err.strerror or err}") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"is a directory, not a {what} file; give the path of a YAML or JSON file")
    if not stat.S_ISREG(mode):
        raise ValueError(f"is not a regular file (a pipe or a device); give the path of a {what} file")
    try:
        with open(p, "rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise ValueError(f"cannot read {what} file: {err.strerror or err}") from None
    if len(data) > limit:
        raise ValueError(f"larger than {limit // 1024} KiB; a {what} is a short YAML or JSON file")
    if b"\x00" in data:
        raise ValueError("is a binary file, not YAML or JSON text")
    try:
        return data.decode("utf-8-sig")  # a UTF-8 byte-order mark is allowed, and dropped
    except UnicodeDecodeError as err:
        raise ValueError(
            f"is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); save it as UTF-8"
        ) from None
