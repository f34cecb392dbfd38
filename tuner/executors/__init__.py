"""Executors run trials on devices: locally in subprocesses, or as Ray tasks on a cluster."""

from tuner.executors.base import Executor

EXECUTORS = ("local", "ray")


def unknown_executor(name: str) -> str | None:
    """Why `name` is no executor (None when it is one), as every `--executor` option says it."""
    return None if name in EXECUTORS else f"--executor: unknown executor {name!r}; use local or ray"


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
