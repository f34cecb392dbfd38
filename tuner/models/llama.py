"""The Llama-3 family's recipe rules and formulas (no torch; the module is `llama_nn`).

torchtitan's layout: token embedding, `layers` pre-norm blocks (RMSNorm; attention with
separate bias-free wq, wk, wv, wo and grouped-query heads, `kv_heads` of them; rotary position
embeddings with base `rope_theta`; SwiGLU feed-forward w2(silu(w1 x) * w3 x)), a final RMSNorm
and an output projection, untied unless `tie_embeddings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tuner.models.base import ModelFamily, kv_heads_reason, register

if TYPE_CHECKING:
    from tuner.recipe import ModelSpec

DEFAULT_ROPE_THETA = 500000.0
DEFAULT_FFN_MULTIPLE_OF = 256


class LlamaFamily(ModelFamily):
    name = "llama"
    fields = ("kv_heads", "ffn_multiple_of", "rope_theta", "tie_embeddings")
    nn_module = "tuner.models.llama_nn"

    def check_field(self, field: str, value: Any, values: dict[str, Any]) -> str | None:
        if field == "kv_heads" and value is not None and "heads" in values:
            return kv_heads_reason(value, values["heads"])
        return super().check_field(field, value, values)

    def kv_heads(self, m: ModelSpec) -> int:
        return m.kv_heads if m.kv_heads is not None else m.heads

    def rope_theta(self, m: ModelSpec) -> float:
        return m.rope_theta if m.rope_theta is not None else DEFAULT_ROPE_THETA

    def tied(self, m: ModelSpec) -> bool:
        return bool(m.tie_embeddings)

    def ffn_size(self, m: ModelSpec) -> int:
        """Llama's rule: 8/3 of hidden (2/3 of 4 * hidden), rounded up to `ffn_multiple_of`."""
        if m.ffn is not None:
            return m.ffn
        multiple = m.ffn_multiple_of or DEFAULT_FFN_MULTIPLE_OF
        inner = int(2 * (4 * m.hidden) / 3)
        return multiple * ((inner + multiple - 1) // multiple)

    def gated_mlp(self, m: ModelSpec) -> bool:
        return True

    def rms_norm(self, m: ModelSpec) -> bool:
        return True

    def column_parallel_inputs(self, m: ModelSpec) -> int:
        return 5  # wq, wk, wv; w1, w3

    def attention_matmul_params(self, m: ModelSpec) -> int:
        kv_width = self.kv_heads(m) * m.head_dim
        return 2 * m.hidden * m.hidden + 2 * m.hidden * kv_width  # wq, wo; wk, wv

    def block_matmul_params(self, m: ModelSpec) -> int:
        return self.attention_matmul_params(m) + 3 * m.hidden * self.ffn_size(m)  # w1, w2, w3

    def block_params(self, m: ModelSpec) -> int:
        return self.block_matmul_params(m) + 2 * m.hidden  # two RMSNorm weights

    def embedding_params(self, m: ModelSpec) -> int:
        return m.vocab * m.hidden

    def head_params(self, m: ModelSpec) -> int:
        return m.hidden + (0 if self.tied(m) else m.hidden * m.vocab)

    def vocab_params(self, m: ModelSpec, first: bool, last: bool) -> int:
        if self.tied(m) and first and last:
            return m.vocab * m.hidden
        return m.vocab * m.hidden * (int(first) + int(last))


LLAMA = register(LlamaFamily())
