"""What a user reads about a job, worded once for every view (REST, dashboard, CLI): its progress,
with the trials it reused from earlier runs of the same study, and its failure in one line."""

from __future__ import annotations

ERROR_CHARS = 300  # a one-line error longer than this is cut; the whole text is in the job's log


def progress_line(done: int, total: int, reused: int | None) -> str:
    """`6 of 6: reused from 12 measured earlier`: the job's own budget, never `12/6`. A study is
    keyed by recipe and fingerprint, so a job finds the measured trials of earlier runs (a CLI
    run, another job) and counts them; `search.reuse: false` starts a fresh study instead."""
    reused = reused or 0
    shown = min(done, total) if total else done
    if reused <= 0:
        return f"{shown} of {total}"
    if reused >= total:
        return f"{total} of {total}: reused from {reused} measured earlier"
    return f"{shown} of {total}: {reused} reused from earlier, {max(0, done - reused)} measured now"


def one_line(text: str | None) -> str | None:
    """The line of an error text a user should read: a traceback's last line (the exception),
    else its first non-empty line, cut to `ERROR_CHARS`."""
    if not text:
        return text
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return None
    if lines[0].startswith("Traceback (most recent call last)"):
        line = lines[-1]
    else:
        line = lines[0]
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 1] + "…"


def failure(what: str, err: BaseException, next_step: str) -> str:
    """`build failed: CalledProcessError: ...; the best config stands (...)`: what failed, the
    exception in one line, and what to do next."""
    detail = one_line(f"{type(err).__name__}: {err}") or type(err).__name__
    return f"{what}: {detail}; {next_step}"
