"""rldiag: recompute and diagnose RL post-training runs with verl's numbers."""

from rldiag.version import __version__

__all__ = ["__version__"]
