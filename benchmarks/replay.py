"""Replay search strategies against a measured table instead of the devices, many seeds each.

Strategies:
- `tuner`: this project's tuner, the same code path as `tuner tune` (`tuner.study.run_study`: the
  baseline first, feasibility and estimator pruning, duplicate reuse, and the sampler `tuner tune`
  uses by default, `search.sampler`'s default), with only the executor replaced by a table lookup
  (`TableExecutor`).
- `model`: the same with the performance-model sampler (`search.sampler: model`).
- `tuner_tpe`: the same with the TPE sampler (what `tuner` was before the model sampler).
- `tpe`: plain Optuna TPE over the same knobs (no pruning, no baseline); failures are told FAIL.
- `random`: random search over the space, without repeats.
- `grid`: the space in grid order.
- `largest_mbs`: the batch-size finder heuristic: the hand-picked config with micro-batch 1, 2, 4,
  ... until one fails, keeping the largest that ran.

A table lookup returns one of the config's measured repeats at random (seeded), so the strategies
see the measurement noise a real study sees. A config outside the table that the feasibility rules
reject costs a failed launch (the table's shortest trial) for strategies that do not check rules.
The performance model starts from the priors of the machine that measured the table
(`make_table.table_priors`: its recorded one-thread matmul peaks; a table that records none is
judged with this machine's, and a note says so), so a table with recorded peaks gives the same
figures on every host.

    python benchmarks/replay.py benchmarks/tables/cpu-gpt-tiny.csv --seeds 20 --json
    python benchmarks/replay.py TABLE.csv --seeds 20 --png benchmarks/results/regret.png

With --json, prints one JSON object per strategy (medians over seeds): strategy, trials_to_95,
trials_to_99, device_s_to_95, device_s_to_99, best_at_10, best_at_25 (fractions of the table's
best), failed_device_s, failed_fraction. Without it, a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_args import table_path  # noqa: E402
from make_table import read_table, row_runs, table_priors  # noqa: E402

from tuner.baseline import baseline_config  # noqa: E402
from tuner.config import KNOBS, Config, infeasible_reasons  # noqa: E402
from tuner.devices import describe  # noqa: E402
from tuner.executors.base import Executor  # noqa: E402
from tuner.perf.priors import DevicePriors  # noqa: E402
from tuner.recipe import recipe_from_dict  # noqa: E402
from tuner.result import TrialResult, TrialSpec, budget_peak  # noqa: E402
from tuner.space import load_space  # noqa: E402

STRATEGIES = ("tuner", "model", "tuner_tpe", "tpe", "random", "grid", "largest_mbs")


@dataclass
class Run:
    """One device run as a strategy paid for it."""

    value: float  # the config's true (mean) tokens/s; 0 when it failed
    device_s: float
    failed: bool


@dataclass
class Table:
    recipe: object
    rows: dict[str, dict]
    best: float
    launch_cost_s: float
    devices: int
    # The performance model's device priors of the machine that measured the table
    # (`make_table.table_priors`): its recorded matmul peaks where it has them.
    priors: DevicePriors | None = None

    @classmethod
    def load(cls, path: str, memory_budget_gb: float | None = None) -> Table:
        """Read a table; `memory_budget_gb` re-judges it under a tighter budget than it was
        measured with: a config whose measured peak exceeds it counts as oom, costing its full
        measured wall time (a real over-budget trial stops after its first step, so this
        overstates what running an OOM config costs)."""
        header, rows = read_table(path)
        doc = json.loads(header["recipe"])
        # A knob added since the table was measured stays at its default: the table has no other.
        overrides = doc.setdefault("search", {}).setdefault("overrides", {})
        for name in KNOBS:
            if rows and name not in rows[0] and name not in overrides:
                overrides[name] = [getattr(Config(), name)]
        if memory_budget_gb is not None:
            doc["hardware"]["memory_budget_gb"] = memory_budget_gb
            limit = memory_budget_gb * 2**30
            for r in rows:
                if r["status"] == "ok" and (budget_peak(_peaks(r)) or 0) > limit:
                    r["status"] = "oom"
                    r["error"] = f"measured peak over the {memory_budget_gb} GiB budget"
        recipe = recipe_from_dict(doc)
        # Re-key by today's Config: a knob added since the table was measured takes its default.
        by_key = {Config.from_params({k: r[k] for k in KNOBS if r.get(k, "") != ""}).key(): r for r in rows}
        ok = [float(r["tokens_per_s"]) for r in rows if r["status"] == "ok" and r["tokens_per_s"]]
        walls = [float(r["wall_s"]) for r in rows if r["wall_s"]]
        return cls(recipe, by_key, max(ok), min(walls), recipe.hardware.devices, table_priors(header))

    def run(self, config: Config, rng: random.Random) -> tuple[Run, TrialResult]:
        row = self.rows.get(config.key())
        if row is None:  # not measurable: a launch that fails at once
            res = TrialResult(status="error", error="config not in the table", wall_s=self.launch_cost_s)
            return Run(0.0, self.launch_cost_s * self.devices, True), res
        wall = float(row["wall_s"])
        if row["status"] != "ok":
            res = TrialResult(status=row["status"], error=row["error"], wall_s=wall)
            return Run(0.0, wall * self.devices, True), res
        seen = row_runs(row)
        tps = rng.choice(seen)
        step = float(row["step_time_s"])
        loss = float(row["loss"]) if row["loss"] else None
        res = TrialResult(
            status="ok",
            tokens_per_s=tps,
            samples_per_s=tps / self.recipe.model.seq_len,
            step_time_s=step,
            step_time_spread=float(row["step_time_spread"] or 0),
            **_peaks(row),
            loss=loss,
            losses=[loss] * self.recipe.measure.steps if loss is not None else [],
            wall_s=wall,
            measured_s=step * self.recipe.measure.steps,
        )
        return Run(float(row["tokens_per_s"]), wall * self.devices, False), res


def _peaks(row: dict) -> dict[str, int | None]:
    """A row's peak columns as a trial stores them. Tables measured before CPU ranks read their
    allocated peak apart (`tuner.memory.HeldMemory`) have one column, the RSS peak, which
    `budget_peak` then falls back to."""
    return {
        k: int(float(row.get(k) or 0)) or None
        for k in ("peak_mem_allocated_bytes", "peak_mem_reserved_bytes")
    }


class TableExecutor(Executor):
    """An executor whose device is the table: each submit is answered by a lookup."""

    name = "table"

    def __init__(self, table: Table, rng: random.Random):
        self.table = table
        self.rng = rng
        self.runs: list[Run] = []
        self._done: list[TrialResult] = []

    def free_slots(self, spec: TrialSpec) -> int:
        return 0 if self._done else 1

    def submit(self, spec: TrialSpec) -> None:
        run, res = self.table.run(Config(**spec.config), self.rng)
        res.tag = spec.tag
        self.runs.append(run)
        self._done.append(res)

    def wait(self, timeout: float | None = None) -> list[TrialResult]:
        done, self._done = self._done, []
        return done

    def running(self) -> list[str]:
        return [r.tag for r in self._done]

    def cancel(self) -> None:
        self._done = []

    def device_priors(self, device):
        """The priors of the machine that measured the table (as a study there would start from:
        its own one-thread matmul peaks), not those of the machine replaying it. Without them the
        model sampler's figures depended on the host that ran the replay."""
        return self.table.priors


def _space(table: Table):
    r = table.recipe
    return load_space(r.search.space or "cpu").narrow(r.search.overrides)


def strategy_tuner(table: Table, seed: int, budget: int, sampler: str | None = None) -> list[Run]:
    from tuner.recipe import SearchSpec
    from tuner.study import run_study

    ex = TableExecutor(table, random.Random(seed))
    with tempfile.TemporaryDirectory(prefix="replay-") as tmp:
        # Pruned trials count against `trials` but cost nothing; give room for `budget` runs.
        run_study(
            table.recipe,
            storage_url=f"sqlite:///{tmp}/study.db",
            executor=ex,
            trials=budget * 3,
            timeout_s=1e9,
            patience=None,
            sampler=sampler or SearchSpec.model_fields["sampler"].default,
            seed=seed,
            remeasure_top=0,
            workdir=tmp,
            study_name=f"replay-{seed}",
            progress=lambda e: None,
            should_stop=lambda: len(ex.runs) >= budget,
        )
    return ex.runs[:budget]


def strategy_model(table: Table, seed: int, budget: int) -> list[Run]:
    return strategy_tuner(table, seed, budget, sampler="model")


def strategy_tuner_tpe(table: Table, seed: int, budget: int) -> list[Run]:
    return strategy_tuner(table, seed, budget, sampler="tpe")


def strategy_tpe(table: Table, seed: int, budget: int) -> list[Run]:
    rng = random.Random(seed)
    space, device, recipe = _space(table), describe("cpu"), table.recipe
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    runs: list[Run] = []
    while len(runs) < budget:
        trial = study.ask()
        config = space.suggest(trial, recipe, device)
        run, res = table.run(config, rng)
        runs.append(run)
        if res.status == "ok":
            study.tell(trial, res.tokens_per_s)
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return runs


def _sequence(table: Table, configs: list[Config], seed: int, budget: int) -> list[Run]:
    rng = random.Random(seed)
    return [table.run(c, rng)[0] for c in configs[:budget]]


def strategy_random(table: Table, seed: int, budget: int) -> list[Run]:
    configs = list(_space(table).configs(table.recipe, describe("cpu"), feasible_only=False))
    random.Random(seed).shuffle(configs)
    return _sequence(table, configs, seed, budget)


def strategy_grid(table: Table, seed: int, budget: int) -> list[Run]:
    configs = list(_space(table).configs(table.recipe, describe("cpu"), feasible_only=False))
    return _sequence(table, configs, seed, budget)


def strategy_largest_mbs(table: Table, seed: int, budget: int) -> list[Run]:
    rng = random.Random(seed)
    space, device = _space(table), describe("cpu")
    hand = baseline_config(table.recipe, device, space)
    runs: list[Run] = []
    for mbs in sorted(space.domains["micro_batch_size"]):
        config = Config(**{**hand.to_dict(), "micro_batch_size": mbs})
        if infeasible_reasons(config, table.recipe, device) and config.key() not in table.rows:
            break  # the finder stops at the first size that does not run
        run, _ = table.run(config, rng)
        runs.append(run)
        if run.failed:
            break
    return runs


def metrics(runs: list[Run], best: float) -> dict:
    def first(frac: float) -> tuple[float, float]:
        spent = 0.0
        for i, r in enumerate(runs, 1):
            spent += r.device_s
            if not r.failed and r.value >= frac * best:
                return i, spent
        return math.inf, math.inf

    def best_at(n: int) -> float:
        vals = [r.value for r in runs[:n] if not r.failed]
        return max(vals, default=0.0) / best

    total = sum(r.device_s for r in runs)
    failed = sum(r.device_s for r in runs if r.failed)
    t95, d95 = first(0.95)
    t99, d99 = first(0.99)
    return {
        "trials_to_95": t95,
        "trials_to_99": t99,
        "device_s_to_95": d95,
        "device_s_to_99": d99,
        "best_at_10": best_at(10),
        "best_at_25": best_at(25),
        "failed_device_s": failed,
        "failed_fraction": failed / total if total else 0.0,
    }


def _median(values: list[float]) -> float | None:
    m = statistics.median(values)
    return None if math.isinf(m) else round(m, 4)


def replay(table: Table, seeds: int, budget: int, strategies=STRATEGIES) -> tuple[list[dict], dict]:
    funcs = {s: globals()[f"strategy_{s}"] for s in strategies}
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    out, curves = [], {}
    for name, fn in funcs.items():
        per_seed = []
        curve = []
        for seed in range(seeds):
            runs = fn(table, seed, budget)
            per_seed.append(metrics(runs, table.best))
            so_far, c = 0.0, []
            for r in runs:
                so_far = max(so_far, 0.0 if r.failed else r.value)
                c.append(so_far / table.best)
            curve.append(c + [c[-1] if c else 0.0] * (budget - len(c)))
            print(f"  {name} seed {seed}: {per_seed[-1]}", file=sys.stderr, flush=True)
        row = {"strategy": name, "seeds": seeds}
        for k in per_seed[0]:
            row[k] = _median([m[k] for m in per_seed])
        out.append(row)
        curves[name] = [statistics.median(c[i] for c in curve) for i in range(budget)]
    return out, curves


def draw(curves: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), [1 - y for y in ys], label=name)
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_xlabel("device runs")
    ax.set_ylabel("regret (1 - best so far / table best)")
    ax.axhline(0.05, color="grey", lw=0.5, ls="--")
    ax.axhline(0.01, color="grey", lw=0.5, ls=":")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", type=table_path, help="CSV written by benchmarks/make_table.py")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--budget", type=int, default=60, help="device runs per strategy and seed")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--json", action="store_true", help="one JSON object per strategy")
    ap.add_argument("--png", default=None, help="draw median regret curves to this PNG")
    ap.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="judge the table under this per-device budget instead of the one it was measured with",
    )
    args = ap.parse_args(argv)
    table = Table.load(args.table, args.memory_budget_gb)
    unknown = set(args.strategies.split(",")) - set(STRATEGIES)
    if unknown:
        ap.error(f"--strategies: unknown {', '.join(sorted(unknown))}; choose from {', '.join(STRATEGIES)}")
    rows, curves = replay(table, args.seeds, args.budget, args.strategies.split(","))
    if args.png:
        draw(curves, args.png, f"{Path(args.table).name}: median over {args.seeds} seeds")
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(
        f"table best: {table.best:.0f} tokens/s over {len(table.rows)} configs; "
        f"median over {args.seeds} seeds, budget {args.budget} device runs\n"
    )
    print(
        "| strategy | trials to 95% | trials to 99% | device-s to 95% | best@10 | best@25 | failed device-s (share) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:

        def f(v, nd=0):
            return "never" if v is None else f"{v:.{nd}f}"

        print(
            f"| {r['strategy']} | {f(r['trials_to_95'])} | {f(r['trials_to_99'])} | {f(r['device_s_to_95'])} | "
            f"{f(r['best_at_10'], 3)} | {f(r['best_at_25'], 3)} | {f(r['failed_device_s'])} ({r['failed_fraction']:.1%}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
