"""How a trial ended, from what its launcher and ranks left in the trial's directory: ok (rank 0's
result.json), oom (a device OOM, or the memory budget exceeded), error (the first failing rank's
error record, or the signal that killed it), timeout or cancelled. Never raises for a trial."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tuner.executors.session import signal_name
from tuner.record.status import ERROR, OK, OOM, TIMEOUT, is_oom_text
from tuner.result import TrialResult, TrialSpec

LOG_TAIL_LINES = 40
# What a rank reports when a peer died under it (gloo, NCCL/HCCL, the store): a consequence.
_PEER_LOST_TEXTS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "caused by a remote worker crashing",
)


# What a rank reports when a process it started (a data-loader worker, a compile worker) died by
# a signal: with the kernel's OOM killer counting a kill meanwhile, that is where it struck.
_CHILD_KILLED_TEXTS = (
    "is killed by signal: Killed",  # DataLoader, SIGKILL
    "exited unexpectedly",  # DataLoader, any worker death
    "terminated abruptly",  # concurrent.futures' BrokenProcessPool (Inductor's compile workers)
)
_OOM_KILLER_FIX = (
    "the machine, or the memory limit of the container the trial runs in, ran out; lower "
    "micro_batch_size or loader_workers, enable recompute or set hardware.memory_budget_gb below "
    "that memory"
)


def _lost_a_peer(err: dict | None) -> bool:
    text = (err or {}).get("error") or ""
    return any(t in text for t in _PEER_LOST_TEXTS)


def is_consequence(result: TrialResult) -> bool:
    """Whether a failed part of a trial (a node's result) failed because another part did: its
    first failed rank only lost a peer, or was ended by its launcher (`_consequence`)."""
    return result.error_kind == signal.Signals.SIGTERM.name or _lost_a_peer({"error": result.error})


def _consequence(err: dict | None, rc: int) -> bool:
    """A rank that failed because another did: it lost a peer, or its launcher ended it (SIGTERM,
    no error record: the launcher terminates the rest `FAIL_GRACE_S` after the first failure)."""
    return _lost_a_peer(err) or (err is None and rc == -signal.SIGTERM)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def classify(
    spec: TrialSpec, workdir: Path, launcher_rc: int | None, ended: str, expect_result: bool = True
) -> TrialResult:
    """`expect_result=False` for a node of a multi-node trial other than node 0: its ranks write no
    result.json, so all of them exiting 0 is an ok without metrics."""
    if ended == "timeout":
        return _timed_out(spec, workdir)
    if ended == "cancelled":
        return TrialResult(status=ERROR, error_kind="cancelled", error="trial was cancelled")
    exits = read_json(workdir / "exits.json")
    if exits is None:
        launcher_log = tail(workdir / "launcher.log", 10)
        return TrialResult(
            status=ERROR,
            error_kind="launcher",
            error=f"trial launcher exited with code {launcher_rc} before recording the ranks: {launcher_log}",
        )
    # The first rank to fail is the cause; later ones usually lost a peer. Exit order says which
    # came first unless a peer's lost-connection error exited as fast (both within 1 ms seen), so
    # a rank that only lost a peer never comes before one that failed on its own.
    order = [(int(e["rank"]), int(e["returncode"])) for e in exits["exits"]]
    failed = [(r, rc) for r, rc in order if rc != 0]
    errors = {r: read_json(workdir / f"rank{r}.error.json") for r, _ in failed}
    failed.sort(key=lambda f: _consequence(errors[f[0]], f[1]))  # stable: exit order within each kind
    if not failed and not expect_result:
        return TrialResult(status=OK)
    if not failed:
        data = read_json(workdir / "result.json")
        if data is None:
            return TrialResult(
                status=ERROR,
                error_kind="no_result",
                error="all ranks exited 0 but rank 0 wrote no result.json",
            )
        result = TrialResult.from_dict(data)
        return _check_budget(spec, result)
    # An out-of-memory on any rank is never a consequence of another rank failing.
    for r, _ in failed:
        err = errors[r]
        if err and err.get("status") == OOM:
            return _failed_result(OOM, r, err)
    rank, rc = failed[0]
    err = errors.get(rank)
    if err and _child_oom_killed(err, exits.get("oom_kills")):
        return TrialResult(
            status=OOM,
            error_kind="oom_killer",
            error=f"rank {rank}: a process it started was killed, and the kernel's out-of-memory killer "
            f"killed {exits['oom_kills']} process(es) while the trial ran: {_OOM_KILLER_FIX} "
            f"({err.get('error', '')[:300]})",
        )
    if err:
        return _failed_result(err.get("status", ERROR), rank, err)
    if rc < 0:
        return _killed(rank, signal_name(rc), exits.get("oom_kills"))
    log_tail = tail(workdir / "trial.log", LOG_TAIL_LINES)
    if is_oom_text(log_tail):
        return TrialResult(status=OOM, error_kind="oom", error=f"rank {rank}: {_last_error_line(log_tail)}")
    return TrialResult(
        status=ERROR,
        error_kind="exit_code",
        error=f"rank {rank} exited with code {rc}: {_last_error_line(log_tail)}",
    )


def _killed(rank: int, name: str, oom_kills: int | None) -> TrialResult:
    """A rank killed by a signal, with no error record of its own. Nothing here sends SIGKILL before
    a failure or the deadline; the kernel's OOM killer does, and its count says whether it did."""
    if name == "SIGKILL" and oom_kills:
        return TrialResult(
            status=OOM,
            error_kind="oom_killer",
            error=f"rank {rank} was killed by the kernel's out-of-memory killer (it killed {oom_kills} "
            f"process(es) while the trial ran): {_OOM_KILLER_FIX}",
        )
    hint = ""
    if name == "SIGKILL":
        hint = (
            " (not the kernel's out-of-memory killer, by its count)" if oom_kills == 0 else " (check `dmesg`)"
        )
    return TrialResult(status=ERROR, error_kind=name, error=f"rank {rank} was killed by {name}{hint}")


def _child_oom_killed(err: dict, oom_kills: int | None) -> bool:
    """Whether a rank's error record says a process it started died, while the kernel's OOM
    killer counted kills: the rank itself survived to report it, its worker did not."""
    text = err.get("error") or ""
    return bool(oom_kills) and err.get("status") != OOM and any(t in text for t in _CHILD_KILLED_TEXTS)


def _timed_out(spec: TrialSpec, workdir: Path) -> TrialResult:
    """A trial killed at its deadline. A rank that failed before it left its record, and its
    peers then hung in a collective until the deadline: that failure is the cause, not the timeout."""
    causes = {r: err for r, err in _rank_errors(workdir).items() if not _lost_a_peer(err)}
    if causes:
        rank = min(causes, key=lambda r: (causes[r].get("status") != OOM, r))  # an oom first
        return _failed_result(causes[rank].get("status", ERROR), rank, causes[rank])
    return TrialResult(
        status=TIMEOUT,
        error_kind="timeout",
        error=f"trial ran past its timeout of {spec.timeout_s:g}s and was killed",
    )


def _rank_errors(workdir: Path) -> dict[int, dict]:
    """The error records the ranks wrote (`rank<N>.error.json`), by rank."""
    out = {}
    for path in workdir.glob("rank*.error.json"):
        rank = path.name[len("rank") : -len(".error.json")]
        if rank.isdigit() and (err := read_json(path)) is not None:
            out[int(rank)] = err
    return out


def _failed_result(status: str, rank: int, err: dict) -> TrialResult:
    status = status if status in (OOM, ERROR) else ERROR
    return TrialResult(
        status=status,
        error_kind=err.get("error_kind") or status,
        error=f"rank {rank}: {err.get('error') or 'failed without a message'}",
        extra={"traceback": err.get("traceback")} if err.get("traceback") else {},
    )


def _check_budget(spec: TrialSpec, result: TrialResult) -> TrialResult:
    budget = spec.memory_budget_bytes
    peak = result.budget_peak
    if result.status == OK and budget and peak and peak > budget:
        result.status = OOM
        result.error_kind = "budget"
        result.error = (
            f"measured peak memory {peak / 2**30:.2f} GiB exceeds the memory budget {budget / 2**30:.2f} GiB"
        )
    return result


def _last_error_line(text: str) -> str:
    lines = [ln.split("] ", 1)[-1].strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line[:500]
    return lines[-1][:500] if lines else "no output"


def tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a text file ("" when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * lines))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])
