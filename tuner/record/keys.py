"""The names trials and studies are stored under in Optuna (user and system attributes), defined
once. Everything that writes or reads a stored trial uses these constants, never the bare string.

A pure-constant module: trial ranks (`tuner.workload`) may import it without loading Optuna.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# ---- the public result keys (DESIGN.md): CLI --json, trial user attributes, REST -------------------
STATUS = "status"
STEP_TIME_S = "step_time_s"
STEP_TIME_SPREAD = "step_time_spread"
STEP_TIME_CI = "step_time_ci"  # relative half-width of the 95% interval of the median step time
TOKENS_PER_S = "tokens_per_s"
SAMPLES_PER_S = "samples_per_s"
TFLOPS = "tflops"
MFU = "mfu"
PEAK_MEM_ALLOCATED_BYTES = "peak_mem_allocated_bytes"
PEAK_MEM_RESERVED_BYTES = "peak_mem_reserved_bytes"
# The caching allocator's view at the peak (CUDA/NPU; None on CPU, which has no such allocator):
# bytes in live blocks, and reserved minus allocated (memory the pool holds but cannot hand out).
PEAK_MEM_ACTIVE_BYTES = "peak_mem_active_bytes"
MEM_FRAGMENTATION_BYTES = "mem_fragmentation_bytes"
ESTIMATED_PEAK_MEM_BYTES = "estimated_peak_mem_bytes"
LOSS = "loss"
ERROR = "error"
MEASURED_S = "measured_s"  # time inside the measured steps
WALL_S = "wall_s"  # launch to exit, as the executor saw it

RESULT_KEYS = (
    STATUS,
    STEP_TIME_S,
    STEP_TIME_SPREAD,
    STEP_TIME_CI,
    TOKENS_PER_S,
    SAMPLES_PER_S,
    TFLOPS,
    MFU,
    PEAK_MEM_ALLOCATED_BYTES,
    PEAK_MEM_RESERVED_BYTES,
    PEAK_MEM_ACTIVE_BYTES,
    MEM_FRAGMENTATION_BYTES,
    ESTIMATED_PEAK_MEM_BYTES,
    LOSS,
    ERROR,
    MEASURED_S,
    WALL_S,
)

# ---- evidence a trial keeps besides the result keys ----------------------------------------------
ERROR_KIND = "error_kind"  # exception class, "timeout", "budget", "worker_died", ...
LOSSES = "losses"  # of training steps warmup_steps.., same seed and data in every trial: the drift check compares them
STEP_TIMES = "step_times"  # of the measured steps
BREAKDOWN = "breakdown"  # step-time seconds by category (a profiled trial)
LOG_PATH = "log_path"
LOG_TAIL = "log_tail"
NODE = "node"
NODES = "nodes"  # distinct nodes the trial's ranks ran on
RANK_NODES = "rank_nodes"  # each rank's node id, by rank: which ranks shared a node
EVIDENCE_KEYS = (ERROR_KIND, LOSSES, STEP_TIMES, BREAKDOWN, LOG_PATH, LOG_TAIL, NODE, NODES, RANK_NODES)
WHERE_KEYS = (NODE, NODES, RANK_NODES)  # where a trial ran: listed with its result over REST

# ---- what the study driver records about a trial -------------------------------------------------
ROLE = "role"  # why the trial ran: baseline, fp32_reference, warm_start, previous_best, retry, ...
CONFIG_KEY = "config_key"  # Config.key(): duplicates share it
DEVICE_SECONDS = "device_seconds"  # wall time x devices
# Why the measured steps ended: target_ci, max_seconds, steps, max_steps, out_of_contention or behind.
MEASURE_STOP = "measure_stop"
ESTIMATOR_CALIBRATION = "estimator_calibration"
PRUNED_REASON = "pruned_reason"
DUPLICATE_OF = "duplicate_of"  # the trial whose measurement a duplicate reuses
CANCELLED = "cancelled"  # the run was stopped; its config goes back in the queue
DRIVER_DIED = "driver_died"  # the driver that owned it died; its config goes back in the queue
RETRY_OF = "retry_of"
CONFIG = "config"  # a full knob setting stored whole (older studies); newer ones rebuild it from params

# What the performance-model sampler (tuner.perf.sampler) records about each trial it saw asked.
CHOSEN_BY = "chosen_by"  # CHOSEN_BY_MODEL, CHOSEN_BY_TPE (the model fitted badly) or CHOSEN_BY_QUEUE
PREDICTED_TOKENS_PER_S = "predicted_tokens_per_s"  # the model's expectation before the run
PREDICTED_INTERVAL = "predicted_interval"  # [low, high] tokens/s, its 90% interval
PREDICTED_P_FIT = "predicted_p_fit"  # the memory model's chance the run stays within the budget
CHOSEN_BY_MODEL = "model"
CHOSEN_BY_TPE = "tpe"
CHOSEN_BY_QUEUE = "queue"  # enqueued by the driver (baseline, warm start, retry): predicted only

# Roles the driver gives the trials it queues itself.
BASELINE = "baseline"
FP32_REFERENCE = "fp32_reference"
WARM_START = "warm_start"
PREVIOUS_BEST = "previous_best"
PREVIOUS_TOP = "previous_top"
RETRY = "retry"
GRID = "grid"
ENQUEUED = "enqueued"

# ---- trial system attributes (the driver's liveness; Optuna's constraints) -----------------------
HEARTBEAT = "tuner:heartbeat"  # Optuna's heartbeat needs study.optimize; ask/tell records its own
OWNER = "tuner:owner"
# Study system attribute: the driver that drives the study now ({"owner": new_owner(), "heartbeat":
# unix time}); `tuner.resume.claim_study` keeps a second one out.
STUDY_DRIVER = "tuner:driver"
# Optuna's own system attribute: the params `enqueue_trial` gave a trial, there from the moment
# `study.ask` starts it (its params only once the sampler has answered).
FIXED_PARAMS = "fixed_params"
CONSTRAINT_PREFIX = "constraints:"  # Optuna's Trial.set_constraint(name, v) -> "constraints:<name>"
MEMORY_CONSTRAINT = "memory"

# ---- study user attributes ------------------------------------------------------------------------
RECIPE = "recipe"
RECIPE_HASH = "recipe_hash"
FINGERPRINT = "fingerprint"
FINGERPRINT_HASH = "fingerprint_hash"
# The performance model's priors for the devices the study ran on, as they measured themselves
# (`tuner.perf.priors.DevicePriors.to_dict`): a plan made elsewhere (the API host) starts from them.
DEVICE_PRIORS = "device_priors"
SPACE = "space"
OBJECTIVE = "objective"
REMEASURED_PREFIX = (
    "remeasured:"  # remeasured:<trial number> -> [tokens/s, ...] (finished trials are read-only)
)
# remeasured_ci:<trial number> -> [step_time_ci, ...]: each re-measurement's step interval, in the
# order of remeasured:<trial number> (absent for studies from before re-measurements kept theirs).
REMEASURED_CI_PREFIX = "remeasured_ci:"
REMEASURE_DEVICE_SECONDS = "remeasure_device_seconds"


def remeasured_key(trial_number: int) -> str:
    return f"{REMEASURED_PREFIX}{trial_number}"


def remeasured_ci_key(trial_number: int) -> str:
    return f"{REMEASURED_CI_PREFIX}{trial_number}"


def per_trial(attrs: Mapping[str, Any], prefix: str) -> dict[int, Any]:
    """The study attributes `prefix`<trial number>, by trial number."""
    return {
        int(k[len(prefix) :]): v
        for k, v in attrs.items()
        if k.startswith(prefix) and k[len(prefix) :].isdigit()
    }
