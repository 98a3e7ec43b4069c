"""Executors run a recompute's steps: ``local`` (this process, the default) or ``ray`` (a Ray
cluster). Both run the same unit of work (:mod:`.steps`) behind one small interface
(:class:`.base.Executor`), so both write the same scenario."""

from __future__ import annotations

from rldiag.errors import ConfigError
from rldiag.executors.base import Executor, Plan

EXECUTORS = ("local", "ray")


def get_executor(spec: str | Executor) -> Executor:
    """An executor by name (``local``, ``ray``), or ``spec`` itself if it already is one."""
    if not isinstance(spec, str):
        return spec
    if spec == "local":
        from rldiag.executors.local import LocalExecutor

        return LocalExecutor()
    if spec == "ray":
        from rldiag.executors.ray_cluster import RayExecutor

        return RayExecutor()
    raise ConfigError(f"--executor {spec!r}: expected one of {', '.join(EXECUTORS)}")


__all__ = ["EXECUTORS", "Executor", "Plan", "get_executor"]
