"""Picking up what earlier drivers left: failing the trials of a dead driver so their configs run
again, and the configs of the most similar earlier study, which a new study starts with."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.config import Config
from tuner.executors.session import host_identity
from tuner.recipe import Recipe
from tuner.record import keys

STALE_AFTER_S = 60.0


def new_owner() -> dict[str, Any]:
    """Who drives a study: host and pid to check liveness (`where`: the boot and pid namespace
    that pid is of), a random id to tell runs apart."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "id": uuid.uuid4().hex,
        "where": host_identity(),
    }


def pid_dead(pid: int) -> bool:
    """Whether process `pid` of this host is gone (or a zombie nobody reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a killed child that its parent has not reaped yet is a zombie: dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _pids_shared(owner: dict[str, Any]) -> bool:
    """Whether the owner's pid numbers this host's processes: its host name, and its boot and pid
    namespace where it recorded them."""
    if owner.get("host") != socket.gethostname():
        return False
    here = host_identity()
    return owner.get("where", here) == here


def owner_alive(owner: dict[str, Any] | None, heartbeat: float | None, started: float) -> bool:
    """Whether the driver that owns a RUNNING trial may still be working on it.

    On this host a dead pid settles it at once (a restart right after kill -9 need not wait);
    elsewhere, a heartbeat older than STALE_AFTER_S does. Containers on one host's network
    (docker --network host, pods with hostNetwork) share its name but not its pids: an owner that
    recorded another pid namespace (`where`; older owners did not) is elsewhere.
    """
    if owner and _pids_shared(owner) and pid_dead(owner.get("pid", -1)):
        return False
    last = heartbeat if heartbeat is not None else started
    return time.time() - last < STALE_AFTER_S


class StudyBusy(RuntimeError):
    """Another live driver (a `tuner tune`, a worker's job) drives the study now."""


def _who(owner: dict[str, Any]) -> str:
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}"


def _holder(study: optuna.Study) -> dict[str, Any]:
    """The study's driver record (`keys.STUDY_DRIVER`): {"owner": ..., "heartbeat": ...}, or {}."""
    held = study._storage.get_study_system_attrs(study._study_id).get(keys.STUDY_DRIVER)
    return held if isinstance(held, dict) and isinstance(held.get("owner"), dict) else {}


def claim_study(study: optuna.Study, me: dict[str, Any]) -> None:
    """Make `me` the study's one driver, or raise StudyBusy naming the live one.

    Two drivers of one study would overrun its trial budget and overwrite each other's
    re-measurements (a read-modify-write of a study attribute); the job queue keeps two jobs apart,
    this keeps every entry point apart (a CLI `tuner tune` beside a worker's job). A driver that
    died frees the study as its trials do (`owner_alive`: a dead pid on this host at once, else a
    heartbeat older than STALE_AFTER_S). Two drivers starting within the same moment can both
    pass: the read back after the write narrows that to the gap between two database writes."""
    held = _holder(study)
    if held:
        owner, beat = held["owner"], held.get("heartbeat")
        if owner.get("id") != me["id"] and owner_alive(owner, beat, beat or 0.0):
            raise StudyBusy(
                f"study {study.study_name} is being tuned by another driver ({_who(owner)}, last "
                f"heartbeat {time.time() - (beat or 0.0):.0f} s ago); wait for it to finish (or cancel "
                f"its job), or tune a study of its own (search.reuse: false in the recipe)"
            )
    _write_beat(study, me)
    now = _holder(study)
    if now.get("owner", {}).get("id") != me["id"]:
        who = f" ({_who(now['owner'])})" if now else ""  # {}: it has freed the study again since
        raise StudyBusy(f"study {study.study_name} was claimed by another driver{who} just now")


def beat_study(study: optuna.Study, me: dict[str, Any]) -> None:
    """The study driver's heartbeat (`claim_study`), or StudyBusy once the study is another's.

    A driver silent for STALE_AFTER_S (a Ray cluster or a database that stopped answering, a
    suspended process) counts as dead, and the next driver takes the study over. Its heartbeat
    must not take the study back: both would drive it, as if the lease had never been."""
    held = _holder(study)
    if held and held["owner"].get("id") != me["id"]:
        raise StudyBusy(
            f"study {study.study_name} was taken over by another driver ({_who(held['owner'])}) "
            f"after this one's heartbeat went stale (none for {STALE_AFTER_S:.0f} s); this driver "
            f"stops and leaves the study to it (its running trials go back to the queue)"
        )
    _write_beat(study, me)


def _write_beat(study: optuna.Study, me: dict[str, Any]) -> None:
    study._storage.set_study_system_attr(
        study._study_id, keys.STUDY_DRIVER, {"owner": me, "heartbeat": time.time()}
    )


def release_study(study: optuna.Study, me: dict[str, Any]) -> None:
    """Free the study for the next driver, if `me` still holds it."""
    if _holder(study).get("owner", {}).get("id") == me["id"]:
        study._storage.set_study_system_attr(study._study_id, keys.STUDY_DRIVER, None)


def queued_params(t: FrozenTrial) -> dict[str, Any]:
    """The config a RUNNING trial stands for, to queue again: a queued trial's (the baseline, the
    fp32 reference, a retry) is in its fixed params from the moment `study.ask` starts it, its
    params only once the sampler has run (a model sampler refits first: a second or more)."""
    return t.system_attrs.get(keys.FIXED_PARAMS) or t.params


def queued_as(study: optuna.Study, role: str, params: dict[str, Any]) -> bool:
    """Whether a trial of `role` stands for `params` in the study (queued, running or finished).

    The baseline (and the fp32 reference) need a trial of their own, even where a trial of another
    role (last night's best, one a sampler drew beside them) has the same config and Optuna's
    `skip_if_exists` would queue none: the ranking finds the baseline by its role, and a baseline
    that is a duplicate names the trial whose run it reuses (`keys.DUPLICATE_OF`)."""
    return any(
        t.user_attrs.get(keys.ROLE) == role and queued_params(t) == params
        for t in study.get_trials(deepcopy=False)
    )


def recover_dead_trials(study: optuna.Study, trials: list[FrozenTrial], me: dict[str, Any]) -> int:
    """Fail RUNNING trials whose driver is gone and queue their configs again; returns how many."""
    storage = study._storage  # trials of another driver are only reachable through the storage
    failed = 0
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        owner = t.system_attrs.get(keys.OWNER)
        if owner and owner.get("id") == me["id"]:
            continue
        started = t.datetime_start.timestamp() if t.datetime_start else time.time()
        if owner_alive(owner, t.system_attrs.get(keys.HEARTBEAT), started):
            continue
        # The owner may finish the trial at this very moment; then it is not ours to fail.
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            storage.set_trial_user_attr(t._trial_id, keys.DRIVER_DIED, True)
            if storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                role = t.user_attrs.get(keys.ROLE) or keys.RETRY
                study.enqueue_trial(queued_params(t), user_attrs={keys.ROLE: role, keys.RETRY_OF: t.number})
                failed += 1
    return failed


def _shape_distance(shape: dict[str, Any], recipe: Recipe) -> float:
    mine = recipe.model
    keys = ("layers", "hidden", "heads", "seq_len", "vocab")
    return sum(abs(math.log(shape[k] / getattr(mine, k))) for k in keys)


def similar_study_configs(
    url: str, recipe: Recipe, fingerprint_hash: str, exclude: str, top: int = 3
) -> list[Config]:
    """The ranked top configs of the earlier study on this fingerprint, with the same device
    count, whose model shape is nearest (log-ratio distance over the model sizes): what a new
    study runs right after its baseline."""
    from tuner.db import session_scope
    from tuner.record.reader import study_attrs_of_all
    from tuner.summary import summarize

    best_name, best_distance = None, math.inf
    with session_scope(url) as session:
        studies = study_attrs_of_all(session, (keys.RECIPE, keys.FINGERPRINT_HASH))
    for name, attrs in studies.items():
        other = attrs.get(keys.RECIPE) or {}
        if name == exclude or attrs.get(keys.FINGERPRINT_HASH) != fingerprint_hash:
            continue
        if other.get("hardware", {}).get("devices") != recipe.hardware.devices:
            continue
        try:
            distance = _shape_distance(other.get("model", {}), recipe)
        except (KeyError, TypeError, ZeroDivisionError, ValueError):
            continue  # a study written by another version: not comparable
        if distance < best_distance:
            best_name, best_distance = name, distance
    if best_name is None:
        return []
    return [Config.from_params(e.config) for e in summarize(best_name, url, top_k=top).top_k]
