"""`model.family: plugin`: model families installed by an operator as Python packages, each an
entry point in the group `tuner.models` whose object is a `PluginFamily` (or its class).

The recipe names the plugin and hands it `options`, plain data validated by the plugin's own
pydantic model (`options_model`), so bad options are field errors (`model.options.<key>`). A
recipe can only name a plugin installed where it is read: an unknown name is a field error
listing the installed ones. The plugin supplies the sizes the recipe's shared fields hold
(`sizes(options)`: layers, hidden, heads, vocab, optionally ffn and kv_heads) and implements the
rest of `ModelFamily` (formulas, meta build, tensor-parallel plan or `shape_reasons` refusing tp,
init rule) exactly as the built-in families do.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from tuner.models.base import ModelFamily, Requirement, register

if TYPE_CHECKING:
    from tuner.recipe import ModelSpec

GROUP = "tuner.models"


class PluginFamily(ModelFamily):
    """The base class a plugin implements (see `ModelFamily` for the formulas and torch side).

    `options_model`: a pydantic model of the recipe's `model.options`; `sizes(options)` returns
    {"layers", "hidden", "heads", "vocab"} (and "ffn" when the family has one) from validated
    options. `build`, `parallelize` and `init_rule` may be overridden directly instead of
    naming an `nn_module`."""

    fields = ("plugin", "options")
    options_model: type[BaseModel] = BaseModel
    description: str = ""

    def sizes(self, options: BaseModel) -> dict[str, int]:
        raise NotImplementedError

    def options(self, m: ModelSpec) -> BaseModel:
        return self.options_model.model_validate(m.options or {})

    def requires(self, m: ModelSpec) -> list[Requirement]:
        package, version = plugin_package(self.name)
        return [
            Requirement(f"the model plugin {self.name!r}", package, version, entry_point=(GROUP, self.name))
        ]


@functools.cache
def installed() -> dict[str, Any]:
    """Installed plugin name -> its entry point (not loaded)."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def plugin_package(name: str) -> tuple[str, str | None]:
    """The pip package (and its version) that installed plugin `name`'s entry point."""
    dist = getattr(installed()[name], "dist", None)
    if dist is None:  # an entry point not from an installed distribution
        return name, None
    return dist.metadata["Name"], dist.version


@functools.cache
def load_plugin(name: str) -> PluginFamily:
    obj = installed()[name].load()
    family = obj() if isinstance(obj, type) else obj
    if not isinstance(family, PluginFamily):
        raise TypeError(f"entry point {name!r} in {GROUP} is not a tuner PluginFamily")
    family.name = name
    return family


def plugin_problems(model: dict[str, Any]) -> list[tuple[str, str]]:
    name = model.get("plugin")
    names = sorted(installed())
    if not isinstance(name, str) or name not in names:
        listed = ", ".join(names) if names else "none are installed"
        return [("model.plugin", f"{name!r} is not an installed model plugin; installed: {listed}")]
    options = model.get("options") or {}
    if not isinstance(options, dict):
        return [("model.options", "must be a mapping of the plugin's options")]
    try:
        family = load_plugin(name)
    except Exception as err:  # noqa: BLE001 - a plugin's own failure to load is the recipe's to fix
        first = (str(err).splitlines() or [""])[0]
        package = plugin_package(name)[0]
        return [("model.plugin", f"plugin {name!r} failed to load ({type(err).__name__}: {first}); "
                                 f"reinstall or fix its package {package!r}")]  # fmt: skip
    try:
        family.options_model.model_validate(options)
    except ValidationError as err:
        return [
            (".".join(["model.options", *(str(p) for p in e["loc"])]), e["msg"].removeprefix("Value error, "))
            for e in err.errors()
        ]
    return []


def resolve_model(model: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A plugin recipe's `model` section with the sizes the plugin reads from its options."""
    problems = plugin_problems(model)
    if problems:
        return model, problems
    family = load_plugin(model["plugin"])
    try:
        sizes = family.sizes(family.options_model.model_validate(model.get("options") or {}))
    except Exception as err:  # noqa: BLE001 - the plugin's code, not ours: its failure names it
        return model, [("model.plugin", f"plugin {model['plugin']!r} could not size the model: "
                                        f"{type(err).__name__}: {err}")]  # fmt: skip
    out = dict(model)
    for field, value in sizes.items():
        if model.get(field) is not None and model[field] != value:
            problems.append(
                (f"model.{field}", f"{model[field]} differs from the plugin's {value}; remove it")
            )
        out[field] = value
    return out, problems


def catalog() -> list[dict[str, Any]]:
    """The installed plugins with their option schemas (what `tuner models` and GET /v1/models show)."""
    out = []
    for name in sorted(installed()):
        try:
            family = load_plugin(name)
        except Exception as err:  # noqa: BLE001 - a broken plugin is listed, not fatal
            out.append({"name": name, "kind": "plugin", "error": str(err).splitlines()[0]})
            continue
        schema = family.options_model.model_json_schema()
        package, version = plugin_package(name)
        out.append({"name": name, "kind": "plugin", "description": family.description,
                    "package": package, "version": version, "options": schema,
                    "example": _example(name, family)})  # fmt: skip
    return out


def _example(name: str, family: PluginFamily) -> dict[str, Any]:
    """A model section naming the plugin with its default options written out (just the name
    when an option has no default)."""
    try:
        options = family.options_model().model_dump(mode="json")
    except ValidationError:
        options = {}
    return {"family": "plugin", "plugin": name, "seq_len": 64, "options": options}


class _PluginSlot(ModelFamily):
    """`model.family: plugin` in the registry: checks the plugin's name and options; the
    formulas and the build are the named plugin's (`tuner.models.family_of`)."""

    name = "plugin"
    fields = ("plugin", "options")

    def check_field(self, field: str, value: Any, values: dict[str, Any]) -> str | None:
        if field == "plugin":
            problems = plugin_problems({"plugin": value})
            return problems[0][1] if problems else None
        if field == "options" and isinstance(values.get("plugin"), str):
            problems = plugin_problems({"plugin": values["plugin"], "options": value})
            return "; ".join(f"{f}: {msg}" for f, msg in problems) or None
        return super().check_field(field, value, values)


register(_PluginSlot())
