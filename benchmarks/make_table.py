"""Measure every config of a search space once per repeat and write the tabular benchmark.

Each config runs as a real trial through `tuner.executors.local.run_trial` (the same runner as
`tuner measure`), WITHOUT the estimator's pruning: the table is ground truth, so configs that
exceed the memory budget are run and recorded as oom with the device time they cost.

    python benchmarks/make_table.py benchmarks/recipes/gpt-tiny-table.yaml \\
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

`--confirm-top K` then measures the K fastest configs (by the mean of their first `--repeats`
runs) `--confirm-runs` more times each, again in passes of their own random order, and their rows
hold every run: the configs a search is judged against get more than two samples of a machine
whose speed swings from minute to minute (the fastest of 200 noisy means are fast partly by
luck). It works on a finished table too, the other rows left as they are, but then the confirmed
rows mix the machine's speed of two sessions (BENCHMARKS section 11: 14% apart once); run it with
the passes where you can:

    python benchmarks/make_table.py benchmarks/recipes/gpt-tiny-table.yaml \\
        --out benchmarks/tables/cpu-gpt-tiny-5.csv --repeats 2 --confirm-top 40 --confirm-runs 3
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


def row_runs(row: dict[str, str]) -> list[float]:
    """A row's measured tokens/s, run by run (`tokens_per_s_runs`: the successful runs, in order)."""
    return [float(v) for v in row["tokens_per_s_runs"].split(";") if v]


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


def _aggregate(
    config: Config, results: list, est: int, earlier: dict | None = None, confirming: bool = False
) -> dict:
    """A config's row from its runs. `earlier`: the row of its runs measured before (a resumed
    table's, or the one a confirmation adds to); its tokens/s enter run by run, its other figures
    as one more sample each. A failed run marks the row with its status, except a confirmation's:
    the row keeps the status its first runs gave it (and so its place among the fastest), and the
    failure goes into `error`."""
    ok = [r for r in results if r.status == "ok" and r.tokens_per_s]
    failed = [r for r in results if r not in ok]
    before = row_runs(earlier) if earlier else []
    status = earlier["status"] if earlier else "ok"
    error = earlier["error"] if earlier else ""
    if failed and confirming:
        error = f"{len(failed)} of {len(results)} confirmation runs failed: {failed[0].status}: {failed[0].error or ''}"
    elif failed:
        status, error = failed[0].status, failed[0].error or ""
    tps = before + [r.tokens_per_s for r in ok]

    def merged(name: str, values: list, how=statistics.median):
        values = [v for v in values if v is not None]
        if earlier and earlier.get(name) not in (None, ""):
            values.append(float(earlier[name]))
        return how(values) if values else ""

    row = {"key": config.key(), **config.to_dict()}
    row.update(
        status=status,
        runs=len(results) + (int(earlier["runs"] or 0) if earlier else 0),
        tokens_per_s=statistics.mean(tps) if tps and status == "ok" else "",
        tokens_per_s_runs=";".join(f"{v:.1f}" for v in tps),
        tokens_per_s_spread=(max(tps) - min(tps)) / statistics.median(tps) if len(tps) > 1 else "",
        step_time_s=merged("step_time_s", [r.step_time_s for r in ok]),
        step_time_spread=merged("step_time_spread", [r.step_time_spread for r in ok]),
        wall_s=merged("wall_s", [r.wall_s or 0.0 for r in results], statistics.mean),
        peak_mem_allocated_bytes=int(
            merged("peak_mem_allocated_bytes", [r.peak_mem_allocated_bytes or 0 for r in results], max) or 0
        )
        or "",
        peak_mem_reserved_bytes=int(
            merged("peak_mem_reserved_bytes", [r.peak_mem_reserved_bytes or 0 for r in results], max) or 0
        )
        or "",
        estimated_peak_mem_bytes=est,
        mfu=merged("mfu", [r.mfu for r in ok], statistics.mean),
        loss=earlier["loss"]
        if earlier and earlier.get("loss") not in (None, "")
        else (ok[0].loss if ok else ""),
        error=error[:300],
    )
    return row


def confirm_targets(rows: list[dict], repeats: int, top: int, runs: int) -> dict[str, int]:
    """{key: runs still to measure} for the `top` fastest ok configs by the mean of their first
    `repeats` runs (so a resumed confirmation picks the same configs), each to `repeats + runs`."""
    first = {
        r["key"]: statistics.mean(vs) for r in rows if r["status"] == "ok" and (vs := row_runs(r)[:repeats])
    }
    chosen = sorted(first, key=first.get, reverse=True)[:top]
    have = {r["key"]: int(r["runs"] or 0) for r in rows}
    return {k: repeats + runs - have[k] for k in chosen if have[k] < repeats + runs}


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
    ap.add_argument(
        "--confirm-top",
        type=int,
        default=0,
        metavar="K",
        help="then measure the K fastest configs --confirm-runs more times each (default 0: none)",
    )
    ap.add_argument(
        "--confirm-runs", type=int, default=3, metavar="R", help="more runs per confirmed config (default 3)"
    )
    args = ap.parse_args(argv)
    for name, value, least in (
        ("--repeats", args.repeats, 1),
        ("--confirm-top", args.confirm_top, 0),
        ("--confirm-runs", args.confirm_runs, 1),
    ):
        if value < least:
            ap.error(f"argument {name}: must be at least {least}, got {value}")

    recipe = load_recipe(args.recipe)
    family = resolve_family(recipe.hardware.device)
    device = describe(family)
    space = load_space(recipe.search.space or family).narrow(recipe.search.overrides)
    configs = list(space.configs(recipe, device))[: args.limit]
    budget = budget_bytes(recipe, device)
    out = Path(args.out)
    fp = fingerprint(family)
    peaks = device_priors(device).peak_flops if family == "cpu" else None
    order = "listed" if args.listed else f"shuffled passes, seed {args.seed}"
    earlier: dict[str, dict] = {}  # rows of a table being resumed, by key
    recorded: str | None = None  # how its rows were measured ("" where it does not say)
    if out.exists():
        header, measured = read_table(out)
        earlier = {r["key"]: r for r in measured}
        fp, peaks, recorded = _resumed_header(header, fp, peaks, family)
    have = {k: int(r["runs"] or 0) for k, r in earlier.items()}
    print(
        f"{len(configs)} configs, {sum(have.get(c.key(), 0) >= args.repeats for c in configs)} already "
        f"measured, {args.repeats} repeats each",
        flush=True,
    )

    # A config measured in some passes before an interruption runs only the passes it missed.
    todo = [(i, c) for i, c in enumerate(configs) if have.get(c.key(), 0) < args.repeats]
    results: dict[int, list] = {i: [] for i, _ in todo}
    ests = {i: int(estimate(recipe, c, device).peak_mem_bytes) for i, c in todo}

    def rows() -> list[dict]:
        """Every config in the space's order: measured before, measured now (so far), or not yet."""
        out_rows = []
        for i, config in enumerate(configs):
            before = earlier.get(config.key())
            if results.get(i):
                out_rows.append(_aggregate(config, results[i], ests[i], before))
            elif before is not None:
                out_rows.append(before)
        return out_rows

    def write(table: list[dict], order: str) -> None:
        _write(out, recipe, fp, budget, args.repeats, table, peaks, order)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tuner-table-") as tmp:

        def measure(
            schedule: list[tuple[int, int, Config]], into: dict[int, list], what: str, checkpoint
        ) -> None:
            for n, (rep, i, config) in enumerate(schedule, 1):
                spec = TrialSpec(
                    recipe=recipe.to_dict(),
                    config=config.to_dict(),
                    family=family,
                    workdir=str(Path(tmp) / f"c{i}-{what}{rep}"),
                    timeout_s=recipe.measure.timeout_s,
                    estimated_peak_mem_bytes=ests[i],
                    memory_budget_bytes=budget,
                    tag=f"{i}-{what}{rep}",
                )
                res = run_trial(spec)
                into[i].append(res)
                print(
                    f"[{n}/{len(schedule)}] {what} {rep + 1} {time.perf_counter() - t0:6.0f}s {res.status:>7} "
                    f"{res.tokens_per_s or 0:>9.0f} tok/s  {json.dumps(config.active_params())}",
                    flush=True,
                )
                if n % 10 == 0:
                    checkpoint()

        # One pass per repeat, each in its own random order (unless --listed): a slow minute of
        # the machine then falls on a random handful of configs, once each, instead of on a block
        # of neighbouring configs (the space's order groups configs of one split and micro-batch
        # size), which reads as an effect of that split and size.
        schedule = _schedule(todo, args.repeats, args.listed, args.seed)
        schedule = [t for t in schedule if t[0] >= have.get(t[2].key(), 0)]
        if recorded is not None:
            order = _resumed_order(recorded, order, bool(schedule))
        measure(schedule, results, "run", lambda: write(rows(), order))
        table = rows()
        if args.confirm_top:
            table, order = _confirm(
                table, configs, args, measure, ests, lambda c: estimate(recipe, c, device), write, order
            )
    write(table, order)
    print(f"wrote {out} ({len(table)} configs) in {time.perf_counter() - t0:.0f}s")
    return 0


def _resumed_header(header: dict, fp: dict, peaks, family: str):
    """(fingerprint, peaks, order) of a table being resumed, to write back: its own record of the
    machine that measured it (this machine's timing of the same CPU differs from run to run, and
    the table's priors come from it), with a warning when this machine is another CPU."""
    theirs = json.loads(header.get("fingerprint") or "{}")
    if theirs and family == "cpu" and not same_cpu(theirs, describe("cpu")):
        print(
            f"warning: the table was measured on {theirs.get('device')!r} "
            f"({theirs.get('cpu_model') or 'model not recorded'}); runs added here mix two machines",
            file=sys.stderr,
        )
    kept_peaks = json.loads(header["peak_flops"]) if "peak_flops" in header else peaks
    return theirs or fp, kept_peaks, header.get("order", "")


def _resumed_order(recorded: str, order: str, measuring: bool) -> str:
    """The `# order:` of a resumed table: what it recorded, unless this run measures more of it in
    another order, which is then appended."""
    if not measuring or recorded == order or recorded.startswith(order + ";"):
        return recorded
    return f"{recorded or 'order not recorded'}; resumed as {order}"


def _confirm(table: list[dict], configs: list, args, measure, ests: dict, est, write, order: str):
    """Measure the `--confirm-top` fastest configs `--confirm-runs` more times, in passes of their
    own random order (seeded apart from the main passes'), and fold the runs into their rows."""
    index = {c.key(): i for i, c in enumerate(configs)}
    targets = confirm_targets(table, args.repeats, args.confirm_top, args.confirm_runs)
    earlier = {r["key"]: r for r in table}
    todo = [(index[k], configs[index[k]]) for k in targets]
    for i, c in todo:
        if i not in ests:
            ests[i] = int(est(c).peak_mem_bytes)
    print(f"confirming the {args.confirm_top} fastest: {len(todo)} configs to measure again", flush=True)
    # A resumed confirmation measures only the runs still missing.
    schedule = [
        t for t in _schedule(todo, args.confirm_runs, False, args.seed + 1) if t[0] < targets[t[2].key()]
    ]
    new: dict[int, list] = {i: [] for i, _ in todo}

    def merged() -> list[dict]:
        fold = {
            configs[i].key(): _aggregate(configs[i], rs, ests[i], earlier[configs[i].key()], confirming=True)
            for i, rs in new.items()
            if rs
        }
        return [fold.get(r["key"], r) for r in table]

    note = (
        f"the {args.confirm_top} fastest by their first {args.repeats} runs confirmed "
        f"by {args.confirm_runs} more each, shuffled passes, seed {args.seed + 1}"
    )
    if note not in order:  # a resumed confirmation is the same one
        order = f"{order}; {note}"
    measure(schedule, new, "confirm", lambda: write(merged(), order))
    return merged(), order


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
