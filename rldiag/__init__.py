"""rldiag: recompute and diagnose RL post-training runs with verl's numbers."""

__version__ = "0.1.0"
