"""The store's error: a query over the run's files that cannot be answered."""

from __future__ import annotations

from rldiag.errors import RldiagError


class StoreError(RldiagError):
    """A file of the run cannot be queried (unreadable, malformed, or still being written)."""
