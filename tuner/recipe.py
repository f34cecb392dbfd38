"""The recipe: the public input document (what to train, on which devices, with what budget).

CLI, REST and nightly all take this one document. It is data only: a built-in model family
with sizes, never a path to Python code (see DESIGN.md, trust boundary).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

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

from tuner.recipe_text import (  # noqa: F401 - re-exported: where callers have always found them
    MAX_RECIPE_BYTES,
    RecipeError,
    load_document,
    load_json,
    read_text_file,
)

# The most trials one study may be asked for (recipe, `tuner tune --trials`).
MAX_TRIALS = 100_000


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
        None,
        ge=1,
        le=1_048_576,
        description="MLP inner size; null = the family's rule (gpt 4*hidden, llama 8/3*hidden).",
    )
    kv_heads: int | None = Field(
        None,
        ge=1,
        description="llama: key/value heads (grouped-query attention); null = heads; divides heads.",
    )
    ffn_multiple_of: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="llama: ffn: null rounds 8/3*hidden up to this multiple; null = 256.",
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
        instead = SET_INSTEAD.get(family, {}).get(info.field_name)
        if value is not None and instead is not None:
            raise ValueError(f"the {family} family does not read it; {instead}")
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


# Where a family that does not take one of llama's fields sets the same thing: what a recipe that
# gives that field is told to do instead of "remove it or set model.family".
_OPTIONS = "remove it and set the plugin's own option for it in model.options (tuner models lists them)"
SET_INSTEAD = {
    "hf": {
        "kv_heads": "set model.config.num_key_value_heads instead and remove it",
        "tie_embeddings": "set model.config.tie_word_embeddings instead and remove it",
        "rope_theta": "set model.config.rope_theta instead and remove it",
        "ffn_multiple_of": "set model.config.intermediate_size instead and remove it",
    },
    "plugin": {"ffn_multiple_of": _OPTIONS, "rope_theta": _OPTIONS, "tie_embeddings": _OPTIONS},
}

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

    @field_validator("name")
    @classmethod
    def _printable_name(cls, value: str) -> str:
        if not printable_line(value):
            raise ValueError(
                "must be one line of printable text (no tabs, newlines or other control characters)"
            )
        return value

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


def printable_line(text: str) -> bool:
    """Whether `text` is one line of printable text (no control characters): what a recipe's name is."""
    return not any(ord(ch) < 32 or ord(ch) == 127 for ch in text)


def _nul_problems(value: Any, path: str = "") -> list[tuple[str, str]]:
    """Fields whose text holds a NUL character: no database stores it in text or JSON (PostgreSQL
    refuses it), and nothing a recipe names needs one."""
    if isinstance(value, str):
        return [(path, "contains a NUL character (\\0); remove it")] if "\x00" in value else []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _nul_problems(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _nul_problems(v, f"{path}.{i}" if path else str(i))]
    return []


def recipe_from_dict(data: Any, source: str | None = None) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError([("", "a recipe must be a mapping with at least 'name' and 'model'")], source)
    if problems := _nul_problems(data):
        raise RecipeError(problems, source)
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


def parse_recipe(text: str, source: str | None = None) -> Recipe:
    """Parse YAML or JSON text (JSON is YAML) into a validated Recipe."""
    return recipe_from_dict(load_document(text, source), source)


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
