"""A rank's model: built on the meta device by its family (`tuner.models`), then materialised
(only the parameters this rank holds after the split) on the training device and initialised
there, split-invariantly: the same seed gives the same function under every split."""

from __future__ import annotations

import torch
import torch._dynamo  # noqa: F401 - see below
from torch import nn

from tuner.models import family_of
from tuner.models.gpt_nn import GPT
from tuner.models.layers import Decoder, init_parameters
from tuner.models.llama_nn import Llama
from tuner.models.plugins import module_problem
from tuner.recipe import ModelSpec

# Building a module on the meta device runs its init ops through torch's Python decompositions,
# which import the dynamo stack. It loads here, with the rank's code, before the rank takes its
# memory baseline, so a rank's measured peak never counts that code as model memory.

__all__ = ["GPT", "Decoder", "Llama", "build_meta", "build_model", "materialize"]


def build_meta(m: ModelSpec, attention_backend: str) -> Decoder:
    """The whole model with no storage: shapes only, nothing allocated or drawn. A plugin's is
    checked against the module contract the workload relies on (`plugins.module_problem`)."""
    family = family_of(m)
    with torch.device("meta"):
        model = family.build(m, attention_backend)
    if m.family == "plugin" and (problem := module_problem(family, m, model)) is not None:
        raise ValueError(problem)
    return model


@torch.no_grad()
def materialize(model: nn.Module, spec: ModelSpec, device: torch.device, seed: int) -> None:
    """Allocate this rank's parameters on `device` (`to_empty`) and initialise them there.

    `model` may be wrapped (recompute, FSDP) and sharded (DTensor); each parameter is drawn by
    its name in the plain model, so wrappers and shards do not change the numbers."""
    model.to_empty(device=device)
    decoders = [module for module in model.modules() if isinstance(module, Decoder)]
    for decoder in decoders:
        decoder.retie()  # to_empty may hand tied weights separate storage
    init_parameters(model, seed, family_of(spec).init_rule(spec))
    for decoder in decoders:
        decoder.init_fixed()  # to_empty leaves buffers as whatever memory it got


def build_model(m: ModelSpec, attention_backend: str, seed: int, device: torch.device) -> Decoder:
    """The whole model, unsplit, initialised on `device` (one process, tests, benchmarks)."""
    model = build_meta(m, attention_backend)
    materialize(model, m, device, seed)
    return model
