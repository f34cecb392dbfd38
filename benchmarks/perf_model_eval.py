"""How well the performance model predicts a measured table from a few of its configs.

For each seed: fit the model (device-table priors + N measured configs drawn at random, one of
each config's repeats) and predict every other config of the table. Reports, as medians over
seeds: Spearman rank correlation of predicted and measured tokens/s, median |predicted/measured
- 1|, how often the measured value falls in the predicted 90% interval, and the log rms by which
the fit misses the runs it was fitted to.

    python benchmarks/perf_model_eval.py benchmarks/tables/cpu-gpt-tiny-2.csv --seeds 30 --train 5
    python benchmarks/perf_model_eval.py TABLE.csv --train 5 --json

(Until commit ec82317, `--history OTHER.csv` also gave each fit another model's table as the prior
means, as studies then did with other models' trials on the machine; BENCHMARKS section 11 has
why that was dropped.)
    python benchmarks/perf_model_eval.py benchmarks/tables/cpu-gpt-tiny-2.csv --residuals

`--picks sampler` fits the configs the study's default sampler measures first instead, on the
replay of `benchmarks/replay.py` (with its `--memory-budget-gb`): how well the model predicts the
rest of the table at the point a study has measured N configs of its own choosing.
    python benchmarks/perf_model_eval.py benchmarks/tables/cpu-gpt-tiny-3.csv --picks sampler --memory-budget-gb 0.15

`--residuals` fits every config of the table instead and reports what the model form cannot
explain: the in-sample median error, the coefficients that moved furthest from their priors (in
prior sd), the median log(predicted/measured) of each value of every knob the table varies, and
`order`: how the residuals correlate along the table's rows (`order_effects`: the machine's slow
minutes in a table measured in the space's order).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_args import table_path  # noqa: E402
from make_table import read_table, row_runs, table_priors  # noqa: E402

from tuner.config import KNOBS, Config  # noqa: E402
from tuner.devices import describe  # noqa: E402
from tuner.perf.observations import Observation  # noqa: E402
from tuner.perf.predictor import Predictor  # noqa: E402
from tuner.recipe import recipe_from_dict  # noqa: E402
from tuner.result import budget_peak  # noqa: E402


def priors_of(path: str):
    """The device priors of the machine that measured the table (`make_table.table_priors`)."""
    return table_priors(read_table(path)[0])


def table_observations(path: str) -> tuple[object, list[tuple[Observation, list[float]]]]:
    """(recipe, [(observation with the mean tokens/s, every measured repeat)]) of a table."""
    header, rows = read_table(path)
    recipe = recipe_from_dict(json.loads(header["recipe"]))
    out = []
    for r in rows:
        if r["status"] != "ok" or not r["tokens_per_s"]:
            continue
        config = Config.from_params({k: r[k] for k in KNOBS if r.get(k, "") != ""})
        runs = row_runs(r)
        obs = Observation(
            recipe=recipe,
            config=config,
            status="ok",
            tokens_per_s=float(r["tokens_per_s"]),
            rel_sd=0.25 * float(r["step_time_spread"] or 0),
            peak_mem_bytes=float(budget_peak(r) or 0) or None,
            estimated_peak_mem_bytes=float(r["estimated_peak_mem_bytes"] or 0) or None,
        )
        out.append((obs, runs))
    return recipe, out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def random_picks(rows, train: int, rng: random.Random) -> list[tuple[int, float]]:
    """`train` configs of the table at random, each with one of its measured repeats."""
    return [(i, rng.choice(rows[i][1])) for i in (rng.sample(range(len(rows)), train) if train else [])]


def sampler_picks(path: str, memory_budget_gb: float | None):
    """The configs the study's default sampler measures first, replayed on the table as
    `benchmarks/replay.py` does (the sampler is deterministic; a seed draws the table's repeats)."""
    import replay

    class Recording(replay.Table):
        def run(self, config, rng):
            run, res = super().run(config, rng)
            self.picked.append((config.normalized().key(), res))
            return run, res

    table = replay.Table.load(path, memory_budget_gb)

    def picks(rows, train: int, rng: random.Random) -> list[tuple[int, float]]:
        recording = Recording(**table.__dict__)
        recording.picked = []
        replay.strategy_tuner(recording, rng.randrange(1 << 30), train)
        index = {o.config.normalized().key(): i for i, (o, _) in enumerate(rows)}
        return [(index[k], r.tokens_per_s) for k, r in recording.picked if r.status == "ok" and k in index]

    return picks


def evaluate(path: str, seeds: int, train: int, picks=random_picks) -> dict:
    recipe, rows = table_observations(path)
    device = describe("cpu")
    predictor = Predictor(device, priors_of(path))
    configs = [o.config for o, _ in rows]
    cached = predictor.features(recipe, configs)
    truth = np.array([o.tokens_per_s for o, _ in rows])
    per_seed = []
    for seed in range(seeds):
        chosen = picks(rows, train, random.Random(seed))
        picked = [i for i, _ in chosen]
        fitted = [Observation(**{**rows[i][0].__dict__, "tokens_per_s": v}) for i, v in chosen]
        predictor.fit(fitted)
        p = predictor.predict(recipe, configs, cached)
        rest = np.array([i for i in range(len(rows)) if i not in set(picked)])
        pred, low, high, true = p.tokens_per_s[rest], p.tokens_low[rest], p.tokens_high[rest], truth[rest]
        seen = np.array([o.tokens_per_s for o in fitted])
        fitted_rms = float(np.sqrt(np.mean(np.log(p.tokens_per_s[picked] / seen) ** 2))) if picked else 0.0
        per_seed.append(
            {
                "spearman": spearman(pred, true),
                "median_abs_error": float(np.median(np.abs(pred / true - 1))),
                "coverage_90": float(np.mean((true >= low) & (true <= high))),
                # How closely the fit follows the runs it was fitted to (log rms; 0 without any).
                "fitted_rms": fitted_rms,
            }
        )
    out = {"table": Path(path).name, "seeds": seeds, "train": train, "configs": len(rows)}
    for k in per_seed[0]:
        out[k] = round(statistics.median(s[k] for s in per_seed), 4)
    return out


def residuals(path: str) -> dict:
    """The model fitted to every config of the table: in-sample error, coefficients against their
    priors, and the median log(predicted / measured) per knob value (0: no systematic miss)."""
    from tuner.perf.model import COEF_NAMES, prior

    recipe, rows = table_observations(path)
    obs = [o for o, _ in rows]
    predictor = Predictor(describe("cpu"), priors_of(path)).fit(obs)
    p = predictor.predict(recipe, [o.config for o in obs])
    truth = np.array([o.tokens_per_s for o in obs])
    log_ratio = np.log(p.tokens_per_s / truth)
    mu, sd = prior(predictor.priors)
    theta = predictor.time_fit.theta
    moved = sorted(zip(COEF_NAMES, theta, mu, sd, strict=True), key=lambda r: -abs(r[1] - r[2]) / r[3])
    by_knob = {}
    for knob in KNOBS:  # those the table varies
        groups: dict[str, list[float]] = {}
        for o, r in zip(obs, log_ratio, strict=True):
            groups.setdefault(str(getattr(o.config, knob)), []).append(float(r))
        if len(groups) > 1:
            by_knob[knob] = {v: {"n": len(rs), "median_log_ratio": round(statistics.median(rs), 3)}
                             for v, rs in groups.items()}  # fmt: skip
    return {
        "table": Path(path).name,
        "configs": len(obs),
        "order": order_effects([o.config for o in obs], log_ratio),
        "in_sample_median_abs_error": round(float(np.median(np.abs(np.exp(log_ratio) - 1))), 4),
        "misfit_sd": round(predictor.time_fit.sigma, 4),
        "coefficients": [
            {
                "name": n,
                "fit": round(float(t), 3),
                "prior": round(float(m), 3),
                "z": round(float((t - m) / s), 2),
            }
            for n, t, m, s in moved[:6]
        ],
        "by_knob": by_knob,
    }


def _pair_correlation(r: np.ndarray, groups: dict) -> float:
    pairs = [(r[a], r[b]) for g in groups.values() for i, a in enumerate(g) for b in g[i + 1 :]]
    return round(float(np.corrcoef(np.array(pairs).T)[0, 1]), 2) if len(pairs) > 2 else float("nan")


def order_effects(configs: list[Config], log_ratio: np.ndarray) -> dict:
    """How the whole-table residuals hang together along the table's rows (the space's order, in
    which a table made with `--listed` also ran): lag-1 correlation, and the correlation between
    configs that share split, micro-batch size and recompute (neighbouring rows) against configs
    alike in all but the split (rows minutes apart). The machine's slow minutes raise the first
    two under `--listed` (make_table.py)."""
    r = log_ratio - log_ratio.mean()
    near: dict[tuple, list[int]] = {}
    apart: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        rec = (c.recompute, c.recompute_layers)
        near.setdefault((c.dp, c.tp, c.pp, c.sequence_parallel, c.micro_batch_size, *rec), []).append(i)
        apart.setdefault((c.micro_batch_size, *rec, c.attention, c.amp), []).append(i)
    return {
        "lag1": round(float(np.sum(r[1:] * r[:-1]) / np.sum(r * r)), 2),
        "same_split_batch_recompute": _pair_correlation(r, near),
        "same_but_split": _pair_correlation(r, apart),
    }


@contextlib.contextmanager
def oracle_priors(path: str):
    """Within the block, every fit starts from the prior means the table's whole-table fit
    gives (it replaces `tuner.perf.fitting.prior`; the prior sds stay)."""
    from tuner.perf import fitting

    _, rows = table_observations(path)
    theta = Predictor(describe("cpu"), priors_of(path)).fit([o for o, _ in rows]).time_fit.theta
    device_prior = fitting.prior
    fitting.prior = lambda priors: (theta.copy(), device_prior(priors)[1])
    try:
        yield
    finally:
        fitting.prior = device_prior


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", type=table_path, help="CSV written by benchmarks/make_table.py")
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--train", type=int, default=5, help="measured configs the model is fitted to")
    ap.add_argument("--residuals", action="store_true", help="fit every config; report what the model misses")
    ap.add_argument(
        "--oracle-priors", action="store_true", help="start every fit from the table's own whole-table fit"
    )
    ap.add_argument(
        "--picks",
        choices=["random", "sampler"],
        default="random",
        help="the N fitted configs: drawn at random, or the default sampler's first N on the replay",
    )
    ap.add_argument(
        "--memory-budget-gb",
        type=float,
        help="with --picks sampler: the replay's budget (replay.py's option)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.residuals:
        out = residuals(args.table)
        print(json.dumps(out, indent=None if args.json else 1))
        return 0
    with oracle_priors(args.table) if args.oracle_priors else contextlib.nullcontext():
        picks = sampler_picks(args.table, args.memory_budget_gb) if args.picks == "sampler" else random_picks
        result = evaluate(args.table, args.seeds, args.train, picks)
    result["priors"] = "oracle" if args.oracle_priors else "device"
    result["picks"] = args.picks
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['table']}: fitted to {args.train} of {result['configs']} configs, median over "
            f"{args.seeds} seeds: Spearman {result['spearman']:.2f}, median |error| "
            f"{result['median_abs_error']:.1%}, 90% interval coverage {result['coverage_90']:.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
