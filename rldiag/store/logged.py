"""The run's ``metrics.jsonl`` as a long DuckDB table ``(seq, step, metric, value)``.

DuckDB reads the file with explicit column types and ``ignore_errors`` (a line that is not JSON
becomes a null row and is skipped), in both forms of a run's metrics file:

- verl's file logger, ``{"step": 12, "data": {"actor/pg_loss": 0.1, ...}}``: ``read_ndjson``
  with ``data`` typed ``MAP(VARCHAR, JSON)``, so hundreds of metric names (with ``/`` in them)
  need no schema and unpivot with ``unnest(map_keys(...))``;
- flat, ``{"step": 12, "actor/pg_loss": 0.1}``: each line read whole as ``MAP(VARCHAR, JSON)``.

Only numbers become values (JSON booleans, strings and objects are skipped, NaN is kept). A
last line without its newline is still being written: it is left out and picked up once complete.
The file is followed incrementally: when it grows, only the new complete lines are read; when
it shrinks, is replaced, or its first bytes change, it is read again from the start. A step
logged twice (a resumed run) keeps the values of its last line.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import duckdb
import polars as pl

from rldiag.store.cache import FileSig, file_sig
from rldiag.store.db import Db, quote_ident

#: bytes of the file's start remembered to notice a rewrite
HEAD_BYTES = 4096

_NESTED = """
    SELECT ordinality AS seq, step, data AS obj, false AS flat
    FROM read_ndjson(?, columns = {'step': 'BIGINT', 'data': 'MAP(VARCHAR, JSON)'}, ignore_errors = true)
    WITH ORDINALITY
"""
_FLAT = """
    SELECT ordinality AS seq, TRY_CAST(json['step'] AS BIGINT) AS step, json AS obj, true AS flat
    FROM read_json(?, format = 'newline_delimited', records = false,
                   columns = {'json': 'MAP(VARCHAR, JSON)'}, ignore_errors = true)
    WITH ORDINALITY
    WHERE coalesce(json_type(json['data']), '') <> 'OBJECT'
"""
_NUMERIC = "('DOUBLE', 'BIGINT', 'UBIGINT')"


def _last_line_start(path: Path, size: int) -> int:
    """Offset just past the last newline before ``size`` (0 when there is none)."""
    block = 1 << 16
    end = size
    with path.open("rb") as fh:
        while end > 0:
            start = max(0, end - block)
            fh.seek(start)
            data = fh.read(end - start)
            i = data.rfind(b"\n")
            if i >= 0:
                return start + i + 1
            end = start
    return 0


def _one_row(cur: duckdb.DuckDBPyConnection) -> tuple:
    """The one row of an aggregate query (without GROUP BY there is always exactly one)."""
    row = cur.fetchone()
    assert row is not None, "an aggregate without GROUP BY returned no row"
    return row


class LoggedMetrics:
    """``metrics.jsonl`` kept loaded in one table; call :meth:`refresh` before querying."""

    def __init__(self, db: Db, path: str | Path):
        self.db = db
        self.path = Path(path)
        self.table = db.fresh_name("logged")
        self.lock = threading.RLock()
        self.sig: FileSig | None = None  # the file version the table reflects
        self.lines = 0  # complete lines holding a step
        self.reloads = 0  # full reads (tests and the bench look at it)
        self.appends = 0  # incremental reads
        self._consumed = 0
        self._head = b""
        self._ino: int | None = None
        self._seq = 0
        self._reset()

    # -- loading ------------------------------------------------------------------------------

    def _reset(self) -> None:
        self.db.execute(
            f"CREATE OR REPLACE TABLE {self.table} (seq BIGINT, step BIGINT, metric VARCHAR, value DOUBLE)"
        )
        self._consumed, self._head, self._ino, self._seq, self.lines = 0, b"", None, 0, 0

    def refresh(self) -> FileSig | None:
        """Bring the table up to the file; returns the file's signature (None: no file)."""
        sig = file_sig(self.path)
        with self.lock:
            if sig == self.sig:
                return sig
            if sig is None:
                if self.sig is not None or self._consumed:
                    self._reset()
                self.sig = None
                return None
            if self._rewritten(sig):
                self._reset()
            if self._consumed == 0:
                self._load_whole(sig)
            else:
                self._load_tail()
            self._ino = sig.ino
            self.sig = sig
            return sig

    def _rewritten(self, sig: FileSig) -> bool:
        if self._consumed == 0:
            return False
        if sig.ino != self._ino or sig.size < self._consumed:
            return True
        with self.path.open("rb") as fh:
            return fh.read(len(self._head)) != self._head

    def _load_whole(self, sig: FileSig) -> None:
        """First read: DuckDB over the file itself, leaving out an unterminated last line."""
        self.reloads += 1
        end = _last_line_start(self.path, sig.size)
        with self.path.open("rb") as fh:
            fh.seek(end)
            tail = fh.read(sig.size - end)
        # An unterminated last line is the row with the largest ordinality (blank lines give no row).
        drop_last = bool(tail.strip())
        self._ingest(str(self.path), drop_last)
        self._consumed = end
        with self.path.open("rb") as fh:
            self._head = fh.read(min(HEAD_BYTES, end))

    def _load_tail(self) -> None:
        """The file grew: read only the complete lines past what was loaded."""
        with self.path.open("rb") as fh:
            fh.seek(self._consumed)
            data = fh.read()
        cut = data.rfind(b"\n")
        if cut < 0:
            return
        chunk = data[: cut + 1]
        self.appends += 1
        fd, tmp = tempfile.mkstemp(prefix="rldiag-metrics-", suffix=".jsonl", dir=self.db.scratch)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(chunk)
            self._ingest(tmp, drop_last=False)
        finally:
            os.unlink(tmp)
        self._consumed += len(chunk)
        if len(self._head) < HEAD_BYTES:
            with self.path.open("rb") as fh:
                self._head = fh.read(min(HEAD_BYTES, self._consumed))

    def _ingest(self, src: str, drop_last: bool) -> None:
        """Parse ``src`` (complete lines, plus maybe one to drop) and merge it into the table."""
        t = self.table
        with self.db.cursor() as cur:
            cur.execute(f"CREATE OR REPLACE TEMP TABLE stage AS {_NESTED}", [src])
            cur.execute(f"INSERT INTO stage {_FLAT}", [src])
            (n_rows,) = _one_row(cur.execute("SELECT coalesce(max(seq), 0) FROM stage"))
            last = n_rows - 1 if drop_last else n_rows
            base = self._seq
            live = "step IS NOT NULL AND obj IS NOT NULL AND seq <= ?"
            (lines, steps) = _one_row(cur.execute(
                f"SELECT count(DISTINCT seq), count(DISTINCT step) FROM stage WHERE {live}", [last]
            ))
            # A step on several lines (a resumed run, or a flat logger writing a step in parts):
            # keep each metric's last value. Without one, every (step, metric) is already unique.
            dedupe = "QUALIFY row_number() OVER (PARTITION BY step, metric ORDER BY seq DESC) = 1" if steps < lines else ""
            cur.execute(
                f"""
                CREATE OR REPLACE TEMP TABLE fresh AS
                SELECT seq + {base} AS seq, step, metric, v::DOUBLE AS value FROM (
                    SELECT seq, step, flat, unnest(map_keys(obj)) AS metric, unnest(map_values(obj)) AS v
                    FROM stage WHERE {live}
                ) WHERE json_type(v) IN {_NUMERIC} AND NOT (flat AND metric = 'step')
                {dedupe}
                """,
                [last],
            )
            if self.lines:
                cur.execute(f"DELETE FROM {t} USING fresh WHERE {t}.step = fresh.step AND {t}.metric = fresh.metric")
            cur.execute(f"INSERT INTO {t} SELECT * FROM fresh")
            cur.execute("DROP TABLE stage")
            cur.execute("DROP TABLE fresh")
        self._seq = base + n_rows
        self.lines += lines

    # -- queries ------------------------------------------------------------------------------

    def names(self) -> pl.DataFrame:
        """``metric, points, first_step, last_step`` for every logged metric, by name."""
        with self.lock:
            return self.db.frame(
                f"SELECT metric, count(*) AS points, min(step) AS first_step, max(step) AS last_step "
                f"FROM {self.table} GROUP BY metric ORDER BY metric",
                where=str(self.path),
            )

    def latest(self) -> tuple[int | None, int]:
        """(largest logged step, number of distinct steps)."""
        with self.lock:
            row = self.db.rows(f"SELECT max(step), count(DISTINCT step) FROM {self.table}")[0]
        return (None if row[0] is None else int(row[0])), int(row[1])

    def long(self, metrics: list[str], lo: int | None = None, hi: int | None = None) -> pl.DataFrame:
        """``step, metric, value`` of the chosen metrics, sorted by metric and step."""
        with self.lock:
            return self.db.frame(
                f"SELECT step, metric, value FROM {self.table} "
                f"WHERE list_contains(?::VARCHAR[], metric) AND step >= ? AND step <= ? ORDER BY metric, step",
                [list(metrics), _lo(lo), _hi(hi)],
                where=str(self.path),
            )

    def wide(self, metrics: list[str], lo: int | None = None, hi: int | None = None) -> pl.DataFrame:
        """One row per step, one column per chosen metric (null where a step did not log it)."""
        cols = ", ".join(
            f"max(value) FILTER (WHERE metric = ?) AS {quote_ident(m)}" for m in metrics
        )
        sel = f"step, {cols}" if cols else "step"
        with self.lock:
            return self.db.frame(
                f"SELECT {sel} FROM {self.table} WHERE step >= ? AND step <= ? GROUP BY step ORDER BY step",
                [*metrics, _lo(lo), _hi(hi)],
                where=str(self.path),
            )


def _lo(v: int | None) -> int:
    return -(2**62) if v is None else int(v)


def _hi(v: int | None) -> int:
    return 2**62 if v is None else int(v)
