"""rldiag's data layer for the app: every query, over one DuckDB connection.

``Store(run)`` answers questions about one run directory from its logged ``metrics.jsonl``, its
scenarios' Parquet outputs and its batch files. No other module of rldiag or the app holds SQL.
"""

from rldiag.store.cache import FileSig, file_sig
from rldiag.store.db import Db
from rldiag.store.errors import StoreError
from rldiag.store.stepview import StepFacts
from rldiag.store.store import LOGGED, LiveStatus, Store

__all__ = ["Db", "FileSig", "LOGGED", "LiveStatus", "StepFacts", "Store", "StoreError", "file_sig"]
