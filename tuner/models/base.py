"""The contract every model family implements: its recipe fields and their checks, and the
parameter and FLOP formulas the estimator, MFU and the performance model read.

This module and each family's formula module (`gpt.py`, `llama.py`) import no torch, so the study
driver can count a model it never builds. The torch side of a family (meta-device build, tensor
parallel plan, initialisation) sits in `<family>_nn.py` and loads only in a trial rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from tuner.recipe import ModelSpec


@dataclass(frozen=True)
class Requirement:
    """What a model needs installed beyond this project to be built: a module to import or an
    entry point (a plugin), from a pip `package`; `version` is the one the measured run had.
    A build's launch.sh checks each before it starts any rank."""

    what: str  # in the user's words: "transformers", "the model plugin 'tiny-moe'"
    package: str
    version: str | None = None
    module: str | None = None
    entry_point: tuple[str, str] | None = None  # (group, name)

    @property
    def install(self) -> str:
        return (
            f"pip install '{self.package}=={self.version}'" if self.version else f"pip install {self.package}"
        )


@dataclass(frozen=True)
class SavedWidths:
    """Elements per token of the tensors one block saves for backward outside its MLP and its
    attention scores, by where they sit (the estimator multiplies them by tokens and bytes)."""

    block_norms: int  # the widths the norms over the residual stream normalise, whole on every tp rank
    head_norms: int  # the queries' and keys' own norms (Qwen3, Gemma 3): split with the heads
    attention: float  # q, k, v and the attention's outputs around SDPA: split with the heads


class ModelFamily:
    """One model family (`model.family` in a recipe).

    Formulas take the recipe's `ModelSpec` and count what the family's torch module really holds
    and computes; a test checks each against a built model. Methods:
    - `ffn_size(m)`: the MLP inner width (the recipe's `ffn`, else the family's rule);
      `head_dim(m)`, `kv_heads(m)`: one head's width, the key/value heads (default: all heads);
      `gated_mlp(m)`, `rms_norm(m)`, `routed_experts(m)`: the block's kind, for what it saves
      for backward; `saved_widths(m, fused)`: the widths of what else it saves;
      `masked_attention(m)`: whether attention needs an explicit mask;
    - `block_params(m)`, `block_matmul_params(m)`: one decoder block, all / only what tensor
      parallel splits (the Linear weights);
    - `embedding_params(m)`, `head_params(m)`: what the first / last pipeline stage holds
      outside the blocks; `vocab_params(m)` the part of those split over the vocabulary under tp;
    - `attention_matmul_params(m)`: the attention's share of `block_matmul_params` (its
      projections): what selective recompute repeats;
    - `param_count(m)`: the whole model; `matmul_params(m)`: what the 6*N rule counts;
    - `flops_per_token(m, seq_len)`: model FLOPs (forward and backward) per token;
    - `recomputed_flops_per_token(m, recompute)`: the forward FLOPs recomputing one block repeats;
    - `column_parallel_inputs(m)`, `tp_collectives(m, sequence_parallel, recompute)`: what tensor
      parallelism sends per block;
    - `stage_layers(m, stage, stages)`: the decoder layers a pipeline stage owns;
    - `preload(m)`: import what `build` runs; `build(m, attention)`: the torch module, on
      whatever device is current (the workload uses `meta`); `parallelize(model, tp_mesh,
      sequence_parallel)`; `init_rule(m)`;
    - `requires(m)`: what must be installed besides this project to build it (`Requirement`).

    Each family implements `ffn_size`, `block_params`, `block_matmul_params`,
    `attention_matmul_params`, `embedding_params`, `head_params` and `vocab_params` (here they
    raise NotImplementedError). `build`, `parallelize` and `init_rule` call the same-named
    functions of `nn_module`, or are overridden. `build` returns a `tuner.models.layers.Decoder`:
    its `layers` a ModuleDict keyed by layer index ("0", "1", ...), the attributes only the
    first / last pipeline stage keeps named in `first_parts` / `last_parts`, and each block's
    class naming its attention submodule in `ATTENTION` (what selective recompute checkpoints).
    """

    name: str = ""
    # Recipe fields only this family reads (others must leave them unset).
    fields: tuple[str, ...] = ()
    nn_module: str = ""  # the module holding the torch side

    # --- recipe fields ---------------------------------------------------------------------
    def check_field(self, field: str, value: Any, values: dict[str, Any]) -> str | None:
        """A message when `value` of `field` is wrong given the fields before it, else None."""
        if value is not None and field not in self.fields:
            owners = [f.name for f in _families() if field in f.fields]
            return f"only the {', '.join(owners)} family has {field}; remove it or set model.family"
        return None

    def ffn_size(self, m: ModelSpec) -> int:
        raise NotImplementedError

    def head_dim(self, m: ModelSpec) -> int:
        """Each attention head's width: the width over the heads, unless the model sets its own
        (Qwen3: 16 heads of 128 over a width of 1,024)."""
        return m.hidden // m.heads

    def attention_widths(self, m: ModelSpec) -> tuple[int, int]:
        """(query/key, value) width of one head: both `head_dim`, except in multi-head latent
        attention (MiniCPM3, DeepSeek-V3), whose queries and keys are wider than its values."""
        return self.head_dim(m), self.head_dim(m)

    def kv_heads(self, m: ModelSpec) -> int:
        return m.heads

    def gated_mlp(self, m: ModelSpec) -> bool:
        """Whether the MLP is gated (SwiGLU: down(act(gate x) * up x), three matrices) rather
        than down(act(up x)): it saves twice the inner-width tensors for backward."""
        return False

    def routed_experts(self, m: ModelSpec) -> tuple[int, int, int, int] | None:
        """An MoE block's (experts, experts per token, expert width, shared expert width); None
        for a dense block."""
        return None

    def masked_attention(self, m: ModelSpec) -> bool:
        """Whether some attention layer takes an explicit mask at the recipe's sequence length
        (a sliding window shorter than it) rather than running plain causal."""
        return self.masked_share(m) > 0

    def masked_share(self, m: ModelSpec) -> float:
        """The share of the attention layers that take an explicit mask at the recipe's sequence
        length (`masked_attention`); a fused kernel's backward keeps that mask, in the compute
        dtype, for each of them."""
        return 0.0

    def rms_norm(self, m: ModelSpec) -> bool:
        """Whether the blocks normalise with RMSNorm (which saves fp32 copies of its input and
        output whatever the dtype) rather than LayerNorm (its input)."""
        return False

    def saved_widths(self, m: ModelSpec, fused: bool) -> SavedWidths:
        """What the tuner's own blocks (gpt, llama) save, `fused` kernel or not: two norms over the
        hidden states; q, and k and v repeated to every head (llama's module repeats them before
        SDPA), SDPA's output and the output projection's input, each hidden wide. The math kernel
        keeps no output of its own, one width less (5% of a llama block), left as a margin."""
        return SavedWidths(block_norms=2 * m.hidden, head_norms=0, attention=5 * m.hidden)

    # --- formulas --------------------------------------------------------------------------
    def block_params(self, m: ModelSpec) -> int:
        raise NotImplementedError

    def block_matmul_params(self, m: ModelSpec) -> int:
        raise NotImplementedError

    def embedding_params(self, m: ModelSpec) -> int:
        raise NotImplementedError

    def head_params(self, m: ModelSpec) -> int:
        raise NotImplementedError

    def vocab_params(self, m: ModelSpec, first: bool, last: bool) -> int:
        """Parameters split over the vocabulary under tp (token embedding, output projection)
        on a stage that is `first` and/or `last`; a tied pair counts once."""
        raise NotImplementedError

    def param_count(self, m: ModelSpec) -> int:
        """All parameters of the model (tied weights once)."""
        return self.embedding_params(m) + m.layers * self.block_params(m) + self.head_params(m)

    def matmul_params(self, m: ModelSpec) -> int:
        """Parameters that take part in matmuls: the blocks' Linears and the output projection."""
        return m.layers * self.block_matmul_params(m) + m.hidden * m.vocab

    def attention_score_flops_per_token(self, m: ModelSpec, seq_len: int) -> float:
        """QK^T and the weighted sum of V, forward and backward (6 * layers * heads * seq * (the
        query/key width + the value width), `attention_widths`)."""
        return 6.0 * m.layers * m.heads * sum(self.attention_widths(m)) * seq_len

    def flops_per_token(self, m: ModelSpec, seq_len: int | None = None) -> float:
        """Model FLOPs (forward + backward) per token, PaLM-style: 6N plus attention scores.

        Recompute is not counted: MFU measures useful model work, not work repeated to save memory.
        """
        s = m.seq_len if seq_len is None else seq_len
        return 6.0 * self.matmul_params(m) + self.attention_score_flops_per_token(m, s)

    def attention_matmul_params(self, m: ModelSpec) -> int:
        raise NotImplementedError

    def column_parallel_inputs(self, m: ModelSpec) -> int:
        """Column-parallel Linears per block under tensor parallelism: each all-reduces its
        input's gradient in backward (without sequence parallelism). Two: a fused input
        projection for attention and one for the MLP; families with separate q, k, v or gate
        and up projections have more."""
        return 2

    def tp_collectives(self, m: ModelSpec, sequence_parallel: bool, recompute: str) -> tuple[int, int]:
        """(all-reduces, all-gathers and reduce-scatters) of one block activation per block of one
        micro-batch's forward and backward under tensor parallelism, as DTensor issues them
        (torch's CommDebugMode counts exactly these on gpt, llama and an hf Qwen2,
        tests/test_perf_model.py). Without sequence parallelism: an all-reduce after each
        row-parallel output in forward, one per column-parallel input in backward, and under full
        recompute the attention's again (the MLP's output is past the checkpoint's early stop).
        With it: an all-gather into and a reduce-scatter out of attention and MLP, forward and
        backward, an all-gather more under selective recompute (attention's input), and under
        full recompute both all-gathers and attention's reduce-scatter."""
        if sequence_parallel:
            return 0, 8 + {"none": 0, "selective": 1, "full": 3}[recompute]
        return 2 + self.column_parallel_inputs(m) + (1 if recompute == "full" else 0), 0

    def recomputed_flops_per_token(self, m: ModelSpec, recompute: str) -> float:
        """Forward FLOPs per token that recomputing one block repeats: all of it (`full`) or its
        attention (`selective`), up to but not including the region's last projection (the MLP's
        down projection, or attention's output projection). PyTorch's non-reentrant checkpoint
        stops recomputing once the tensors backward needs are back, and that projection's output
        is not one of them: torch's FlopCounterMode counts exactly this on gpt, llama and an hf
        Qwen2 (tests/test_estimate.py)."""
        if recompute == "none":
            return 0.0
        h, s, (qk, v) = m.hidden, m.seq_len, self.attention_widths(m)
        scores = 2.0 * m.heads * (qk + v) * s  # QK^T and AV
        if recompute == "selective":  # the projections and scores, not the output projection
            return 2.0 * self.attention_matmul_params(m) + scores - 2.0 * m.heads * v * h
        return 2.0 * self.block_matmul_params(m) + scores - 2.0 * h * self.ffn_size(m)

    def stage_layers(self, m: ModelSpec, stage: int, stages: int) -> range:
        """Decoder layers of pipeline stage `stage` of `stages` (the rules make pp divide layers)."""
        per = m.layers // stages
        return range(stage * per, (stage + 1) * per)

    def shape_reasons(self, m: ModelSpec, tp: int, pp: int, sequence_parallel: bool) -> list[tuple[str, str]]:
        """(recipe field, reason) for splits this family cannot run, beyond the shared shape rules."""
        return []

    def requires(self, m: ModelSpec) -> list[Requirement]:
        """What a machine needs installed, beyond this project, to build this model."""
        return []

    # --- torch side (loaded lazily) --------------------------------------------------------
    def _nn(self) -> Any:
        import importlib

        return importlib.import_module(self.nn_module)

    def preload(self, m: ModelSpec) -> None:
        """Import the code `build` will run, so that a CPU rank's memory baseline, read after
        this, counts what the model holds and not the libraries' code and data. A plugin that
        overrides `build` and names no `nn_module` has nothing to import here."""
        if self.nn_module:
            self._nn()

    def build(self, m: ModelSpec, attention: str = "math") -> nn.Module:
        return self._nn().build(m, attention)

    def parallelize(self, model: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
        """Tensor parallel over `tp_mesh`; the logits come out sharded over the vocabulary."""
        self._nn().parallelize(model, tp_mesh, sequence_parallel)

    def init_rule(self, m: ModelSpec) -> Any:
        """canonical parameter name -> ("normal", std) | ("ones", 0) | ("zeros", 0)."""
        return self._nn().init_rule(m)


def kv_heads_reason(kv_heads: int, heads: int) -> str | None:
    """Why `kv_heads` key/value heads cannot serve `heads` query heads, else None."""
    if heads % kv_heads:
        return (
            f"kv_heads ({kv_heads}) must divide heads ({heads}): each key/value head serves a whole "
            "group of query heads; pick a divisor of heads"
        )
    return None


_REGISTRY: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    _REGISTRY[family.name] = family
    return family


def _families() -> list[ModelFamily]:
    return list(_REGISTRY.values())


def get_family(name: str) -> ModelFamily:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(_REGISTRY)}") from None
