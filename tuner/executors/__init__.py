"""Executors run trials on devices: locally in subprocesses, or as Ray tasks on a cluster."""

from tuner.executors.base import Executor


def make_executor(name: str, **kwargs) -> Executor:
    """Build an executor by name: `local` or `ray`."""
    if name == "local":
        from tuner.executors.local import LocalExecutor

        return LocalExecutor(**kwargs)
    if name == "ray":
        from tuner.executors.ray_executor import RayExecutor

        return RayExecutor(**kwargs)
    raise ValueError(f"--executor: unknown executor {name!r}; use local or ray")


__all__ = ["Executor", "make_executor"]
