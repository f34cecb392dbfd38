"""What a night is judged by: the verdict words, the band a change must leave (the threshold or
the two nights' measurement noise), the drift against the recent nights, which nights compare at
all (`night_key`), and the exit code cron mails on."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tuner.nightly.history import Outcome, Previous
    from tuner.recipe import Recipe

# Verdicts, as stored in nightly_results.verdict and the JSON report ("regression" is the word the
# dashboard's history page looks for).
IMPROVED, UNCHANGED, REGRESSED, FIRST_RUN, FAILED = (
    "improved",
    "unchanged",
    "regression",
    "first_run",
    "failed",
)
VERDICTS = (IMPROVED, UNCHANGED, REGRESSED, FIRST_RUN, FAILED)
# A night is also judged against the median best of this many earlier nights (at least
# MIN_DRIFT_NIGHTS of them): each night within the band of the one before can still add up.
DRIFT_NIGHTS, MIN_DRIFT_NIGHTS = 7, 3


def night_key(recipe: Recipe) -> str:
    """What makes two nights' bests comparable (stored as `recipe_hash`): `Recipe.hash()`, what
    changes a measurement, and the space the best is taken over (`search.space`, `overrides`,
    `objective`), since narrowing it can lower the best with nothing regressed. A recipe that leaves
    those at their defaults keys as `Recipe.hash()`, as its nights were stored before the space
    counted."""
    import hashlib
    import json

    search, defaults = recipe.search, type(recipe.search).model_fields
    space = {
        "space": search.space,
        "overrides": {k: sorted(v, key=repr) for k, v in search.overrides.items()},
        "objective": search.objective,
    }
    space = {k: v for k, v in space.items() if v != (defaults[k].get_default(call_default_factory=True))}
    if not space:
        return recipe.hash()
    blob = json.dumps({"recipe": recipe.hash(), **space}, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def judge(
    new: float | None, previous: float | None, threshold: float, noise_pct: float | None = None
) -> tuple[str, float | None]:
    """(verdict, change in percent). A change inside the band is unchanged: +-threshold, or the
    two nights' measurement noise (`noise_band`) where that is wider, so a machine whose runs
    differ by more than the threshold does not raise a regression on a night nothing changed."""
    if new is None:
        return FAILED, None
    if previous is None:
        return FIRST_RUN, None
    change = (new - previous) / previous * 100
    if change < -band(threshold, noise_pct):
        return REGRESSED, change
    if change > band(threshold, noise_pct):
        return IMPROVED, change
    return UNCHANGED, change


def band(threshold: float, noise_pct: float | None) -> float:
    """The change (percent) a night must leave to count: the threshold, or the noise if wider."""
    return max(threshold * 100, noise_pct or 0.0)


def noise_band(new: float | None, new_ci: float | None, previous: Previous | None) -> float | None:
    """The 95% interval of tonight's best minus the compared night's, in percent of the latter
    (`ranking.difference_half_width`, the tie rule's); None when either night has no interval."""
    if new is None or new_ci is None or previous is None or previous.best_ci is None:
        return None
    from tuner.record.ranking import difference_half_width

    width = difference_half_width(new, new_ci, previous.best_tokens_per_s, previous.best_ci)
    return width / previous.best_tokens_per_s * 100


def judge_drift(o: Outcome, earlier: list[Any]) -> None:
    """An unchanged or improved night whose best lies below the median best of the recipe's
    `earlier` nights (`_earlier`) on the same fingerprint by more than tonight's band is a
    regression too: a decline of a few percent a night never leaves the band of the night before,
    and a night that recovers part of a regression is still one."""
    if o.verdict not in (UNCHANGED, IMPROVED) or o.best_tokens_per_s is None or o.band_pct is None:
        return
    rows = [
        r
        for r in earlier
        if r.best_tokens_per_s is not None
        and r.fingerprint_hash == o.fingerprint_hash
        and r.recipe_hash in (None, o.recipe_hash)
    ][:DRIFT_NIGHTS]
    if len(rows) < MIN_DRIFT_NIGHTS:
        return
    reference = statistics.median(r.best_tokens_per_s for r in rows)
    o.drift_reference_tokens_per_s, o.drift_nights = reference, len(rows)
    o.drift_pct = (o.best_tokens_per_s - reference) / reference * 100
    if o.drift_pct < -o.band_pct:
        o.verdict = REGRESSED


def exit_code(outcomes: list[Outcome]) -> int:
    """1 when any recipe regressed beyond the threshold or failed (cron mail, CI), else 0."""
    return 1 if any(o.verdict in (REGRESSED, FAILED) for o in outcomes) else 0
