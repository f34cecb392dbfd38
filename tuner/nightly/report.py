"""The nightly report: Markdown for people (a summary table, then each recipe's configs side by
side) and JSON for machines, one pair of files per night."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from tuner.nightly.history import Outcome
from tuner.nightly.verdict import FAILED, REGRESSED, VERDICTS, exit_code


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1f}%"


def render_markdown(outcomes: list[Outcome], night: dt.date, threshold: float) -> str:
    """The report for people: a summary table, then each recipe's configs side by side."""
    counts = {v: sum(o.verdict == v for o in outcomes) for v in VERDICTS}
    summary = ", ".join(f"{n} {v.replace('_', ' ')}" for v, n in counts.items() if n)
    lines = [
        f"# Nightly tuning report, {night.isoformat()}",
        "",
        f"{len(outcomes)} recipe{'' if len(outcomes) == 1 else 's'}: {summary}. Exit code {exit_code(outcomes)}: a drop of more than "
        f"{threshold * 100:g}% in the best tokens/s (or more than the two nights' measurement noise, where "
        "that is wider: the change column's band), or a failed recipe, fails the run.",
        "",
        "| recipe | verdict | previous best tokens/s | new best tokens/s | change "
        "| previous best config, re-measured tonight | fingerprint |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for o in outcomes:
        verdict = o.verdict.replace("_", " ")
        if o.verdict in (REGRESSED, FAILED):
            verdict = f"**{verdict.upper()}**"
        prev = _rate(o.previous_best_tokens_per_s)
        if o.previous_night:
            prev += f" ({o.previous_night.isoformat()})"
        fp = f"changed ({o.fingerprint_hash})" if o.fingerprint_changed else (o.fingerprint_hash or "—")
        change = _pct(o.change_pct)
        if o.change_pct is not None and o.band_pct is not None:
            change += f" (band ±{o.band_pct:.1f}%)"
        lines.append(
            f"| {o.recipe} | {verdict} | {prev} | {_rate(o.best_tokens_per_s)} | {change} "
            f"| {_rate(o.remeasured_previous_tokens_per_s)} | {fp} |"
        )
    for o in outcomes:
        lines += _section(o, threshold)
    return "\n".join(lines) + "\n"


def _section(o: Outcome, threshold: float) -> list[str]:
    """One recipe's part of the report: what ran, why the verdict, both configs side by side."""
    lines = ["", f"## {o.recipe}: {o.verdict.replace('_', ' ')}", ""]
    where = f"job {o.job_id}, " if o.job_id is not None else ""
    rerun = f"re-run {o.run} of this night (it replaces the earlier result), " if o.run > 1 else ""
    lines.append(
        f"Recipe `{o.source}`; {rerun}{where}study `{o.study_name or '—'}`; {o.trials} trials, "
        f"{o.warm_started} of them warm-started from the previous best configs."
    )
    if o.error:
        lines += ["", f"Error: `{o.error}`"]
    if o.band_pct is not None and o.band_pct > threshold * 100 and o.change_pct is not None:
        lines += [
            "",
            f"The two nights' bests are measured to ±{(o.best_ci or 0) * 100:.1f}% and "
            f"±{(o.previous_best_ci or 0) * 100:.1f}% (95% intervals), so a change counts beyond "
            f"±{o.band_pct:.1f}%, not ±{threshold * 100:g}%.",
        ]
    if o.verdict == REGRESSED and o.drift_pct is not None and o.drift_pct < -(o.band_pct or 0):
        recovered = (o.change_pct or 0) > (o.band_pct or 0)
        lines += [
            "",
            f"{'Still below the recent nights' if recovered else 'A slow decline'}: tonight's best is "
            f"{o.drift_pct:+.1f}% from the median best of the last {o.drift_nights} nights "
            f"({_rate(o.drift_reference_tokens_per_s)} tokens/s), beyond the ±{o.band_pct:.1f}% band, "
            f"though {'above' if recovered else 'within it of'} the night before.",
        ]
    if o.recipe_changed_since:
        lines += [
            "",
            f"The recipe changed since {o.recipe_changed_since.isoformat()} (another recipe under this "
            "name): tonight starts its history, not compared with those nights.",
        ]
    if o.fingerprint_changed:
        changes = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in o.fingerprint_changes.items())
        lines += [
            "",
            f"The hardware/software fingerprint changed since {o.previous_night} "
            f"({o.previous_fingerprint_hash} -> {o.fingerprint_hash}; {changes or 'details unknown'}); "
            "compared anyway.",
        ]
    if o.config or o.previous_config:
        lines += ["", "| knob | previous best | new best |", "| --- | --- | --- |"]
        prev_cfg, new_cfg = o.previous_config or {}, o.config or {}
        for knob in dict.fromkeys([*prev_cfg, *new_cfg]):
            a, b = prev_cfg.get(knob, "—"), new_cfg.get(knob, "—")
            mark = "**" if prev_cfg and new_cfg and a != b else ""  # what changed since last night
            lines.append(f"| {knob} | {a} | {mark}{b}{mark} |")
    return lines


def write_report(
    outcomes: list[Outcome], directory: Path, night: dt.date, threshold: float
) -> tuple[Path, Path]:
    """Write nightly-<night>.md and nightly-<night>.json into `directory`; returns both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    md = directory / f"nightly-{night.isoformat()}.md"
    js = directory / f"nightly-{night.isoformat()}.json"
    md.write_text(render_markdown(outcomes, night, threshold))
    doc = {
        "night": night.isoformat(),
        "threshold_pct": threshold * 100,
        "exit_code": exit_code(outcomes),
        "verdicts": {v: [o.recipe for o in outcomes if o.verdict == v] for v in VERDICTS},
        "recipes": [o.to_dict() for o in outcomes],
    }
    js.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return md, js
