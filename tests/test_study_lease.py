"""One driver per study, whatever started it (`tuner.resume.claim_study`): a second driver of a
study whose driver is alive is refused with a message naming it; a dead or silent one frees it.
Real storages (SQLite and PostgreSQL through `db_url`), real processes for the pids."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import optuna
import pytest
from test_db import db_url  # noqa: F401 - the fixture

from tuner.record import keys
from tuner.resume import STALE_AFTER_S, StudyBusy, claim_study, new_owner, release_study


def _study(url: str) -> optuna.Study:
    return optuna.create_study(study_name="leased", storage=url, load_if_exists=True)


def _holder(pid: int, host: str | None = None) -> dict:
    return {"host": host or socket.gethostname(), "pid": pid, "id": f"other-{pid}"}


def _hold(study: optuna.Study, owner: dict, beat: float) -> None:
    study._storage.set_study_system_attr(
        study._study_id, keys.STUDY_DRIVER, {"owner": owner, "heartbeat": beat}
    )


def test_a_live_driver_keeps_a_second_out_and_its_death_frees_the_study_at_once(db_url):  # noqa: F811
    study = _study(db_url)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _hold(study, _holder(other.pid), time.time())
        with pytest.raises(
            StudyBusy, match=rf"another driver \(pid {other.pid} on host .*search.reuse: false"
        ):
            claim_study(study, new_owner())
        release_study(study, new_owner())  # not ours to free
        with pytest.raises(StudyBusy):
            claim_study(study, new_owner())
    finally:
        other.kill()
        other.wait()
    me = new_owner()
    claim_study(study, me)  # kill -9 of the other driver: no wait for its heartbeat to go stale
    held = study._storage.get_study_system_attrs(study._study_id)[keys.STUDY_DRIVER]
    assert held["owner"] == me
    release_study(study, me)
    assert study._storage.get_study_system_attrs(study._study_id)[keys.STUDY_DRIVER] is None


def test_a_driver_on_another_host_holds_the_study_until_its_heartbeat_is_stale(db_url):  # noqa: F811
    study = _study(db_url)
    elsewhere = _holder(1, host="another-machine")
    _hold(study, elsewhere, time.time() - 5)
    with pytest.raises(StudyBusy, match="pid 1 on host another-machine, last heartbeat 5 s ago"):
        claim_study(study, new_owner())
    _hold(study, elsewhere, time.time() - STALE_AFTER_S - 1)
    claim_study(study, new_owner())
