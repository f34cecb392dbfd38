"""Model plugins as an operator might ship them, each keeping or breaking one rule of the plugin
contract (`tuner.models.plugins`): an installed distribution (the dist-info beside this file) whose
entry points build on the test plugin `tiny-moe` (tests/plugins/tuner-test-plugin)."""

from __future__ import annotations

from pydantic import Field
from torch import nn
from tuner_test_plugin import Options, TinyMoE

from tuner.models.plugins import PluginFamily


class GroupedOptions(Options):
    kv_heads: int = Field(2, ge=1, description="Key/value heads.")


class GroupedQuery(TinyMoE):
    """sizes() returns kv_heads, as the plugin docs allow."""

    options_model = GroupedOptions

    def sizes(self, o: GroupedOptions) -> dict[str, int]:
        return {**super().sizes(o), "kv_heads": o.kv_heads}


class NoReturn(TinyMoE):
    def sizes(self, o: Options) -> dict[str, int]:
        {"layers": o.layers, "hidden": o.hidden, "heads": o.heads, "vocab": o.vocab}  # noqa: B018 - the bug: no return


class NoVocab(TinyMoE):
    def sizes(self, o: Options) -> dict[str, int]:
        return {"layers": o.layers, "hidden": o.hidden, "heads": o.heads}


class NoAttentionFormula(TinyMoE):
    """Every formula but attention_matmul_params (what recompute's FLOPs read)."""

    attention_matmul_params = PluginFamily.attention_matmul_params

    def block_matmul_params(self, m) -> int:
        o = self._o(m)
        return 4 * m.hidden * m.hidden + m.hidden * o.experts + 2 * o.experts * m.hidden * o.expert_hidden


class NoBuild(TinyMoE):
    """Formulas only: no nn_module and the base's build, parallelize and init_rule."""

    build = PluginFamily.build
    parallelize = PluginFamily.parallelize
    init_rule = PluginFamily.init_rule


class NotADecoder(TinyMoE):
    def build(self, m, attention: str = "math"):
        return nn.Sequential(*super().build(m, attention).layers.values())


class NoAttentionName(TinyMoE):
    """Blocks that do not say which submodule is their attention."""

    def build(self, m, attention: str = "math"):
        model = super().build(m, attention)
        for block in model.layers.values():
            block.__class__ = type("PlainBlock", (type(block),), {"ATTENTION": None})
        return model
