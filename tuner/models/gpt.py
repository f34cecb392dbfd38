"""The GPT-2-style family's recipe rules and formulas (no torch; the module is `gpt_nn`).

Learned token and position embeddings, `layers` pre-norm blocks (LayerNorm with bias,
bias-free Linear layers: fused qkv, attention output, MLP up and down with GELU), a final
LayerNorm and an untied, bias-free LM head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuner.models.base import ModelFamily, register

if TYPE_CHECKING:
    from tuner.recipe import ModelSpec


class GPTFamily(ModelFamily):
    name = "gpt"
    fields = ()
    nn_module = "tuner.models.gpt_nn"

    def ffn_size(self, m: ModelSpec) -> int:
        return m.ffn if m.ffn is not None else 4 * m.hidden

    def attention_matmul_params(self, m: ModelSpec) -> int:
        return 4 * m.hidden * m.hidden

    def block_matmul_params(self, m: ModelSpec) -> int:
        return self.attention_matmul_params(m) + 2 * m.hidden * self.ffn_size(m)

    def block_params(self, m: ModelSpec) -> int:
        return self.block_matmul_params(m) + 2 * (2 * m.hidden)  # two LayerNorms, weight and bias

    def embedding_params(self, m: ModelSpec) -> int:
        return m.vocab * m.hidden + m.seq_len * m.hidden

    def head_params(self, m: ModelSpec) -> int:
        return 2 * m.hidden + m.hidden * m.vocab

    def vocab_params(self, m: ModelSpec, first: bool, last: bool) -> int:
        return m.vocab * m.hidden * (int(first) + int(last))


GPT = register(GPTFamily())
