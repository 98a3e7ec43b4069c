"""The DuckDB connections of rldiag: one per run served (a store's, a ``rldiag rows`` query's);
every query runs on a cursor of its own.

DuckDB cursors are connections to the same in-memory database, so the tables the store
materialises are shared by every query, and Streamlit's script threads can query at once.
Writes that must not interleave (re-materialising a table) take :attr:`Db.lock`.

A connection can read only the directories it was opened for (:mod:`rldiag.store.sandbox`): it
is locked before its first query, so a new run needs a new :class:`Db`.

Every ``read_parquet`` of the store passes ``hive_partitioning = false``: scenario directories
are named like ``adv_estimator=rloo``, which DuckDB would otherwise read as a partition column.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow as pa

from rldiag.store.errors import StoreError
from rldiag.store.sandbox import lock


class Db:
    """One DuckDB connection (an in-memory database) that reads files only under ``dirs``
    (:func:`rldiag.store.sandbox.served_dirs` of the runs it serves; none: Arrow tables only)
    and its own scratch directory :attr:`scratch` (removed with it)."""

    def __init__(self, dirs: Iterable[str | os.PathLike] = (), threads: int | None = None):
        self.scratch = Path(tempfile.mkdtemp(prefix="rldiag-duckdb-"))
        self._remove_scratch = weakref.finalize(self, shutil.rmtree, str(self.scratch), True)
        self.dirs = [str(d) for d in dirs]
        self._con = duckdb.connect(":memory:")
        self._con.execute("SET enable_progress_bar = false")
        if threads:
            self._con.execute(f"SET threads = {int(threads)}")
        lock(self._con, self.dirs, self.scratch)
        self.lock = threading.RLock()
        self._names = 0

    def __enter__(self) -> Db:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cursor(self) -> duckdb.DuckDBPyConnection:
        return self._con.cursor()

    def fresh_name(self, prefix: str) -> str:
        """A table name no other object of this database uses."""
        with self.lock:
            self._names += 1
            return f"{prefix}_{self._names}"

    def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None, where: str = "") -> None:
        with self.cursor() as cur:
            _run(cur, sql, params, where)

    def frame(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None, where: str = "",
              arrow: Mapping[str, pa.Table] | None = None) -> pl.DataFrame:
        """The result as a polars frame (through Arrow, no pandas). ``arrow``: Arrow tables the
        query selects from by name, registered on its cursor only."""
        with self.cursor() as cur:
            _register(cur, arrow)
            frame = pl.from_arrow(_relation(cur, sql, params, where).to_arrow_table())
            assert isinstance(frame, pl.DataFrame)  # a table gives a frame (an array would give a Series)
            return frame

    def arrow(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None, where: str = "",
              arrow: Mapping[str, pa.Table] | None = None) -> pa.Table:
        with self.cursor() as cur:
            _register(cur, arrow)
            return _relation(cur, sql, params, where).to_arrow_table()

    def rows(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None, where: str = "",
             arrow: Mapping[str, pa.Table] | None = None) -> list[tuple]:
        with self.cursor() as cur:
            _register(cur, arrow)
            return _run(cur, sql, params, where).fetchall()

    def close(self) -> None:
        self._con.close()
        self._remove_scratch()


def _params(params):
    if params is None or isinstance(params, Mapping):
        return params
    return list(params)


def _register(cur: duckdb.DuckDBPyConnection, arrow: Mapping[str, pa.Table] | None) -> None:
    for name, table in (arrow or {}).items():
        cur.register(name, table)


def _run(cur: duckdb.DuckDBPyConnection, sql: str, params, where: str) -> duckdb.DuckDBPyConnection:
    try:
        return cur.execute(sql, _params(params))
    except duckdb.Error as exc:
        msg = str(exc).splitlines()[0]
        raise StoreError(f"{where}: {msg}" if where else msg) from exc


def _relation(cur: duckdb.DuckDBPyConnection, sql: str, params, where: str) -> duckdb.DuckDBPyRelation:
    try:
        return cur.sql(sql, params=_params(params))
    except duckdb.Error as exc:
        msg = str(exc).splitlines()[0]
        raise StoreError(f"{where}: {msg}" if where else msg) from exc


def quote_ident(name: str) -> str:
    """A SQL identifier for any metric name (``actor/pg_loss`` -> ``"actor/pg_loss"``)."""
    return '"' + name.replace('"', '""') + '"'
