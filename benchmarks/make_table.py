"""Measure every config of a search space once per repeat and write the tabular benchmark.

Each config runs as a real trial through `tuner.executors.local.run_trial` (the same runner as
`tuner measure`), WITHOUT the estimator's pruning: the table is ground truth, so configs that
exceed the memory budget are run and recorded as oom with the device time they cost.

    python benchmarks/make_table.py benchmarks/recipes/gpt-tiny-table.yaml \
        --out benchmarks/tables/cpu-gpt-tiny.csv --repeats 2

The CSV starts with `#` lines naming the recipe, machine and software fingerprint, and on CPU the
one-thread matmul peaks the performance model's priors start from (`peak_flops`, FLOP/s per dtype;
`perf_model_eval.py` uses them on any machine). Re-running
with the same --out resumes: configs already measured `--repeats` times are skipped (the others are
measured again in full).

The repeats run as passes over every config, each pass in its own random order (`--seed`): the
machine's slow minutes then scatter over the table instead of shifting a block of neighbouring
configs (before 2026-12-05 each config's repeats ran back to back in the space's order; `--listed`
still does that).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cli_args import recipe_path

from tuner.config import KNOBS, Config
from tuner.devices import cpu_model_id, describe, resolve_family, same_cpu
from tuner.estimate import budget_bytes, estimate
from tuner.executors.local import run_trial
from tuner.fingerprint import fingerprint
from tuner.perf.priors import device_priors
from tuner.recipe import load_recipe
from tuner.result import TrialSpec
from tuner.space import load_space

KNOB_COLUMNS = list(KNOBS)
METRIC_COLUMNS = [
    "status",
    "runs",
    "tokens_per_s",
    "tokens_per_s_runs",
    "tokens_per_s_spread",
    "step_time_s",
    "step_time_spread",
    "wall_s",
    "peak_mem_allocated_bytes",
    "peak_mem_reserved_bytes",
    "estimated_peak_mem_bytes",
    "mfu",
    "loss",
    "error",
]
COLUMNS = ["key", *KNOB_COLUMNS, *METRIC_COLUMNS]


def read_table(path: str | Path) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(header fields from the `#` lines, rows) of a table CSV."""
    header: dict[str, str] = {}
    lines = []
    for line in Path(path).read_text().splitlines():
        if line.startswith("#"):
            k, _, v = line[1:].strip().partition(":")
            header[k.strip()] = v.strip()
        elif line.strip():
            lines.append(line)
    return header, list(csv.DictReader(lines))


def table_priors(header: dict[str, str]):
    """The performance model's device priors for the machine that measured a table: this
    machine's, with the table's recorded one-thread matmul peaks (`# peak_flops:`) when it has
    them. A table without them is judged with this machine's peaks, and says so unless it records
    this CPU's model id: its prediction figures may then differ from the measuring machine's (a
    CPU with bf16 matrix units puts bf16 at 8x fp32, one without at 1x)."""
    import dataclasses

    here = describe("cpu")
    priors = device_priors(here)
    if "peak_flops" in header:
        return dataclasses.replace(priors, peak_flops=json.loads(header["peak_flops"]))
    fingerprint = json.loads(header.get("fingerprint") or "{}")
    if not same_cpu(fingerprint, here):
        measured_on, model = fingerprint.get("device"), fingerprint.get("cpu_model")
        print(
            f"note: the table was measured on {measured_on!r} ({model or 'model not recorded'}) and "
            f"records no peak_flops; the priors use this machine's ({here.name!r}, {cpu_model_id()}), "
            "so prediction figures may differ from that machine's",
            file=sys.stderr,
        )
    return priors


def _aggregate(config: Config, results: list, est: int) -> dict:
    ok = [r for r in results if r.status == "ok" and r.tokens_per_s]
    status = "ok" if len(ok) == len(results) else next(r.status for r in results if r.status != "ok")
    tps = [r.tokens_per_s for r in ok]
    row = {"key": config.key(), **config.to_dict()}
    row.update(
        status=status,
        runs=len(results),
        tokens_per_s=statistics.mean(tps) if tps and status == "ok" else "",
        tokens_per_s_runs=";".join(f"{v:.1f}" for v in tps),
        tokens_per_s_spread=(max(tps) - min(tps)) / statistics.median(tps) if len(tps) > 1 else "",
        step_time_s=statistics.median([r.step_time_s for r in ok]) if ok else "",
        step_time_spread=statistics.median([r.step_time_spread for r in ok]) if ok else "",
        wall_s=statistics.mean([r.wall_s or 0.0 for r in results]),
        peak_mem_allocated_bytes=max((r.peak_mem_allocated_bytes or 0) for r in results) or "",
        peak_mem_reserved_bytes=max((r.peak_mem_reserved_bytes or 0) for r in results) or "",
        estimated_peak_mem_bytes=est,
        mfu=statistics.mean([r.mfu for r in ok if r.mfu is not None]) if ok else "",
        loss=ok[0].loss if ok else "",
        error=next((r.error or "" for r in results if r.status != "ok"), "")[:300],
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=recipe_path, help="recipe with the table's space in search.overrides")
    ap.add_argument("--out", required=True, help="CSV to write (resumed if it exists)")
    ap.add_argument("--repeats", type=int, default=2, help="measurements per config (default 2)")
    ap.add_argument("--limit", type=int, default=None, help="measure only the first N configs")
    ap.add_argument(
        "--listed",
        action="store_true",
        help="measure each config's repeats back to back in the space's order (how tables were made "
        "until 2026-12-05) instead of one pass per repeat in a random order",
    )
    ap.add_argument("--seed", type=int, default=0, help="of the passes' random orders (default 0)")
    args = ap.parse_args(argv)

    recipe = load_recipe(args.recipe)
    family = resolve_family(recipe.hardware.device)
    device = describe(family)
    space = load_space(recipe.search.space or family).narrow(recipe.search.overrides)
    configs = list(space.configs(recipe, device))[: args.limit]
    budget = budget_bytes(recipe, device)
    out = Path(args.out)
    done: dict[str, dict] = {}
    if out.exists():
        _, measured = read_table(out)
        done = {r["key"]: r for r in measured if int(r["runs"] or 0) >= args.repeats}
    fp = fingerprint(family)
    peaks = device_priors(device).peak_flops if family == "cpu" else None
    print(f"{len(configs)} configs, {len(done)} already measured, {args.repeats} repeats each", flush=True)

    todo = [(i, c) for i, c in enumerate(configs) if c.key() not in done]
    results: dict[int, list] = {i: [] for i, _ in todo}
    ests = {i: int(estimate(recipe, c, device).peak_mem_bytes) for i, c in todo}

    def rows() -> list[dict]:
        """Every config in the space's order: measured before, measured now (so far), or not yet."""
        out_rows = []
        for i, config in enumerate(configs):
            if config.key() in done:
                out_rows.append(done[config.key()])
            elif results.get(i):
                out_rows.append(_aggregate(config, results[i], ests[i]))
        return out_rows

    order = "listed" if args.listed else f"shuffled passes, seed {args.seed}"
    t0, n, total = time.perf_counter(), 0, len(todo) * args.repeats
    with tempfile.TemporaryDirectory(prefix="tuner-table-") as tmp:
        # One pass per repeat, each in its own random order (unless --listed): a slow minute of
        # the machine then falls on a random handful of configs, once each, instead of on a block
        # of neighbouring configs (the space's order groups configs of one split and micro-batch
        # size), which reads as an effect of that split and size.
        for rep, i, config in _schedule(todo, args.repeats, args.listed, args.seed):
            spec = TrialSpec(
                recipe=recipe.to_dict(),
                config=config.to_dict(),
                family=family,
                workdir=str(Path(tmp) / f"c{i}-r{rep}"),
                timeout_s=recipe.measure.timeout_s,
                estimated_peak_mem_bytes=ests[i],
                memory_budget_bytes=budget,
                tag=f"{i}-{rep}",
            )
            res = run_trial(spec)
            results[i].append(res)
            n += 1
            print(
                f"[{n}/{total}] run {rep + 1} {time.perf_counter() - t0:6.0f}s {res.status:>7} "
                f"{res.tokens_per_s or 0:>9.0f} tok/s  {json.dumps(config.active_params())}",
                flush=True,
            )
            if n % 10 == 0:
                _write(out, recipe, fp, budget, args.repeats, rows(), peaks, order)
    table = rows()
    _write(out, recipe, fp, budget, args.repeats, table, peaks, order)
    print(f"wrote {out} ({len(table)} configs) in {time.perf_counter() - t0:.0f}s")
    return 0


def _schedule(todo: list, repeats: int, listed: bool, seed: int) -> list[tuple[int, int, Config]]:
    """(repeat, index, config) in the order they run: each config's repeats back to back in the
    space's order (`listed`), else one pass per repeat, each in its own random order."""
    if listed:
        return [(rep, i, c) for i, c in todo for rep in range(repeats)]
    out = []
    for rep in range(repeats):
        this_pass = list(todo)
        random.Random(seed * 1000 + rep).shuffle(this_pass)
        out.extend((rep, i, c) for i, c in this_pass)
    return out


def _write(
    out: Path, recipe, fp: dict, budget: int, repeats: int, rows: list[dict], peaks=None, order=""
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        f.write(f"# recipe: {json.dumps(recipe.to_dict(), sort_keys=True)}\n")
        f.write(f"# fingerprint: {json.dumps(fp, sort_keys=True)}\n")
        f.write(f"# memory_budget_bytes: {budget}\n")
        f.write(f"# repeats: {repeats}\n")
        if order:
            f.write(f"# order: {order}\n")
        if peaks:  # what the performance model's priors start from on this machine
            f.write(f"# peak_flops: {json.dumps(peaks, sort_keys=True)}\n")
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
