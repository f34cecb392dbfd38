"""Executors run trials on devices: locally in subprocesses, or as Ray tasks on a cluster."""

from tuner.executors.base import Executor

EXECUTORS = ("local", "ray")


def unknown_executor(name: str, field: str = "--executor") -> str | None:
    """Why `name` is no executor (None when it is one), naming the option or variable `field` it
    came from: every entry point (CLI options, TUNER_EXECUTOR, the nightly) says it this way."""
    if name in EXECUTORS:
        return None
    return f"{field}: unknown executor {name!r}; use {' or '.join(EXECUTORS)}"


def make_executor(name: str, **kwargs) -> Executor:
    """Build an executor by name: `local` or `ray`."""
    if name == "local":
        from tuner.executors.local import LocalExecutor

        return LocalExecutor(**kwargs)
    if name == "ray":
        from tuner.executors.ray_executor import RayExecutor

        return RayExecutor(**kwargs)
    raise ValueError(unknown_executor(name))


__all__ = ["EXECUTORS", "Executor", "make_executor", "unknown_executor"]
