"""Errors of the importers (all :class:`~rldiag.errors.RldiagError`, so the CLI reports them)."""

from __future__ import annotations

from rldiag.errors import RldiagError


class WandbImportError(RldiagError):
    """A W&B source cannot be imported: unreadable file, unknown run, no network, no key, ..."""


class WandbMissingError(WandbImportError):
    """The optional ``wandb`` package is not installed."""
