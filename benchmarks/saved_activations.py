"""What one decoder layer of an hf model saves for backward, against the estimator's rule for it.

Builds the model twice on the CPU (one layer, two layers) from a tiny config of each model type,
runs one forward and backward under torch's saved-tensor hooks (each storage counted once, the
weights not counted), with the inputs a recompute checkpoint keeps by keyword (which no hook
sees), and prints the second layer's bytes beside `tuner.estimate`'s per-layer figure, per recompute mode.
Nothing is downloaded.

    python benchmarks/saved_activations.py qwen2 mistral mixtral qwen3_moe
    python benchmarks/saved_activations.py mixtral --set num_local_experts=8 --set num_experts_per_tok=2
    python benchmarks/saved_activations.py qwen3 --set head_dim=32 --attention flash
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils._pytree import tree_leaves

from tuner.config import Config
from tuner.devices import describe
from tuner.estimate import _layer_bytes
from tuner.models.hf import _config_class, _declared
from tuner.recipe import recipe_from_dict
from tuner.workload.apply import Checkpointed, apply_recompute
from tuner.workload.model import build_model

SIZES = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256, "pad_token_id": 0}
OPTIONAL = {"num_key_value_heads": 2, "intermediate_size": 128, "moe_intermediate_size": 128}
BATCH, SEQ = 4, 32


def _recipe(model_type: str, layers: int, extra: dict):
    declared = _declared(_config_class(model_type))
    config = {"model_type": model_type, **SIZES, "num_hidden_layers": layers}
    config |= {k: v for k, v in OPTIONAL.items() if k in declared} | extra
    return recipe_from_dict({"name": "saved", "model": {"family": "hf", "seq_len": SEQ, "config": config},
                             "train": {"global_batch_size": BATCH}, "hardware": {"device": "cpu", "devices": 1}})  # fmt: skip


def saved_bytes(model_type: str, layers: int, mode: str, extra: dict, attention: str = "math") -> int:
    net = build_model(_recipe(model_type, layers, extra).model, attention, 0, torch.device("cpu"))
    apply_recompute(net, mode)
    # Weights are saved for backward too (a Linear keeps its weight): they are the model's, not
    # activations, and the estimator counts them apart.
    seen: set[tuple[int, int]] = {
        (p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in net.parameters()
    }
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
        return t

    def keep_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        # A non-reentrant checkpoint saves its positional inputs as tensors (the hook sees them)
        # but holds its keyword ones by reference until the recompute: transformers' layers call
        # self_attn(hidden_states=...), so selective recompute keeps the attention's input so.
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                pack(t)

    for module in net.modules():
        if isinstance(module, Checkpointed):
            module.register_forward_pre_hook(keep_inputs, with_kwargs=True)
    tokens = torch.randint(256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(tokens).sum().backward()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_types", nargs="+", help="hf model types, e.g. qwen2 mixtral")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config key (JSON value)"
    )
    parser.add_argument("--attention", default="math", help="the SDPA kernel: math, flash, efficient")
    args = parser.parse_args()
    extra = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    cpu = describe("cpu")
    print(f"{'model_type':12} {'recompute':9} {'measured':>10} {'estimated':>10} {'error':>7}")
    for model_type in args.model_types:
        rec = _recipe(model_type, 2, extra)
        for mode in ("none", "selective", "full"):
            one, two = (saved_bytes(model_type, n, mode, extra, args.attention) for n in (1, 2))
            config = Config(micro_batch_size=BATCH, recompute=mode, attention=args.attention)
            estimated = _layer_bytes(rec, config, cpu)[mode]
            measured = two - one
            print(f"{model_type:12} {mode:9} {measured:10d} {estimated:10d} {estimated / measured - 1:+7.1%}")


if __name__ == "__main__":
    main()
