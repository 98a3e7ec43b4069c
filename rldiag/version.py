"""rldiag's version: the one place it is written (the package, the CLI and the outputs read it)."""

__version__ = "0.1.0"
