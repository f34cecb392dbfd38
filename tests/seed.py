"""Synthetic tuning jobs for the tests and the load benchmarks (not shipped with the service): a job
row plus an Optuna study of plausible trials (real knob params from the CPU space, OOMs, errors),
written in bulk through the table declarations the readers use (`tuner.optuna_tables`)."""

from __future__ import annotations

import datetime as dt
import json
import math
import random
from typing import Any

from sqlalchemy import func, insert, select, text

from tuner import optuna_tables as tables
from tuner.db import Job, JobEvent, session_scope, utcnow
from tuner.record.snapshot import snapshot_study
from tuner.result import BREAKDOWN_CATEGORIES as CATEGORIES

TINY = {
    "name": "gpt-tiny",
    "model": {"family": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 2048},
    "hardware": {"device": "cpu", "devices": 2},
}


class _RecordingTrial:
    """Stands in for an Optuna trial in `SearchSpace.suggest`, so seeded params are exactly what a
    real study records (the split label, single-choice dp/tp/pp, conditional knobs)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.params: dict[str, Any] = {}
        self.choices: dict[str, tuple[Any, ...]] = {}
        self._fixed_params: dict[str, Any] = {}  # knobs that follow from earlier choices, as in Optuna

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        value = self._fixed_params[name] if name in self._fixed_params else self.rng.choice(choices)
        self.params[name] = value
        self.choices[name] = tuple(choices)
        return value


def _measure(config: Any, rng: random.Random, base: float) -> dict[str, Any]:
    """Plausible metrics: bigger micro-batches and compile help, recompute costs time, saves memory."""
    mbs = config.micro_batch_size
    speed = base * (1 + 0.35 * math.log2(mbs)) * (1.25 if config.compile != "none" else 1.0)
    speed *= {"none": 1.0, "selective": 0.92, "full": 0.75}[config.recompute]
    speed *= {"O0": 1.0, "O1": 1.1, "O2": 1.15}[config.amp] * rng.uniform(0.9, 1.1)
    act = 40e6 * mbs * {"none": 1.0, "selective": 0.6, "full": 0.25}[config.recompute]
    peak = int(30e6 + act * rng.uniform(0.95, 1.1))
    estimated = int(30e6 + act)
    out: dict[str, Any] = {"peak_mem_allocated_bytes": peak, "estimated_peak_mem_bytes": estimated}
    if mbs >= 16 and config.recompute == "none" and rng.random() < 0.5:
        return {
            **out,
            "status": "oom",
            "error": f"peak {peak / 2**20:.0f} MiB exceeds the memory budget",
            "log_tail": "RuntimeError: out of memory (memory budget exceeded)",
        }
    if rng.random() < 0.02:
        return {
            **out,
            "status": "error",
            "error": "RuntimeError: gloo allreduce timed out",
            "log_tail": "Traceback (most recent call last):\n  ...\nRuntimeError: gloo allreduce timed out",
        }
    step = 16 * 128 / speed
    weights = [0.55, 0.15, 0.12 if config.dp > 1 else 0.02, 0.08, 0.1]
    total = sum(weights)
    return {
        **out,
        "status": "ok",
        "tokens_per_s": speed,
        "samples_per_s": speed / 128,
        "step_time_s": step,
        "step_time_spread": rng.uniform(0.01, 0.08),
        "mfu": min(0.9, speed / 2e5),
        "peak_mem_reserved_bytes": int(peak * 1.1),
        "loss": 7.6 + rng.uniform(-0.01, 0.01),
        "breakdown": {c: step * w / total for c, w in zip(CATEGORIES, weights, strict=True)},
    }


def _evidence(config: Any, metrics: dict[str, Any], rng: random.Random, tid: int) -> dict[str, Any]:
    """What `tuner.study` records next to the metrics of a real trial: per-step losses and times,
    wall time, the log path and its last 40 lines (the bulk of a trial's stored bytes)."""
    steps = 5
    step = metrics.get("step_time_s") or 0.05
    times = [step * rng.uniform(0.97, 1.05) for _ in range(steps)]
    wall = 4.0 + sum(times) * 3
    lines = [f"[rank{r}] rank {r} of {config.world_size}, threads 1, affinity [{r}]" for r in range(2)]
    lines += [
        f"[rank0] step {i}: loss {7.6 - 0.01 * i:.4f}, {t * 1e3:.1f} ms" for i, t in enumerate(times * 7)
    ]
    if metrics["status"] != "ok":
        lines.append(str(metrics.get("log_tail", "")))
    out = {
        "config_key": config.key(),
        "estimator_calibration": 1.0,
        "losses": [7.6 - 0.01 * i for i in range(steps)] if metrics["status"] == "ok" else [],
        "step_times": times if metrics["status"] == "ok" else [],
        "wall_s": wall,
        "measured_s": sum(times),
        "device_seconds": wall * config.world_size,
        "log_path": f"/var/lib/tuner/trials/{tid}/trial.log",
        "log_tail": "\n".join(lines[-40:]),
        "node": "seed-host",
    }
    if metrics["status"] != "ok":
        out["error_kind"] = metrics["status"]
    return out


def _prediction(metrics: dict[str, Any], number: int, rng: random.Random) -> dict[str, Any]:
    """What the model sampler records before a run: who chose it, the predicted tokens/s (here the
    measured figure off by a log-normal 15%) and its 90% interval."""
    truth = metrics.get("tokens_per_s") or 20000.0
    predicted = truth * math.exp(rng.gauss(0.0, 0.15))
    half = 1.645 * 0.2
    return {
        "chosen_by": "queue" if number < 2 else "model",
        "predicted_tokens_per_s": round(predicted, 2),
        "predicted_interval": [round(predicted * math.exp(-half), 2), round(predicted * math.exp(half), 2)],
    }


def seed_study(
    url: str,
    study_name: str,
    n_trials: int,
    *,
    seed: int = 0,
    running: int = 0,
    fingerprint: dict[str, Any] | None = None,
    predictions: bool = False,
    overrides: dict[str, list[Any]] | None = None,
) -> float | None:
    """Create `study_name` with `n_trials` finished trials (plus `running` unfinished ones) in bulk.
    With `predictions`, each trial also carries what the model sampler records before a run; with
    `overrides`, configs come from the CPU space narrowed as a recipe's `search.overrides` does.

    Returns the best tokens/s. Optuna creates the study (and its schema); rows go in with one
    INSERT per table, because `Study.add_trials` takes ~13 ms per trial.
    """
    import optuna
    from optuna.distributions import CategoricalDistribution, distribution_to_json
    from optuna.trial import TrialState

    from tuner.devices import describe
    from tuner.recipe import recipe_from_dict
    from tuner.space import load_space
    from tuner.storage import get_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = get_storage(url)
    study = optuna.create_study(
        storage=storage, study_name=study_name, direction="maximize", load_if_exists=True
    )
    if fingerprint is not None:
        study.set_user_attr("fingerprint", fingerprint)  # as tuner.study records what ran the trials
    sid = storage.get_study_id_from_name(study_name)
    rng = random.Random(seed)
    guesses = random.Random(seed + 1)  # its own stream: the seeded trials stay what they were
    space, recipe, device = load_space("cpu").narrow(overrides or {}), recipe_from_dict(TINY), describe("cpu")
    start = utcnow() - dt.timedelta(seconds=3 * (n_trials + running))
    trial_rows, value_rows, param_rows, attr_rows = [], [], [], []
    best = None
    trials_t = tables.trials
    with storage.engine.begin() as conn:
        first_id = (conn.scalar(select(func.max(trials_t.c.trial_id))) or 0) + 1
        first_number = conn.scalar(select(func.count()).where(trials_t.c.study_id == sid)) or 0
        for i in range(n_trials + running):
            tid, finished = first_id + i, i < n_trials
            fake = _RecordingTrial(rng)
            config = space.suggest(fake, recipe, device)
            metrics = _measure(config, rng, base=20000.0)
            began = start + dt.timedelta(seconds=3 * i)
            state = TrialState.RUNNING
            if finished:
                state = TrialState.COMPLETE if metrics["status"] == "ok" else TrialState.FAIL
            trial_rows.append(
                {
                    "trial_id": tid,
                    "number": first_number + i,
                    "study_id": sid,
                    "state": state.name,
                    "datetime_start": began,
                    "datetime_complete": began + dt.timedelta(seconds=rng.uniform(2, 4))
                    if finished
                    else None,
                }
            )
            for name, value in fake.params.items():
                dist = CategoricalDistribution(fake.choices[name])
                param_rows.append(
                    {
                        "trial_id": tid,
                        "param_name": name,
                        "param_value": dist.to_internal_repr(value),
                        "distribution_json": distribution_to_json(dist),
                    }
                )
            if not finished:
                continue
            if state == TrialState.COMPLETE:
                value_rows.append(
                    {
                        "trial_id": tid,
                        "objective": 0,
                        "value": metrics["tokens_per_s"],
                        "value_type": "FINITE",
                    }
                )
                best = max(best or 0.0, metrics["tokens_per_s"])
            extra = _prediction(metrics, first_number + i, guesses) if predictions else {}
            for key, value in {**metrics, **_evidence(config, metrics, rng, tid), **extra}.items():
                attr_rows.append({"trial_id": tid, "key": key, "value_json": json.dumps(value)})
        conn.execute(insert(trials_t), trial_rows)
        if value_rows:
            conn.execute(insert(tables.values), value_rows)
        if param_rows:
            conn.execute(insert(tables.params), param_rows)
        if attr_rows:
            conn.execute(insert(tables.user_attrs), attr_rows)
        if conn.dialect.name == "postgresql":
            # The trials above carry their own ids: move the sequence past them, or Optuna's next
            # trial in this database would be given one of theirs.
            conn.execute(
                text(
                    "SELECT setval(pg_get_serial_sequence('trials', 'trial_id'), (SELECT MAX(trial_id) FROM trials))"
                )
            )
    return best


def seed_job(
    url: str,
    n_trials: int,
    *,
    name: str = "gpt-tiny",
    state: str = "succeeded",
    seed: int = 0,
    running: int = 0,
    device: str = "seeded CPU",
    predictions: bool = False,
    overrides: dict[str, list[Any]] | None = None,
) -> int:
    """A job row whose study holds `n_trials` seeded trials; returns the job id."""
    from tuner.recipe import recipe_from_dict

    search = {"trials": n_trials + running, **({"overrides": overrides} if overrides else {})}
    recipe = recipe_from_dict({**TINY, "name": name, "search": search})
    with session_scope(url) as s:
        job = Job(
            recipe_name=name,
            recipe=recipe.to_dict(),
            recipe_hash=recipe.hash(),
            state=state,
            trials_total=n_trials + running,
            started_at=utcnow(),
        )
        s.add(job)
        s.flush()
        job.study_name = f"{name}-{recipe.hash()}-seed{seed}-job{job.id}"
        job_id, study_name = job.id, job.study_name
    fingerprint = {"family": "cpu", "device": device, "device_count": 2, "torch": "2.13.0"}
    best = seed_study(url, study_name, n_trials, seed=seed, running=running, fingerprint=fingerprint,
                      predictions=predictions, overrides=overrides)  # fmt: skip
    baseline = 20000.0
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        job.trials_done = n_trials
        job.best_tokens_per_s = best
        job.baseline_tokens_per_s = baseline
        job.speedup = best / baseline if best else None
        if state in ("succeeded", "failed", "cancelled"):
            job.finished_at = utcnow()
            s.add(JobEvent(job_id=job_id, kind="done", payload={"state": state}))
    if state in ("succeeded", "failed", "cancelled"):
        snapshot_study(url, study_name)  # as the worker does when a job ends
    return job_id
