"""The nightly re-tune: warm-start each registered recipe from its last best, judge tonight's best
against the previous night's, keep one history row per recipe per night, and write the report.

`tuner nightly` (tuner/cli/nightly.py) is the command; these are its parts."""

from tuner.nightly.history import (
    Outcome,
    Previous,
    Tonight,
    Tune,
    find_previous,
    parse_run,
    previous_night_configs,
    record,
    run_recipe,
    run_tag,
    tonight_run,
)
from tuner.nightly.inputs import (
    NightlyError,
    find_recipes,
    next_start,
    parse_night,
    parse_threshold,
    seconds_until,
)
from tuner.nightly.report import render_markdown, write_report
from tuner.nightly.tuners import (
    ServiceError,
    api_tuner,
    history_name,
    local_tuner,
    nightly_job_name,
    nightly_study_name,
)
from tuner.nightly.verdict import (
    FAILED,
    FIRST_RUN,
    IMPROVED,
    REGRESSED,
    UNCHANGED,
    VERDICTS,
    exit_code,
    judge,
    night_key,
)

__all__ = [
    "FAILED",
    "FIRST_RUN",
    "IMPROVED",
    "REGRESSED",
    "UNCHANGED",
    "VERDICTS",
    "NightlyError",
    "Outcome",
    "Previous",
    "ServiceError",
    "Tonight",
    "Tune",
    "api_tuner",
    "exit_code",
    "find_previous",
    "find_recipes",
    "judge",
    "night_key",
    "local_tuner",
    "history_name",
    "nightly_job_name",
    "nightly_study_name",
    "parse_night",
    "parse_run",
    "parse_threshold",
    "record",
    "render_markdown",
    "run_recipe",
    "run_tag",
    "next_start",
    "seconds_until",
    "tonight_run",
    "previous_night_configs",
    "write_report",
]
