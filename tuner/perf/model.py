"""The step-time model: compute over the device's peak at a fitted efficiency, memory-bound
kernels over a fitted memory bandwidth, exposed
communication over a fitted link, pipeline bubble, recompute's extra forward, host work per unit,
times learned multipliers for what no formula sees (compile, loader workers, affinity, the
attention kernel). `features` turns configs into arrays; `predict_log` is log step time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tuner.config import Config
from tuner.perf.priors import DevicePriors
from tuner.perf.workload import StepWork


@dataclass(frozen=True)
class Coef:
    name: str
    prior_sd: float  # of the coefficient (log units, or logit for the overlap)


# The physical coefficients, in this order; prior means come from `DevicePriors`.
PHYSICAL = (
    Coef("log_efficiency", 0.8),  # share of the dtype's peak a large matmul reaches
    Coef("log_half_tokens", 1.5),  # tokens per micro-batch and rank at which it reaches half that
    Coef("log_bandwidth", 1.0),
    Coef("log_latency", 2.0),  # per collective (all-reduce, gather, scatter)
    Coef("overlap_logit", 1.5),  # share of DDP/FSDP traffic hidden behind backward
    Coef("log_host_unit", 1.2),
    # Autocast's matmul speed (amp O1 and O2 alike: the same kernels in the same dtype) relative
    # to what the dtype's peak implies, and O2's on top of it (weights kept in the low dtype: no
    # per-op casts). One shared term, so that a trial at either level teaches the model about
    # both: fitted to the four gpt tables whole, O2's own term came to -0.01, -0.02, -0.17 and
    # -0.52 (BENCHMARKS section 11), and with a term each, five random trials left one level at
    # its prior for two thirds of a table's configs.
    Coef("log_autocast", 0.6),
    Coef("amp_O2", 0.25),
    Coef("log_mem_bandwidth", 1.0),  # what memory-bound kernels reach (bytes/s)
    # A pipeline's point-to-point send or receive: one message to one peer, no reduction and no
    # rendezvous of the whole group, so far cheaper than a collective (gloo on this project's
    # CPUs: 0.04 ms against 0.7-4 ms for a small all-reduce). With one latency for both, pp=2
    # configs ran 7-21% faster than modelled (BENCHMARKS section 11).
    Coef("log_p2p_latency", 2.0),
)

# Learned log multipliers of the whole step for knob values no formula covers, each against the
# plain default (math attention, no compile, foreach, ...). Prior mean 0: no effect until measured.
MULTIPLIERS: tuple[tuple[str, object], ...] = (
    ("attention", "flash"),
    ("attention", "efficient"),
    ("attention", "cudnn"),
    ("attention", "npu_fusion"),
    ("compile", "default"),
    ("compile", "max-autotune"),
    ("compile", "reduce-overhead"),
    ("optimizer_impl", "for_loop"),
    ("optimizer_impl", "fused"),
    ("cpu_affinity", "per_rank"),
    ("loader_workers", "any"),
    ("pin_memory", True),
    ("offload", True),
    ("grad_compression", "fp16"),
    ("grad_compression", "bf16"),
    ("grad_compression", "powersgd"),
    ("pp_schedule", "gpipe"),
    ("dp_shard", "fsdp"),
)
MULTIPLIER_SD = 0.35
# Prior means that are not 0: a DDP communication hook adds kernels on every bucket (casts, or
# PowerSGD's low-rank matmuls), which a traffic-only formula would otherwise count as free.
MULTIPLIER_PRIOR = {
    ("grad_compression", "fp16"): 0.03,
    ("grad_compression", "bf16"): 0.03,
    ("grad_compression", "powersgd"): 0.08,
}

COEF_NAMES = tuple(c.name for c in PHYSICAL) + tuple(f"x:{k}={v}" for k, v in MULTIPLIERS)


def prior(priors: DevicePriors) -> tuple[np.ndarray, np.ndarray]:
    """(mean, sd) of every coefficient, in `COEF_NAMES` order."""
    mean = [
        math.log(priors.efficiency),
        math.log(priors.half_tokens),
        math.log(priors.bandwidth),
        math.log(priors.latency),
        0.0,
        math.log(priors.host_unit_s),
        priors.log_autocast,
        0.0,
        math.log(priors.mem_bandwidth),
        math.log(priors.p2p_latency),
    ]
    sd = [c.prior_sd for c in PHYSICAL]
    mean += [MULTIPLIER_PRIOR.get(m, 0.0) for m in MULTIPLIERS]
    sd += [MULTIPLIER_SD] * len(MULTIPLIERS)
    return np.array(mean), np.array(sd)


def _active(c: Config, knob: str, value: object) -> bool:
    """Whether the normalized config `c` has the multiplier's knob value (in effect)."""
    if knob == "loader_workers":
        return c.loader_workers > 0
    if knob == "pp_schedule":
        return c.pp > 1 and c.pp_schedule == value
    if knob == "dp_shard":
        return c.dp > 1 and c.dp_shard == value
    return getattr(c, knob) == value


def _dtype(config: Config) -> str:
    if config.amp == "O0":
        return "tf32" if config.tf32 else "fp32"
    return config.amp_dtype


@dataclass(frozen=True)
class Features:
    """The model's inputs for a batch of configs, one row each."""

    cols: dict[str, np.ndarray]
    multipliers: np.ndarray  # rows x len(MULTIPLIERS), 0/1

    def __len__(self) -> int:
        return len(self.cols["n_micro"])

    def take(self, index: Sequence[int] | np.ndarray) -> Features:
        idx = np.asarray(index, dtype=int)
        return Features({k: v[idx] for k, v in self.cols.items()}, self.multipliers[idx])

    @staticmethod
    def concat(parts: Sequence[Features]) -> Features:
        cols = {k: np.concatenate([p.cols[k] for p in parts]) for k in parts[0].cols}
        return Features(cols, np.concatenate([p.multipliers for p in parts]))


def features(works: Sequence[StepWork], configs: Sequence[Config], priors: DevicePriors) -> Features:
    def col(values) -> np.ndarray:
        return np.array(list(values), dtype=float)

    cols = {
        "tokens": col(w.tokens for w in works),
        "n_micro": col(w.microbatches for w in works),
        "micro_tokens": col(w.micro_tokens for w in works),
        "flops_micro": col(w.flops_micro for w in works),
        "peak": col(priors.peak(_dtype(c), c.world_size) for c in configs),
        "units": col(w.units_micro for w in works),
        # Memory-bound bytes over the rank's threads (CPU) or devices: what one bandwidth unit moves.
        "mem_bytes": col(w.mem_bytes_micro / priors.threads(w.ranks) for w in works),
        "opt_bytes": col(w.opt_bytes / priors.threads(w.ranks) for w in works),
        # Offloaded activations over the host link, at the prior's speed (seconds per micro-batch).
        "offload_s": col(
            w.offload_bytes_micro / priors.host_link[0 if c.pin_memory else 1]
            for w, c in zip(works, configs, strict=True)
        ),
        "tp_msgs": col(w.tp_messages_micro for w in works),
        "tp_bytes": col(w.tp_bytes_micro for w in works),
        "pp_msgs": col(w.pp_messages for w in works),
        "pp_bytes": col(w.pp_bytes for w in works),
        "dp_msgs": col(w.dp_messages for w in works),
        "dp_bytes": col(w.dp_bytes for w in works),
        "bubble": col(w.bubble_factor for w in works),
        # The average stage's work over the busiest one's (1 without a pipeline).
        "balance": col(1.0 / (w.pp * w.busiest_share) for w in works),
        "oversub": col(priors.oversubscription(w.ranks) for w in works),
        # A data-parallel group larger than a node crosses nodes: its link is the slower one.
        "dp_link": col(priors.cross_node_share if w.ranks > priors.node_devices else 1.0 for w in works),
        "autocast": col(c.amp in ("O1", "O2") for c in configs),
        # Where the low dtype's lone matmul is far faster than fp32's, autocast's start is capped.
        "autocast_offset": col(
            priors.autocast_offset(_dtype(c)) if c.amp in ("O1", "O2") else 0.0 for c in configs
        ),
        "amp_O2": col(c.amp == "O2" for c in configs),
    }
    # Normalized once per config, not once per multiplier: a plan ranks thousands of configs.
    normal = [c.normalized() for c in configs]
    mult = np.array([[_active(c, k, v) for k, v in MULTIPLIERS] for c in normal], dtype=float)
    return Features(cols, mult.reshape(len(configs), len(MULTIPLIERS)))


def predict_log(theta: np.ndarray, f: Features) -> np.ndarray:
    """Log step time (s) of every row under coefficients `theta` (COEF_NAMES order)."""
    c = f.cols
    eff, half, bw, lat, overlap, host, autocast, o2, mem_bw, p2p = theta[: len(PHYSICAL)]
    speed = c["peak"] * np.exp(eff + (autocast + c["autocast_offset"]) * c["autocast"] + o2 * c["amp_O2"])
    speed = speed * c["micro_tokens"] / (c["micro_tokens"] + math.exp(half))
    # One micro-batch on the busiest rank: matmuls at their speed, memory-bound kernels at the
    # memory's, host work per unit.
    work = (
        c["flops_micro"] / speed
        + c["mem_bytes"] / math.exp(mem_bw)
        + c["units"] * math.exp(host)
        + c["offload_s"]
    )
    # Ranks that share cores (more CPU ranks than cores: `oversub` > 1) queue for them. The step
    # then takes at least all ranks' work over the cores, and a pipeline stage's idle time is
    # another stage's turn, so the bubble and the queue do not compound. Each message waits for
    # its peers' turns on the cores too. With a core per rank (oversub 1) both reduce to the
    # plain schedule: the bubble times the busiest stage, messages at the link's speed.
    pace = np.maximum(c["bubble"], c["oversub"] * c["balance"])
    share = c["oversub"]
    tp = (c["tp_msgs"] * math.exp(lat) + c["tp_bytes"] / math.exp(bw)) * share
    pp = (c["pp_msgs"] * math.exp(p2p) + c["pp_bytes"] / math.exp(bw)) * share
    # The optimizer steps once, after the last micro-batch (no overlap with the schedule).
    pipeline = (
        c["n_micro"] * (work * pace + tp * c["bubble"]) + pp + c["opt_bytes"] / math.exp(mem_bw) * share
    )
    hidden = 1.0 / (1.0 + math.exp(-overlap))
    dp = c["dp_msgs"] * math.exp(lat) + c["dp_bytes"] / (math.exp(bw) * c["dp_link"])
    return np.log(pipeline + dp * share * (1 - hidden)) + f.multipliers @ theta[len(PHYSICAL) :]
