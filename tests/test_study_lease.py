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
from optuna.trial import TrialState
from test_db import db_url  # noqa: F401 - the fixture

from tuner.record import keys
from tuner.resume import STALE_AFTER_S, StudyBusy, beat_study, claim_study, new_owner, release_study


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


def test_a_driver_whose_study_was_taken_over_stops_instead_of_taking_it_back(db_url):  # noqa: F811
    """A driver silent past STALE_AFTER_S (a Ray cluster or a database that stopped answering, a
    suspended process) counts as dead and the next driver claims the study. Its next heartbeat
    wrote itself back over the new driver's claim, and both drove the study."""
    study = _study(db_url)
    first, second = new_owner(), new_owner()
    claim_study(study, first)
    _hold(study, first, time.time() - STALE_AFTER_S - 1)  # the first driver went silent
    claim_study(study, second)
    with pytest.raises(StudyBusy, match=rf"taken over by another driver \(pid {second['pid']} on host"):
        beat_study(study, first)
    release_study(study, first)  # not the first's to free any more
    beat_study(study, second)
    assert study._storage.get_study_system_attrs(study._study_id)[keys.STUDY_DRIVER]["owner"] == second


def test_a_study_taken_over_mid_run_starts_no_more_trials_and_requeues_the_running_ones(
    db_url,  # noqa: F811
    monkeypatch,
    tmp_path,
):
    from test_study import NARROW, FakeExecutor, make_recipe

    from tuner.study import run_study

    elsewhere = _holder(1, host="another-machine")

    class TakenOver(FakeExecutor):
        """At its first wait, with two trials running, another driver takes the study over."""

        taken_at: int | None = None

        def wait(self, timeout=None):
            if self.taken_at is None:
                _hold(optuna.load_study(study_name=optuna.get_all_study_names(db_url)[0], storage=db_url),
                      elsewhere, time.time())  # fmt: skip
                self.taken_at = len(self.submitted)
                return []
            return super().wait(timeout)

    monkeypatch.setattr("tuner.study.driver.HEARTBEAT_INTERVAL_S", 0.0)  # a heartbeat every turn
    recipe = make_recipe("taken-over", overrides={**NARROW, "micro_batch_size": [1, 2, 4, 8]})
    ex = TakenOver(slots=2)
    with pytest.raises(StudyBusy, match=r"taken over by another driver \(pid 1 on host another-machine\)"):
        run_study(recipe, storage_url=db_url, executor=ex, trials=6, sampler="random", remeasure_top=0,
                  workdir=tmp_path)  # fmt: skip
    assert ex.taken_at == 2 and len(ex.submitted) == 2, "the driver went on after losing its study"
    study = optuna.load_study(study_name=optuna.get_all_study_names(db_url)[0], storage=db_url)
    assert study._storage.get_study_system_attrs(study._study_id)[keys.STUDY_DRIVER]["owner"] == elsewhere
    trials = study.get_trials(deepcopy=False)
    stopped = [t for t in trials if t.user_attrs.get("cancelled")]
    assert len(stopped) == 2 and all(t.state == TrialState.FAIL for t in stopped)
    # Their configs wait in the queue for whoever drives the study now, once each.
    queued = [t.system_attrs["fixed_params"] for t in trials if t.state == TrialState.WAITING]
    assert sorted(sorted(p.items()) for p in queued) == sorted(sorted(t.params.items()) for t in stopped)


def test_a_live_driver_in_another_pid_namespace_of_this_host_name_keeps_its_study(db_url):  # noqa: F811
    """Containers on one host's network (docker --network host, pods with hostNetwork) share its
    host name but not its pids: a live driver there, pid N, was judged dead from here, where no
    pid N runs, and a second driver took its study (and failed its running trials as orphans)."""
    from tuner.executors.session import host_identity
    from tuner.resume import owner_alive

    study = _study(db_url)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # pid N is no process here
    there = {**_holder(gone.pid), "where": "another-boot/4026531999"}
    _hold(study, there, time.time())
    with pytest.raises(StudyBusy, match=rf"another driver \(pid {gone.pid} on host"):
        claim_study(study, new_owner())
    assert owner_alive(there, time.time(), time.time())  # its trials are not orphans either
    assert not owner_alive({**there, "where": host_identity()}, time.time(), time.time())
    assert not owner_alive(_holder(gone.pid), time.time(), time.time())  # an older owner: as before
    assert new_owner()["where"] == host_identity()  # what a driver records of itself
