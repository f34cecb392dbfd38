"""A full knob setting (`Config`) and the feasibility rules, in one place.

The knob names are the public vocabulary of DESIGN.md: CLI `--set`, YAML spaces, REST, the
dashboard and stored trial params all use them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any

from tuner.attention_kernels import compute_dtype, kernel_reasons
from tuner.devices import DeviceInfo
from tuner.recipe import Recipe


class ConfigError(ValueError):
    """A knob name or value that does not exist. The message lists the valid choices."""


# The largest value each integer knob takes: beyond it torch fails deep inside (a 1e14 MB DDP
# bucket overflowed its Reducer's size) or the machine does (a process per loader worker).
_INT_MAXIMUM = {"bucket_mb": 1_048_576, "loader_workers": 256, "micro_batch_size": 1_048_576}


@dataclass(frozen=True)
class Knob:
    name: str
    kind: type  # int, float, bool or str
    choices: tuple[Any, ...] | None  # None: any positive int (validated by `check`)
    doc: str
    applies: str | None = None  # human description of when the knob is sampled

    def parse(self, raw: Any) -> Any:
        """Turn a CLI/YAML/JSON value into the knob's type, or raise ConfigError."""
        value = raw
        if self.kind is bool:
            if isinstance(raw, str):
                low = raw.strip().lower()
                if low in ("true", "1", "yes", "on"):
                    value = True
                elif low in ("false", "0", "no", "off"):
                    value = False
            if not isinstance(value, bool):
                raise ConfigError(f"{self.name}: {raw!r} is not a boolean; use true or false")
        elif self.kind is int:
            if isinstance(raw, bool):
                raise ConfigError(f"{self.name}: {raw!r} is not an integer")
            try:
                value = int(raw)
                if isinstance(raw, float) and raw != value:
                    raise ValueError
            except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
                raise ConfigError(f"{self.name}: {raw!r} is not an integer") from None
            minimum = 0 if self.name == "loader_workers" else 1
            if value < minimum:
                raise ConfigError(f"{self.name}: must be an integer >= {minimum}, got {value}")
            maximum = _INT_MAXIMUM.get(self.name, 2**31 - 1)
            if value > maximum:
                raise ConfigError(f"{self.name}: must be at most {maximum:,}, got {value:,}")
        elif self.kind is float:
            if isinstance(raw, bool):
                raise ConfigError(f"{self.name}: {raw!r} is not a number")
            try:
                value = float(raw)
            except (TypeError, ValueError):
                raise ConfigError(f"{self.name}: {raw!r} is not a number") from None
            if not math.isfinite(value):
                raise ConfigError(f"{self.name}: {raw!r} is not a finite number")
        else:
            value = str(raw)
        if self.choices is not None and value not in self.choices:
            valid = ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in self.choices)
            raise ConfigError(f"{self.name}: {raw!r} is not a valid value; valid values: {valid}")
        if self.name == "micro_batch_size" and value & (value - 1):
            raise ConfigError(f"micro_batch_size: {value} is not a power of two (1, 2, 4, 8, ...)")
        return value


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in [
        Knob("micro_batch_size", int, None, "Samples per forward/backward; powers of two."),
        Knob("dp", int, None, "Data-parallel degree."),
        Knob("tp", int, None, "Tensor-parallel degree (DTensor, Colwise/Rowwise)."),
        Knob("pp", int, None, "Pipeline-parallel degree (torch.distributed.pipelining)."),
        Knob("pp_schedule", str, ("1f1b", "gpipe"), "Pipeline schedule.", "pp > 1"),
        Knob("dp_shard", str, ("ddp", "fsdp"), "DDP or FSDP2 (fully_shard) on dp.", "dp > 1"),
        Knob("recompute", str, ("none", "selective", "full"), "Activation checkpointing."),
        Knob(
            "recompute_layers",
            float,
            (0.25, 0.5, 0.75, 1.0),
            "Fraction of each stage's blocks recomputed, the first ones (Megatron's recompute_num_layers).",
            "recompute != none",
        ),
        Knob(
            "sequence_parallel",
            bool,
            (False, True),
            "Shard norms over the sequence between tp regions (DTensor SequenceParallel).",
            "tp > 1",
        ),
        Knob("offload", bool, (False, True), "Save activations on host (save_on_cpu)."),
        Knob("attention", str, ("math", "flash", "efficient", "cudnn", "npu_fusion"), "SDPA kernel."),
        Knob("bucket_mb", int, None, "DDP bucket_cap_mb (gradient all-reduce fusion).", "ddp, dp > 1"),
        Knob(
            "grad_compression",
            str,
            ("none", "fp16", "bf16", "powersgd"),
            "DDP communication hook.",
            "ddp, dp > 1",
        ),
        Knob("amp", str, ("O0", "O1", "O2"), "O0 fp32, O1 autocast, O2 low-precision params."),
        Knob("amp_dtype", str, ("bf16", "fp16"), "Low-precision dtype for O1/O2.", "amp != O0"),
        Knob("tf32", bool, (False, True), "TF32 matmuls (CUDA only)."),
        Knob(
            "compile",
            str,
            ("none", "default", "max-autotune", "reduce-overhead"),
            "torch.compile (Inductor) mode.",
        ),
        Knob("optimizer_impl", str, ("for_loop", "foreach", "fused"), "Optimizer kernel style."),
        Knob("loader_workers", int, None, "DataLoader worker processes."),
        Knob("pin_memory", bool, (False, True), "Pinned host memory for the DataLoader."),
        Knob("cpu_affinity", str, ("none", "per_rank"), "Bind each rank to its own cores."),
        Knob(
            "alloc_conf",
            str,
            ("default", "expandable_segments"),
            "Caching-allocator setting (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_NPU_ALLOC_CONF).",
        ),
    ]
}


@dataclass(frozen=True)
class Config:
    """One full knob setting. Defaults are the plain, untuned choices."""

    micro_batch_size: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    dp_shard: str = "ddp"
    recompute: str = "none"
    recompute_layers: float = 1.0
    sequence_parallel: bool = False
    offload: bool = False
    attention: str = "math"
    bucket_mb: int = 25
    grad_compression: str = "none"
    amp: str = "O0"
    amp_dtype: str = "bf16"
    tf32: bool = False
    compile: str = "none"
    optimizer_impl: str = "foreach"
    loader_workers: int = 0
    pin_memory: bool = False
    cpu_affinity: str = "none"
    alloc_conf: str = "default"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @classmethod
    def from_params(cls, params: dict[str, Any], base: Config | None = None) -> Config:
        """Build from {knob: value} (strings allowed); unknown knobs raise ConfigError."""
        values = {} if base is None else base.to_dict()
        for name, raw in params.items():
            knob = KNOBS.get(name)
            if knob is None:
                raise ConfigError(f"unknown knob {name!r}; valid knobs: {', '.join(KNOBS)}")
            values[name] = knob.parse(raw)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        # The field names once per process: `dataclasses.fields` per call was a third of ranking
        # a plan's 4,000 configs.
        return {name: getattr(self, name) for name in _field_names()}

    def normalized(self) -> Config:
        """The same config with knobs that do not apply reset to their defaults.

        Two configs that run identically normalise to the same value (duplicate detection).
        """
        d = self.to_dict()
        default = Config()
        if self.pp == 1:
            d["pp_schedule"] = default.pp_schedule
        if self.dp == 1:
            d["dp_shard"] = default.dp_shard
        if self.dp == 1 or d["dp_shard"] != "ddp":
            d["bucket_mb"] = default.bucket_mb
            d["grad_compression"] = default.grad_compression
        if self.amp == "O0":
            d["amp_dtype"] = default.amp_dtype
        if self.recompute == "none":
            d["recompute_layers"] = default.recompute_layers
        if self.tp == 1:
            d["sequence_parallel"] = default.sequence_parallel
        return Config(**d)

    def key(self) -> str:
        return json.dumps(self.normalized().to_dict(), sort_keys=True)

    def active_params(self) -> dict[str, Any]:
        """Only the knobs that apply to this config (what Optuna stores as params)."""
        d = self.normalized().to_dict()
        if self.pp == 1:
            d.pop("pp_schedule")
        if self.dp == 1:
            d.pop("dp_shard")
        if self.dp == 1 or self.dp_shard != "ddp":
            d.pop("bucket_mb")
            d.pop("grad_compression")
        if self.amp == "O0":
            d.pop("amp_dtype")
        if self.recompute == "none":
            d.pop("recompute_layers")
        if self.tp == 1:
            d.pop("sequence_parallel")
        return d


@functools.cache
def _field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config))


def short_config(params: dict[str, Any]) -> str:
    """A config in one line, as every view prints it: the batch and the parallel split, then the
    knobs that differ from the plain defaults."""
    default = Config().to_dict()
    head = (
        f"mbs={params.get('micro_batch_size')} dp{params.get('dp')}-tp{params.get('tp')}-pp{params.get('pp')}"
    )
    rest = [
        f"{k}={v}"
        for k, v in params.items()
        if k not in ("micro_batch_size", "dp", "tp", "pp") and default.get(k) != v
    ]
    return " ".join([head, *rest])


def microbatches(config: Config, recipe: Recipe) -> int:
    """Gradient-accumulation steps (or pipeline microbatches) per optimizer step, per dp rank."""
    return recipe.train.global_batch_size // (config.micro_batch_size * config.dp)


def recomputed_layers(n_layers: int, fraction: float) -> int:
    """How many of a stage's `n_layers` blocks `recompute_layers=fraction` recomputes (at least one)."""
    return max(1, min(n_layers, math.ceil(fraction * n_layers - 1e-9)))


def run_key(config: Config, recipe: Recipe) -> str:
    """`Config.key` up to knob values that run the same program for `recipe`'s model: the
    `recompute_layers` shares that recompute as many of a stage's blocks (on a 4-layer model at
    pp=2, 0.25 and 0.5 both recompute one block of two). A study measures one config per run key:
    the others reuse its result instead of spending a device run."""
    c = config.normalized()
    if c.recompute != "none":
        per_stage = max(1, recipe.model.layers // max(1, c.pp))
        c = dataclasses.replace(
            c, recompute_layers=recomputed_layers(per_stage, c.recompute_layers) / per_stage
        )
    return c.key()


def stored_run_key(config_key: str, recipe: Recipe) -> str:
    """`run_key` of a config stored as its `Config.key` (a trial's `config_key` attribute)."""
    try:
        return run_key(Config.from_params(json.loads(config_key)), recipe)
    except (ValueError, TypeError):  # a key another version wrote: compare it as it is
        return config_key


def infeasible_reasons(config: Config, recipe: Recipe, device: DeviceInfo) -> list[str]:
    """Every reason this config cannot run for this recipe on this device; [] when it can."""
    return [
        *_split_reasons(config, recipe, device),
        *_device_reasons(config, device),
        *_attention_reasons(config, recipe, device),
        *_combination_reasons(config, device),
    ]


def shape_reasons(config: Config, recipe: Recipe) -> list[tuple[str, str]]:
    """(recipe field, reason) for every way the split does not fit the model's shapes."""
    m = recipe.model
    r: list[tuple[str, str]] = []
    if m.heads % config.tp:
        r.append(("model.heads", f"heads ({m.heads}) not divisible by tp ({config.tp})"))
    if m.kv_heads_count % config.tp:
        # Key/value heads are split whole over tp ranks, never shared or cut.
        r.append(("model.kv_heads", f"kv_heads ({m.kv_heads_count}) not divisible by tp ({config.tp})"))
    if m.ffn_size % config.tp:
        r.append(("model.ffn", f"ffn size ({m.ffn_size}) not divisible by tp ({config.tp})"))
    if m.vocab % config.tp:
        r.append(("model.vocab", f"vocab ({m.vocab}) not divisible by tp ({config.tp})"))
    if m.layers % config.pp:
        r.append(("model.layers", f"layers ({m.layers}) not divisible by pp ({config.pp})"))
    if m.tie_embeddings and config.pp > 1:
        r.append(
            (
                "model.tie_embeddings",
                "tie_embeddings shares one weight between the first and last stage; use pp = 1",
            )
        )
    from tuner.models import family_of

    r += family_of(m).shape_reasons(m, config.tp, config.pp, config.sequence_parallel)
    if config.sequence_parallel and config.tp > 1 and m.seq_len % config.tp:
        r.append(
            ("model.seq_len", f"sequence_parallel: seq_len ({m.seq_len}) not divisible by tp ({config.tp})")
        )
    return r


def device_count_reason(recipe: Recipe, device: DeviceInfo) -> str | None:
    """Why the machine `device` describes cannot hold the recipe's devices (None when it can): all
    of them for a one-node recipe, each node's share for one over `hardware.nodes` machines (every
    node is taken to be like the one described: this machine, or a Ray cluster's largest node)."""
    want, per_node, nodes = recipe.hardware.devices, recipe.hardware.devices_per_node, recipe.hardware.nodes
    if nodes == 1 and want > device.count:
        return f"hardware.devices is {want} but {device.where} has {device.count} {device.family} devices"
    if per_node > device.count:
        return (
            f"hardware.devices is {want} over {nodes} nodes, {per_node} per node, but {device.where} has "
            f"{device.count} {device.family} devices"
        )
    return None


def _split_reasons(config: Config, recipe: Recipe, device: DeviceInfo) -> list[str]:
    """The parallel split against the devices, the model's shapes and the batch."""
    r: list[str] = []
    want = recipe.hardware.devices
    if config.world_size != want:
        r.append(
            f"dp*tp*pp = {config.dp}*{config.tp}*{config.pp} = {config.world_size}, "
            f"but hardware.devices is {want}"
        )
    per_node, nodes = recipe.hardware.devices_per_node, recipe.hardware.nodes
    if (too_many := device_count_reason(recipe, device)) is not None:
        r.append(too_many)
    if nodes > 1 and per_node % config.tp:
        r.append(
            f"tp ({config.tp}) must divide the devices per node ({per_node}): tensor-parallel groups "
            "stay inside a node"
        )
    r += [message for _, message in shape_reasons(config, recipe)]
    per_step = config.micro_batch_size * config.dp
    gbs = recipe.train.global_batch_size
    if gbs % per_step:
        r.append(
            f"global batch ({gbs}) not divisible by micro_batch_size*dp "
            f"({config.micro_batch_size}*{config.dp} = {per_step})"
        )
    elif config.pp > 1 and gbs // per_step < config.pp:
        r.append(
            f"pp={config.pp} needs at least {config.pp} microbatches per step, "
            f"but global batch {gbs} / (micro_batch_size*dp) gives {gbs // per_step}"
        )
    return r


def _device_reasons(config: Config, device: DeviceInfo) -> list[str]:
    """Kernels, dtypes and features the device has or lacks."""
    r: list[str] = []
    if config.attention not in device.attention_backends:
        r.append(
            f"attention={config.attention} is not available on {device.family} "
            f"(available: {', '.join(device.attention_backends)})"
        )
    if config.amp != "O0" and config.amp_dtype not in device.amp_dtypes:
        r.append(f"amp_dtype={config.amp_dtype} is not supported on {device.family} {device.name}")
    if config.tf32 and not device.supports_tf32:
        r.append(f"tf32 is not supported on {device.family} {device.name}")
    if config.compile not in device.compile_modes:
        r.append(f"compile={config.compile} is not available on {device.family}")
    if config.offload and not device.supports_offload:
        r.append(f"offload moves activations to host memory; on {device.family} they already are there")
    if config.alloc_conf != "default" and device.family not in ("cuda", "npu"):
        r.append(
            f"alloc_conf={config.alloc_conf} configures the CUDA/NPU caching allocator; {device.family} has none"
        )
    if config.pin_memory and not device.supports_pin_memory:
        r.append(f"pin_memory needs an accelerator; {device.family} has none")
    if config.dp > 1 and config.dp_shard == "ddp":
        if config.grad_compression in ("fp16", "bf16") and config.grad_compression not in device.amp_dtypes:
            r.append(f"grad_compression={config.grad_compression} is not supported on {device.family}")
        if config.grad_compression == "bf16" and device.backend != "nccl":
            # torch's bf16_compress_hook refuses any backend but NCCL (CUDA 11+, NCCL 2.10+).
            r.append(f"grad_compression=bf16 needs NCCL, not {device.backend}; use fp16 or none")
        if config.grad_compression == "powersgd" and device.backend == "hccl":
            r.append("grad_compression=powersgd is not supported with hccl")
    return r


def _attention_reasons(config: Config, recipe: Recipe, device: DeviceInfo) -> list[str]:
    """The attention kernel against the dtype it would run in and the model's head size."""
    if config.attention not in device.attention_backends:
        return []  # already refused by _device_reasons
    from tuner.models import family_of

    dtype = compute_dtype(config.amp, config.amp_dtype)
    masked = family_of(recipe.model).masked_attention(recipe.model)
    return kernel_reasons(device.family, config.attention, dtype, recipe.model.head_dim, masked)


def _combination_reasons(config: Config, device: DeviceInfo) -> list[str]:
    """Knob combinations this workload (or torch) cannot run together."""
    r: list[str] = []
    if config.dp > 1 and config.dp_shard == "fsdp" and config.pp > 1:
        r.append("dp_shard=fsdp with pp > 1 is not supported by this workload; use ddp")
    if config.amp == "O2" and config.amp_dtype == "fp16" and config.dp_shard == "fsdp" and config.dp > 1:
        r.append("amp=O2 with fp16 and fsdp needs a sharded grad scaler; use bf16 or ddp")
    if config.compile == "reduce-overhead" and (config.pp > 1 or config.tp > 1):
        r.append("compile=reduce-overhead (CUDA graphs) does not support tp or pp > 1 here")
    if config.compile == "reduce-overhead" and device.family == "cuda":
        # Seen on an H200 with torch 2.11 (BENCHMARKS "CUDA"): every such trial failed.
        r.append(
            "compile=reduce-overhead: the CUDA graphs of the per-layer compiled blocks fail in "
            "training here (a replay overwrites a layer's output still in use); use compile=default"
        )
    if config.offload and config.compile != "none":
        r.append("offload (save_on_cpu hooks) cannot be traced by torch.compile; use compile=none")
    return r
