"""`model.family: plugin`: model families installed by an operator as Python packages, each an
entry point in the group `tuner.models` whose object is a `PluginFamily` (or its class).

The recipe names the plugin and hands it `options`, plain data validated by the plugin's own
pydantic model (`options_model`), so bad options are field errors (`model.options.<key>`). A
recipe can only name a plugin installed where it is read: an unknown name is a field error
listing the installed ones. The plugin supplies the sizes the recipe's shared fields hold
(`sizes(options)`: layers, hidden, heads, vocab, optionally ffn and kv_heads) and implements the
rest of `ModelFamily` (formulas, meta build, tensor-parallel plan or `shape_reasons` refusing tp,
init rule) exactly as the built-in families do. A plugin that leaves a formula or the torch side
out is refused where a recipe names it (`contract_problem`), and a built model that breaks the
module contract fails its trial with the fix (`module_problem`).

The installed plugins are read once per process: a service or worker running when a plugin is
installed sees it after a restart.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from tuner.models.base import ModelFamily, Requirement, kv_heads_reason, register

if TYPE_CHECKING:
    from tuner.recipe import ModelSpec

GROUP = "tuner.models"
SIZES = ("layers", "hidden", "heads", "vocab")  # what `sizes` returns, all ints
OPTIONAL_SIZES = ("ffn", "kv_heads")
# What `ModelFamily` leaves to each family (there they raise NotImplementedError): a plugin without
# one is refused when a recipe names it, not met as a traceback in the middle of a plan or study.
FORMULAS = ("sizes", "ffn_size", "block_params", "block_matmul_params", "attention_matmul_params",
            "embedding_params", "head_params", "vocab_params")  # fmt: skip
# The torch side `ModelFamily` imports from `nn_module`: a plugin that names none overrides each.
TORCH_SIDE = ("build", "parallelize", "init_rule")


class PluginFamily(ModelFamily):
    """The base class a plugin implements (see `ModelFamily` for the formulas and torch side).

    `options_model`: a pydantic model of the recipe's `model.options`; `sizes(options)` returns
    {"layers", "hidden", "heads", "vocab"} (and "ffn", "kv_heads" when the model has them; the
    default `kv_heads(m)` reads the returned one) from validated options. Every formula in
    `FORMULAS` is overridden. `build`, `parallelize` and `init_rule` may be overridden directly
    instead of naming an `nn_module`; `build` returns a `tuner.models.layers.Decoder` (see
    `ModelFamily`), whose blocks name their attention submodule in `ATTENTION`."""

    fields = ("plugin", "options")
    options_model: type[BaseModel] = BaseModel
    description: str = ""

    def sizes(self, options: BaseModel) -> dict[str, int]:
        raise NotImplementedError

    def kv_heads(self, m: ModelSpec) -> int:
        return m.kv_heads if m.kv_heads is not None else m.heads

    def options(self, m: ModelSpec) -> BaseModel:
        return self.options_model.model_validate(m.options or {})

    def requires(self, m: ModelSpec) -> list[Requirement]:
        package, version = plugin_package(self.name)
        return [
            Requirement(f"the model plugin {self.name!r}", package, version, entry_point=(GROUP, self.name))
        ]


@functools.cache
def installed() -> dict[str, Any]:
    """Installed plugin name -> its entry point (not loaded). Read once per process, so a plugin
    installed later needs a restart of the service and its workers."""
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
    if (problem := contract_problem(family)) is not None:
        return [("model.plugin", f"plugin {name!r} {problem}; fix its package {plugin_package(name)[0]!r}")]
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
    if (problem := _sizes_problem(sizes)) is not None:
        return model, [("model.plugin", f"plugin {model['plugin']!r} sizes() {problem}; fix its package "
                                        f"{plugin_package(model['plugin'])[0]!r}")]  # fmt: skip
    out = dict(model)
    for field in SIZES + OPTIONAL_SIZES:
        value = sizes.get(field)
        if value is None and model.get(field) is not None:
            problems.append((f"model.{field}", f"plugin {model['plugin']!r} does not take it; remove it "
                                               "(the plugin's sizes come from model.options)"))  # fmt: skip
        elif model.get(field) is not None and model[field] != value:
            problems.append(
                (f"model.{field}", f"{model[field]} differs from the plugin's {value}; remove it")
            )
        out[field] = value
    return out, problems


def _sizes_problem(sizes: Any) -> str | None:
    """What is wrong with what a plugin's `sizes()` returned, said as "sizes() ...", else None."""
    want = f"a mapping of int {', '.join(SIZES)} (and optionally {', '.join(OPTIONAL_SIZES)})"
    if not isinstance(sizes, Mapping):
        return f"returned {str(sizes)[:60]}, not {want}"
    said = [f"no {k}" for k in SIZES if k not in sizes]
    for k, v in sizes.items():
        if k not in SIZES + OPTIONAL_SIZES:
            said.append(f"{k!r}, which is not a size")
        elif (v is not None or k in SIZES) and (type(v) is not int or v < 1):
            said.append(f"{k} {v!r}, not a positive int")
    if said:
        return f"returned {', '.join(said)}; it must return {want}"
    if sizes.get("kv_heads") is not None:
        reason = kv_heads_reason(sizes["kv_heads"], sizes["heads"])
        return None if reason is None else f"returned {reason}"
    return None


def contract_problem(family: PluginFamily) -> str | None:
    """The methods of the `ModelFamily` contract a plugin leaves to the base (which would raise
    mid-plan or mid-study), said with the fix; None when it implements them all."""
    cls = type(family)
    formulas = [n for n in FORMULAS if getattr(cls, n) is getattr(PluginFamily, n)]
    torch_side = [
        n for n in TORCH_SIDE if not family.nn_module and getattr(cls, n) is getattr(PluginFamily, n)
    ]
    said = []
    if formulas:
        said.append(
            f"does not implement {', '.join(formulas)} (the ModelFamily formulas every family implements)"
        )
    if torch_side:
        said.append(f"names no nn_module and does not override {', '.join(torch_side)}: set nn_module to the "
                    "module defining build, parallelize and init_rule, or override them")  # fmt: skip
    return "; ".join(said) or None


def module_problem(family: PluginFamily, m: ModelSpec, model: Any) -> str | None:
    """How the model a plugin's `build` returned breaks the module contract (`ModelFamily`), said
    as "plugin 'x' ..." with the fix; None when it keeps it. Checked on the meta build, before a
    trial spends time on it (a rank imports torch; the recipe check does not)."""
    from torch import nn

    from tuner.models.layers import Decoder

    said = f"plugin {family.name!r} (package {plugin_package(family.name)[0]!r})"
    if not isinstance(model, Decoder):
        return f"{said}: build() returned a {type(model).__name__}, not a tuner.models.layers.Decoder; subclass it"
    keys = [str(i) for i in range(m.layers)]
    if not isinstance(getattr(model, "layers", None), nn.ModuleDict) or list(model.layers.keys()) != keys:
        return (
            f"{said}: the model's layers must be an nn.ModuleDict keyed by layer index ('0' to '{keys[-1]}')"
        )
    for part in (*model.first_parts, *model.last_parts):
        if getattr(model, part, None) is None:
            return f"{said}: first_parts/last_parts name {part!r}, which the model does not have"
    for key, block in model.layers.items():
        attention = getattr(block, "ATTENTION", None)
        if not isinstance(attention, str) or not isinstance(getattr(block, attention, None), nn.Module):
            return (f"{said}: block {key} ({type(block).__name__}) does not name its attention submodule "
                    "in ATTENTION (what recompute=selective checkpoints); set ATTENTION = '<its attribute "
                    "name>' on the block's class")  # fmt: skip
    return None


def catalog() -> list[dict[str, Any]]:
    """The installed plugins with their option schemas (what `tuner models` and GET /v1/models show)."""
    out = []
    for name in sorted(installed()):
        try:
            family = load_plugin(name)
        except Exception as err:  # noqa: BLE001 - a broken plugin is listed, not fatal
            out.append({"name": name, "kind": "plugin", "error": str(err).splitlines()[0]})
            continue
        if (problem := contract_problem(family)) is not None:
            out.append({"name": name, "kind": "plugin", "error": problem})
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
        if field == "kv_heads" and value is not None:  # the plugin's own (`resolve_model`)
            return kv_heads_reason(value, values["heads"]) if "heads" in values else None
        if field == "options" and isinstance(values.get("plugin"), str):
            problems = plugin_problems({"plugin": values["plugin"], "options": value})
            return "; ".join(f"{f}: {msg}" for f, msg in problems) or None
        return super().check_field(field, value, values)


register(_PluginSlot())
