"""The executor contract (tuner/executors/base.py), run against every executor: what the study
relies on when it hands trials to the local machine or to a Ray cluster."""

from __future__ import annotations

import pytest
from conftest_ray import start_ray_runtime, tiny_spec, trial_pids, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_runtime():
    ray = start_ray_runtime()
    yield ray
    ray.shutdown()


@pytest.fixture(params=["local", "ray"])
def make_executor(request):
    """Builds executors of one kind (with extra trial environment) and closes them after the test."""
    made = []

    def make(env: dict[str, str] | None = None):
        if request.param == "local":
            from tuner.executors.local import LocalExecutor

            ex = LocalExecutor(env=env)
        else:
            from tuner.executors.ray_executor import RayExecutor

            request.getfixturevalue("ray_runtime")
            # A lease dir of its own: trials of other users of this host cannot hold up the test.
            ex = RayExecutor(env=env, lease_dir=str(request.getfixturevalue("tmp_path") / "leases"))
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.close()


class TestExecutorContract:
    def test_each_trial_comes_back_once_ok_with_its_tag(self, make_executor, tmp_path):
        ex = make_executor()
        specs = [tiny_spec(tmp_path, "trial-0"), tiny_spec(tmp_path, "trial-1")]
        results, queue = [], list(specs)
        while queue or ex.running():
            # Like the study: start what fits, then wait for something to finish.
            while queue and ex.free_slots(queue[0]) > 0:
                ex.submit(queue.pop(0))
            results += ex.wait(timeout=1.0)
        results += ex.wait(timeout=0.5)  # nothing more may come

        assert sorted(r.tag for r in results) == ["trial-0", "trial-1"]
        for r in results:
            assert r.status == "ok", r.error
            assert r.step_time_s > 0 and r.tokens_per_s > 0
            assert r.wall_s >= r.measured_s > 0
            assert "ok: step" in r.log_tail
        assert ex.running() == []

    def test_failing_trial_is_a_result_not_an_exception(self, make_executor, tmp_path):
        ex = make_executor(env={"TUNER_TEST_FAULT": "raise"})
        result = ex.run(tiny_spec(tmp_path, "broken"))

        assert result.status == "error"
        assert result.tag == "broken"
        assert "injected failure" in result.error
        assert "injected failure" in result.log_tail

    def test_busy_devices_have_no_free_slot_and_cancel_leaves_no_process(self, make_executor, tmp_path):
        ex = make_executor(env={"TUNER_TEST_FAULT": "hang"})
        busy = tiny_spec(tmp_path, "hangs", ranks=2)  # both CI cores
        ex.submit(busy)
        # The launcher and both ranks are up: the trial truly holds the devices now.
        wait_for(lambda: len(trial_pids(busy)) == 3, 90, "the hanging trial's 3 processes")

        assert ex.running() == ["hangs"]
        assert ex.free_slots(tiny_spec(tmp_path, "another")) == 0
        with pytest.raises(RuntimeError):
            ex.submit(tiny_spec(tmp_path, "another"))

        ex.cancel()
        assert trial_pids(busy) == []
        assert ex.running() == []
        assert ex.wait(timeout=0.5) == []  # a cancelled trial is forgotten, not reported
