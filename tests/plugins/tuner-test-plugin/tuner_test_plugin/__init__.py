"""A model plugin as an operator would ship one: `tiny-moe`, a decoder whose MLP is a soft
mixture of `experts` SwiGLU-free expert MLPs (every token goes through every expert, weighted by
a softmax gate). Formulas count exactly what `build` makes; tensor parallel is not offered."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tuner.models.plugins import PluginFamily


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    layers: int = Field(2, ge=1, le=64, description="Decoder blocks.")
    hidden: int = Field(64, ge=8, le=4096, description="Model width.")
    heads: int = Field(4, ge=1, le=64, description="Attention heads; divide hidden.")
    vocab: int = Field(256, ge=2, le=262144, description="Vocabulary size.")
    experts: int = Field(4, ge=1, le=64, description="Expert MLPs per block.")
    expert_hidden: int = Field(128, ge=1, le=16384, description="Inner width of one expert.")

    @model_validator(mode="after")
    def _heads(self) -> Options:
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        return self


class TinyMoE(PluginFamily):
    options_model = Options
    description = "Decoder with soft-gated expert MLPs (the tuner's test plugin)."

    def sizes(self, o: Options) -> dict[str, int]:
        return {"layers": o.layers, "hidden": o.hidden, "heads": o.heads, "vocab": o.vocab}

    def _o(self, m) -> Options:
        return self.options(m)

    def ffn_size(self, m) -> int:
        return self._o(m).expert_hidden

    def attention_matmul_params(self, m) -> int:
        return 4 * m.hidden * m.hidden  # qkv and the output projection

    def block_matmul_params(self, m) -> int:
        o = self._o(m)
        return (
            self.attention_matmul_params(m)
            + m.hidden * o.experts
            + 2 * o.experts * m.hidden * o.expert_hidden
        )

    def block_params(self, m) -> int:
        return self.block_matmul_params(m) + 2 * m.hidden  # two RMSNorm weights

    def embedding_params(self, m) -> int:
        return m.vocab * m.hidden

    def head_params(self, m) -> int:
        return m.hidden + m.hidden * m.vocab

    def vocab_params(self, m, first: bool, last: bool) -> int:
        return m.vocab * m.hidden * (int(first) + int(last))

    def shape_reasons(self, m, tp: int, pp: int, sequence_parallel: bool):
        return [("model.plugin", "tiny-moe has no tensor-parallel plan; use tp = 1")] if tp > 1 else []

    def build(self, m, attention: str = "math"):
        from tuner_test_plugin.nn import TinyMoEModel

        return TinyMoEModel(m, self._o(m), attention)

    def parallelize(self, model, tp_mesh, sequence_parallel: bool) -> None:
        raise ValueError("tiny-moe has no tensor-parallel plan")

    def init_rule(self, m):
        def rule(name: str) -> tuple[str, float]:
            return ("ones", 0.0) if name.endswith("norm.weight") else ("normal", 0.02)

        return rule
