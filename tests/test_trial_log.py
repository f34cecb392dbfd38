"""Each launch of a trial's ranks starts its own trial.log (`tuner.executors.local._run_once`): a
port-clash retry, or a rerun in a reused directory (`tuner measure --workdir`), is shown and judged
by its own output only. What the directory holds besides a launch's records stays.

Real processes throughout: a few-line rank that joins a real gloo group, and the real workload
(tiny GPT, 2 gloo ranks).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tuner.executors import local
from tuner.executors.local import run_trial
from tuner.result import TrialSpec

pytestmark = pytest.mark.slow

# One rank: joins a gloo group with its peer, all-reduces, says which launch it belongs to. Faults
# (TRIAL_LOG_FAULT): "port", rank 0's first attempt finds its rendezvous port taken; "oom-text" and
# "exit2", rank 1 prints an error and exits without an error record, so the trial's message and
# status come from trial.log's tail.
GLOO_RANK = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist

    spec = json.load(open(sys.argv[1]))
    wd, rank = spec["workdir"], int(os.environ["RANK"])
    fault, launch = os.environ.get("TRIAL_LOG_FAULT", ""), os.environ["TRIAL_LOG_LAUNCH"]
    if fault == "port" and rank == 0 and not os.path.exists(os.path.join(wd, "clashed")):
        open(os.path.join(wd, "clashed"), "w").close()
        print("RuntimeError: The server socket has failed to listen: address already in use", flush=True)
        os._exit(1)
    dist.init_process_group("gloo")
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"launch {launch}: rank {rank} of {dist.get_world_size()} summed {total.item():g}", flush=True)
    errors = {"oom-text": ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", 3),
              "exit2": ("ValueError: shard 3 of the data set is empty", 2)}
    if rank == 1 and fault in errors:
        print(errors[fault][0], flush=True)
        os._exit(errors[fault][1])
    if rank == 0:
        with open(os.path.join(wd, "result.json"), "w") as f:
            json.dump({"status": "ok", "step_time_s": 0.01, "measured_s": 0.02}, f)
    os._exit(0)
    """
)

TINY_RECIPE = {
    "name": "log-test",
    "model": {"family": "gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256},
    "train": {"global_batch_size": 8},
    "hardware": {"device": "cpu", "devices": 2},
    "measure": {"warmup_steps": 1, "steps": 2},
}


@pytest.fixture
def gloo_rank(tmp_path, monkeypatch):
    (tmp_path / "gloo_rank.py").write_text(GLOO_RANK)
    monkeypatch.setattr(local, "RANK_MODULE", "gloo_rank")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def spec_in(workdir: Path, tag: str = "t") -> TrialSpec:
    return TrialSpec(
        recipe=TINY_RECIPE, config={"dp": 2}, family="cpu", workdir=str(workdir), timeout_s=120, tag=tag
    )


def launch_lines(log: str) -> list[str]:
    """The lines the ranks printed about their launch, in the log's order."""
    return [line for line in log.splitlines() if "] launch " in line]


def test_a_port_clash_retry_logs_only_the_attempt_that_counted(gloo_rank):
    workdir = gloo_rank / "trial-port"
    res = run_trial(spec_in(workdir), env={"TRIAL_LOG_FAULT": "port", "TRIAL_LOG_LAUNCH": "one"})
    assert res.status == "ok", res.error
    # The earlier attempt is on record as a retry, and what it left beside its records stays.
    assert res.extra["port_retries"] == 1 and (workdir / "clashed").is_file()
    log = (workdir / "trial.log").read_text()
    assert Path(res.log_path) == workdir / "trial.log"
    assert "address already in use" not in log and "address already in use" not in res.log_tail
    assert sorted(launch_lines(log)) == [
        "[rank0] launch one: rank 0 of 2 summed 3",
        "[rank1] launch one: rank 1 of 2 summed 3",
    ]


def test_a_rerun_in_the_same_directory_is_judged_by_its_own_output(gloo_rank):
    """The first launch ran out of memory (by its log: no error record); the second, in the same
    directory, failed otherwise. Read with the first one's log still in the file, the second was
    an out-of-memory too, with the first one's message."""
    workdir = gloo_rank / "trial-reused"
    first = run_trial(spec_in(workdir), env={"TRIAL_LOG_FAULT": "oom-text", "TRIAL_LOG_LAUNCH": "first"})
    assert first.status == "oom" and "CUDA out of memory" in first.error, first.error
    (workdir / "notes.txt").write_text("kept")  # the user's, in a directory given to `--workdir`
    second = run_trial(spec_in(workdir), env={"TRIAL_LOG_FAULT": "exit2", "TRIAL_LOG_LAUNCH": "second"})
    assert (second.status, second.error_kind) == ("error", "exit_code"), second.error
    assert second.error == "rank 1 exited with code 2: ValueError: shard 3 of the data set is empty"
    log = (workdir / "trial.log").read_text()
    assert "out of memory" not in log and "out of memory" not in second.log_tail
    assert sorted(launch_lines(log)) == [
        "[rank0] launch second: rank 0 of 2 summed 3",
        "[rank1] launch second: rank 1 of 2 summed 3",
    ]
    # The first launch's output lives on in its own result (what the study records), and the
    # directory's other files stay.
    assert "CUDA out of memory" in first.log_tail and "launch first" in first.log_tail
    assert (workdir / "notes.txt").read_text() == "kept"


def test_a_real_trial_rerun_in_its_directory_logs_that_run_only(tmp_path):
    """The real workload, 2 gloo ranks: a failed run, then a good one in the same directory."""
    spec = spec_in(tmp_path / "trial-real", tag="real")
    failed = run_trial(spec, env={"TUNER_TEST_FAULT": "raise", "TUNER_TEST_FAULT_RANK": "1"})
    assert failed.status == "error" and "injected failure" in failed.error, failed.error
    assert "injected failure" in Path(failed.log_path).read_text()
    ok = run_trial(spec)
    assert ok.status == "ok", ok.error
    log = Path(ok.log_path).read_text()
    assert "injected failure" not in log and "Traceback" not in log
    assert sum(line.startswith("[rank0] trial real:") for line in log.splitlines()) == 1
    assert "[rank0] ok: step" in ok.log_tail
