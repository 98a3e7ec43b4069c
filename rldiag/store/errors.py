"""The store's error, defined with the others in :mod:`rldiag.errors` (re-exported here)."""

from __future__ import annotations

from rldiag.errors import StoreError

__all__ = ["StoreError"]
