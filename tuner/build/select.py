"""Which trial a build compiles: the study's winner (`rank_trials`) or the one asked for, and what
compiling it means (`build_plan`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tuner.build.base import NoStudyError, NoTrialError
from tuner.config import Config, infeasible_reasons
from tuner.devices import DeviceInfo
from tuner.recipe import Recipe
from tuner.record import keys


def load_trial(
    recipe: Recipe, fp: dict[str, Any], name: str | None, number: int | None, url: str
) -> tuple[str, int, Config, dict[str, Any]]:
    """(study name, trial number, Config, measured metrics) of the trial to build; the study is
    `name`, or by default the recipe's on the machines whose fingerprint is `fp`."""
    import sqlalchemy

    from tuner.db import session_scope
    from tuner.record.reader import read_study
    from tuner.storage import missing_database
    from tuner.study import study_name as make_study_name

    name = name or make_study_name(recipe, fp)
    study = None
    if not missing_database(url):  # a SQLite file not there holds no study; reading would make it
        with session_scope(url) as session:
            study = read_study(session, name)
    if study is None:
        shown = sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
        raise NoStudyError(
            f"no study {name!r} for recipe {recipe.name!r} on this machine in {shown}; "
            "run `tuner tune RECIPE` first (or pass --storage where it ran)"
        )
    measured = [t for t in study.trials if t.completed and t.attrs.get(keys.TOKENS_PER_S)]
    valid = sorted(t.number for t in measured)
    if number is None:
        best = study.ranking().best
        if best is None and valid:
            raise NoTrialError(
                f"no trial of {name!r} qualifies as the best (loss drift or memory budget); "
                f"pick one with --trial N; valid: {', '.join(map(str, valid))}",
                valid,
            )
        if best is None:
            raise NoTrialError(
                f"study {name!r} has no measured trial yet; run `tuner tune RECIPE` first", valid
            )
        number = best.trial
    trial = next((t for t in measured if t.number == number), None)
    if trial is None:
        shown = ", ".join(map(str, valid)) or "none"
        raise NoTrialError(
            f"--trial {number}: no measured trial with that number in {name!r}; valid: {shown}", valid
        )
    metrics = {k: trial.attrs[k] for k in keys.RESULT_KEYS if k in trial.attrs}
    return name, number, trial.config(), metrics


def machine_refusal(
    config: Config, recipe: Recipe, family: str, number: int, have: int, where: str = "this machine"
) -> str | None:
    """Why the machine that builds (`where`: this one, or a Ray node), with `have` devices of
    `family`, cannot build trial `number` (None when it can). A build compiles and measures every
    rank of the config on one machine, in one process group: a winner over several nodes builds
    where one machine holds all its ranks, not across the cluster. On an accelerator each rank needs
    a device of its own, and the ranks past the machine's count would each fail on a device it
    lacks; CPU ranks can share cores (slower, but the build's kernels are the same), so a CPU
    winner builds anywhere."""
    world, nodes = config.world_size, recipe.hardware.nodes
    if family == "cpu" or nodes == 1 or world <= have:
        return None
    return (
        f"trial {number} runs over {nodes} nodes ({world} {family} devices), and `tuner build` compiles "
        f"and measures all of its ranks on one machine, but {where} has {have}: building across "
        f"several machines is not supported yet. Run `tuner build` on a machine with {world} {family} "
        "devices, against the same database"
    )


def build_plan(config: Config, recipe: Recipe, info: DeviceInfo) -> tuple[Config, str | None]:
    """The config to compile, and why nothing will be compiled (None when it will be).

    A winner that already compiles is built as is and compared with compile=none; an eager one is
    built with compile=default and compared with its own eager number, re-measured. `info`: the
    devices the build runs on as the executor describes them (a Ray cluster's nodes: the machine
    running the command may have none of them).
    """
    if config.compile != "none":
        return config, None
    if info.family == "npu":
        return config, "torch.compile is not driven on Ascend NPU, so the kernel part is not produced there"
    candidate = dataclasses.replace(config, compile="default")
    before = set(infeasible_reasons(config, recipe, info))
    reasons = [r for r in infeasible_reasons(candidate, recipe, info) if r not in before]
    if reasons:
        return config, f"compile=default cannot run with this config ({'; '.join(reasons)})"
    return candidate, None
