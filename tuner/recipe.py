"""The recipe: the public input document (what to train, on which devices, with what budget).

CLI, REST and nightly all take this one document. It is data only: a built-in model family
with sizes, never a path to Python code (see DESIGN.md, trust boundary).
"""

from __future__ import annotations

import hashlib
import json
import stat
from collections.abc import Hashable
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# The most trials one study may be asked for (recipe, `tuner tune --trials`).
MAX_TRIALS = 100_000


class RecipeError(ValueError):
    """A recipe that cannot be used. `problems` holds one (field, message) pair per fault."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        lines = [f"{where}{field}: {msg}" if field else f"{where}{msg}" for field, msg in problems]
        super().__init__("\n".join(lines))


def _number(value: Any) -> Any:
    """Accept numbers and numeric text (PyYAML reads `3e-4` as a string), never booleans."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value  # strict validation then names the field
    return value


# Strict sections: `layers: "4"` or `steps: false` are mistakes, not values to coerce.
# Real-valued fields still take numeric text, since YAML 1.1 has no exponent-only floats; never
# .inf or .nan (a budget or a time limit of infinity is no limit, and overflows where it is used).
Real = Annotated[FiniteFloat, BeforeValidator(_number)]


Sampler = Literal["tpe", "model", "gp", "cmaes", "random", "grid"]
SAMPLERS: tuple[str, ...] = get_args(Sampler)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSpec(_Section):
    """What to train. The family (`tuner.models`) owns its formulas and the fields only it reads."""

    family: Literal["gpt", "llama", "hf", "plugin"] = Field(
        "gpt",
        description="Model family: gpt (GPT-2 style), llama (Llama-3 layout) or hf (a transformers "
        "decoder-only model built from model.config; the sizes are the config's) or plugin (an "
        "installed model plugin, model.plugin, with model.options).",
    )
    layers: int = Field(..., ge=1, le=512, description="Number of transformer blocks.")
    hidden: int = Field(..., ge=8, le=65536, description="Model width (d_model).")
    heads: int = Field(..., ge=1, le=1024, description="Attention heads; must divide hidden.")
    seq_len: int = Field(..., ge=2, le=1_048_576, description="Tokens per sample.")
    vocab: int = Field(..., ge=2, le=2_000_000, description="Vocabulary size.")
    ffn: int | None = Field(
        None, ge=1, description="MLP inner size; null = the family's rule (gpt 4*hidden, llama 8/3*hidden)."
    )
    kv_heads: int | None = Field(
        None,
        ge=1,
        description="llama: key/value heads (grouped-query attention); null = heads; divides heads.",
    )
    ffn_multiple_of: int | None = Field(
        None, ge=1, description="llama: ffn: null rounds 8/3*hidden up to this multiple; null = 256."
    )
    rope_theta: Real | None = Field(
        None, gt=0, description="llama: rotary position embedding base; null = 500000."
    )
    tie_embeddings: bool | None = Field(
        None, description="llama: share the token embedding with the output projection; null = false."
    )
    config: dict[str, Any] | None = Field(
        None,
        description="hf: the transformers config as data: model_type plus keys its config class "
        "declares (no auto_map, trust_remote_code or keys naming classes, modules or files).",
    )

    plugin: str | None = Field(None, description="plugin: the installed model plugin's name (tuner models).")
    options: dict[str, Any] | None = Field(
        None, description="plugin: the plugin's options, plain data its own schema checks."
    )

    @field_validator(
        "kv_heads",
        "ffn_multiple_of",
        "rope_theta",
        "tie_embeddings",
        "config",
        "plugin",
        "options",
        mode="after",
    )
    @classmethod
    def _family_field(cls, value: Any, info: ValidationInfo) -> Any:
        from tuner.models import get_family

        family = info.data.get("family")
        if family is None:  # the family itself was invalid; that error is reported
            return value
        problem = get_family(family).check_field(info.field_name, value, info.data)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelSpec:
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be divisible by heads ({self.heads}); "
                "pick a head count that divides the width"
            )
        return self

    def hash_fields(self) -> dict[str, Any]:
        """The fields that change the model; unset family-only fields are left out, so adding a
        family's fields never changed the hash (and the studies) of an existing recipe."""
        return self.model_dump(exclude={k for k in FAMILY_ONLY_FIELDS if getattr(self, k) is None})

    @property
    def ffn_size(self) -> int:
        from tuner.models import family_of

        return family_of(self).ffn_size(self)

    @property
    def head_dim(self) -> int:
        from tuner.models import family_of

        return family_of(self).head_dim(self)

    @property
    def kv_heads_count(self) -> int:
        from tuner.models import family_of

        return family_of(self).kv_heads(self)


FAMILY_ONLY_FIELDS = (
    "kv_heads", "ffn_multiple_of", "rope_theta", "tie_embeddings", "config", "plugin", "options"
)  # fmt: skip


class TrainSpec(_Section):
    global_batch_size: int = Field(16, ge=1, description="Samples per optimizer step, all ranks.")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    lr: Real = Field(3.0e-4, gt=0, le=10, description="Learning rate.")


class HardwareSpec(_Section):
    device: Literal["auto", "cpu", "cuda", "npu"] = Field(
        "auto", description="Device family; auto picks npu, then cuda, then cpu."
    )
    devices: int = Field(1, ge=1, le=4096, description="Devices (ranks) per trial.")
    nodes: int = Field(
        1, ge=1, le=1024, description="Machines a trial spans (torchrun --nnodes); devices split evenly."
    )
    memory_budget_gb: Real | None = Field(
        None, gt=0, le=1e6, description="Peak memory allowed per device in GiB; null = the device's size."
    )

    @model_validator(mode="after")
    def _devices_split_over_nodes(self) -> HardwareSpec:
        if self.devices % self.nodes:
            raise ValueError(
                f"devices ({self.devices}) must be a multiple of nodes ({self.nodes}): every node runs "
                "the same number of ranks; set devices to nodes x devices per node"
            )
        return self

    @property
    def devices_per_node(self) -> int:
        return self.devices // self.nodes


class SearchSpec(_Section):
    space: str | None = Field(
        None, description="Search space name (search_spaces/<name>.yaml); default: device family."
    )
    trials: int = Field(30, ge=1, le=MAX_TRIALS, description="Trials to run (pruned ones count).")
    timeout_min: Real = Field(30, gt=0, le=1e6, description="Stop starting new trials after this long.")
    sampler: Sampler = Field(
        "model",
        description="Search algorithm: model (the performance model picks), tpe, gp, cmaes, random; grid enumerates the space.",
    )
    # Samplers take a 32-bit seed, and a resumed study offsets it by the trials it holds.
    seed: int = Field(0, ge=0, le=2**31 - 1)
    objective: Literal["throughput", "throughput_memory"] = Field(
        "throughput", description="throughput_memory also minimises peak memory (Pareto front)."
    )
    patience: int | None = Field(
        None, ge=1, description="Stop early when the best has not improved for this many trials."
    )
    overrides: dict[str, list[Any]] = Field(
        default_factory=dict, description="Narrow a knob's domain: {knob: [values]}."
    )
    reuse: bool = Field(
        True,
        description="A job reuses the measured trials of earlier runs of the same recipe on the same "
        "devices and software (one study per recipe hash and fingerprint); false: a fresh study.",
    )

    @model_validator(mode="after")
    def _sampler_fits_objective(self) -> SearchSpec:
        if self.sampler == "cmaes" and self.objective == "throughput_memory":
            raise ValueError(
                "sampler cmaes has one objective; use tpe, gp or random for objective throughput_memory"
            )
        return self


class MeasureSpec(_Section):
    warmup_steps: int = Field(
        8, ge=0, le=1000, description="Most warm-up steps; warm-up ends earlier once the step time settles."
    )
    steps: int = Field(5, ge=1, le=10_000, description="Fewest measured steps.")
    target_ci: Real | None = Field(
        0.03,
        gt=0,
        lt=1,
        description="Measure until the 95% interval of the median step time is within this fraction "
        "of it (null: exactly `steps` steps).",
    )
    max_seconds: Real = Field(
        20, gt=0, le=1e6, description="Stop measuring after this many seconds of measured steps."
    )
    timeout_s: Real = Field(300, gt=0, le=1e7, description="A trial running longer is killed (timeout).")


class Recipe(_Section):
    name: str = Field(..., min_length=1, max_length=200)
    model: ModelSpec
    train: TrainSpec = TrainSpec()
    hardware: HardwareSpec = HardwareSpec()
    search: SearchSpec = SearchSpec()
    measure: MeasureSpec = MeasureSpec()

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains: the same for every config of the recipe."""
        return self.train.global_batch_size * self.model.seq_len

    def hash(self) -> str:
        """Stable 16-hex-digit hash of what changes the measurement (not name or search budget)."""
        payload = {
            "model": self.model.hash_fields(),
            "train": self.train.model_dump(),
            # A single-node recipe hashes as it did before `nodes` existed: its studies stay found.
            "hardware": self.hardware.model_dump(exclude={"nodes"} if self.hardware.nodes == 1 else None),
            "measure": _measure_hash_fields(self.measure),
        }
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _measure_hash_fields(m: MeasureSpec) -> dict[str, Any]:
    """The measure fields a study's key depends on. target_ci and max_seconds count only when set
    away from their defaults, so the studies of recipes written before they existed keep their key."""
    out = m.model_dump(exclude={"timeout_s", "target_ci", "max_seconds"})
    for name in ("target_ci", "max_seconds"):
        if getattr(m, name) != MeasureSpec.model_fields[name].default:
            out[name] = getattr(m, name)
    return out


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-after"))


def _problems(err: ValidationError) -> list[tuple[str, str]]:
    out = []
    for e in err.errors():
        field = _field_path(e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        out.append((field, msg))
    return out


def recipe_from_dict(data: Any, source: str | None = None) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError([("", "a recipe must be a mapping with at least 'name' and 'model'")], source)
    model = data.get("model")
    if isinstance(model, dict) and model.get("family") in ("hf", "plugin"):
        from tuner.models import hf, plugins

        # The sizes come from the config (checked as data before transformers sees it) or from
        # the plugin's validated options.
        resolve = hf.resolve_model if model["family"] == "hf" else plugins.resolve_model
        resolved, problems = resolve(model)
        if problems:
            raise RecipeError(problems, source)
        data = {**data, "model": resolved}
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_problems(err), source) from None


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


def parse_recipe(text: str, source: str | None = None) -> Recipe:
    """Parse YAML or JSON text (JSON is YAML) into a validated Recipe."""
    return recipe_from_dict(load_document(text, source), source)


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


def read_recipe_text(path: str | Path) -> str:
    """The text of a recipe file, or a RecipeError naming the file and what is wrong with it
    (`read_text_file`)."""
    try:
        return read_text_file(path)
    except ValueError as err:
        raise RecipeError([("", str(err))], str(Path(path))) from None


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file; every fault is a RecipeError naming the file."""
    return parse_recipe(read_recipe_text(path), str(Path(path)))
