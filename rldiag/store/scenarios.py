"""The run's scenarios through DuckDB.

``metrics.parquet`` (one row per step, one column per metric) is unpivoted to a long table
``(step, metric, value)`` per scenario, materialised once per version of the file (a scenario is
replaced atomically, so a new version has a new inode and modification time). Token outputs
``tokens/step_<N:06d>.parquet`` are read where a query needs them: the scenario's own, else
those its token cache holds (``RUN/rldiag/cache/<name>/``: steps whose tokens were computed on
demand, :func:`rldiag.api.step_tokens`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import polars as pl

from rldiag.io.outputs import list_scenarios
from rldiag.io.run_layout import RunLayout, ScenarioLayout
from rldiag.store.cache import FileSig, SigCache, file_sig, local_path
from rldiag.store.db import Db, quote_ident
from rldiag.store.errors import StoreError


class Scenarios:
    """Every scenario of one run."""

    def __init__(self, db: Db, run: Path, cache: SigCache):
        self.db = db
        self.run = Path(run)
        self.cache = cache
        self._tables: dict[str, tuple[FileSig, str]] = {}
        self._lock = threading.RLock()

    def names(self) -> list[str]:
        return list_scenarios(self.run)

    def cached_names(self) -> list[str]:
        """Scenarios with a token cache (steps whose tokens were computed on demand)."""
        root = local_path(RunLayout(self.run).cache_dir)
        if not root.is_dir():
            return []
        return sorted(p.name for p in root.iterdir()
                      if p.is_dir() and not p.name.startswith(".") and ScenarioLayout(p).meta.is_file())

    def cache_layout(self, name: str) -> ScenarioLayout[Path]:
        """The paths of scenario ``name``'s token cache (on local disk)."""
        return ScenarioLayout(local_path(RunLayout(self.run).token_cache(name).dir))

    def dir(self, name: str) -> Path:
        return self.layout(name).dir

    def layout(self, name: str) -> ScenarioLayout[Path]:
        """The paths of scenario ``name`` (on local disk)."""
        return ScenarioLayout(local_path(RunLayout(self.run).scenario(name).dir))

    def meta(self, name: str) -> dict:
        """``scenario.json`` of one scenario (cached on its size and modification time)."""
        path = self.layout(name).meta
        if not path.is_file() and self.cache_layout(name).meta.is_file():
            path = self.cache_layout(name).meta  # not written yet: its token cache's record
        sig = file_sig(path)
        if sig is None:
            raise StoreError(f"no scenario {name!r} in {self.run}; have: {', '.join(self.names()) or 'none'}")

        def load() -> dict:
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise StoreError(f"{path}: cannot read ({exc})") from exc

        return self.cache.get(("scenario-meta", str(path)), sig, load)

    def table(self, name: str) -> str | None:
        """The long table of one scenario's metrics (None: the scenario has no metrics file)."""
        path = self.layout(name).metrics
        sig = file_sig(path)
        if sig is None:
            return None
        with self._lock:
            have = self._tables.get(name)
            if have and have[0] == sig:
                return have[1]
            table = have[1] if have else self.db.fresh_name("scenario")
            cols = [c for c, t in typed_columns_of(self.db, path) if c != "step" and _numeric(t)]
            if cols:
                # only numeric columns are metrics (a scenario may carry labels as strings)
                sel = ", ".join(f"CAST({quote_ident(c)} AS DOUBLE) AS {quote_ident(c)}" for c in cols)
                self.db.execute(
                    f"CREATE OR REPLACE TABLE {table} AS "
                    f"UNPIVOT (SELECT step, {sel} FROM read_parquet(?, hive_partitioning = false)) "
                    "ON COLUMNS(* EXCLUDE (step)) INTO NAME metric VALUE value",
                    [str(path)],
                    where=str(path),
                )
            else:
                self.db.execute(f"CREATE OR REPLACE TABLE {table} (step BIGINT, metric VARCHAR, value DOUBLE)")
            self._tables[name] = (sig, table)
            return table

    def sig(self, name: str) -> FileSig | None:
        return file_sig(self.layout(name).metrics)

    def metric_names(self, name: str) -> list[str]:
        table = self.table(name)
        if table is None:
            return []
        return self.cache.get(
            ("scenario-names", name), self.sig(name),
            lambda: [r[0] for r in self.db.rows(f"SELECT DISTINCT metric FROM {table} ORDER BY metric")],
        )

    def token_steps(self, name: str) -> list[int]:
        """Steps for which the scenario saved per-token outputs."""
        return self.layout(name).token_steps()

    def tokens_file(self, name: str, step: int) -> Path | None:
        """The scenario's tokens file of ``step``, else its token cache's (None: neither)."""
        return self._own_or_cached(name, lambda sc: sc.tokens_file(step))

    def rows_file(self, name: str, step: int) -> Path | None:
        """The scenario's per-row table of ``step``, else its token cache's (the one-step
        recompute that saved its tokens wrote it too; None: neither)."""
        return self._own_or_cached(name, lambda sc: sc.rows_file(step))

    def _own_or_cached(self, name: str, pick: Callable[[ScenarioLayout[Path]], Path]) -> Path | None:
        for sc in (self.layout(name), self.cache_layout(name)):
            if (p := pick(sc)).is_file():
                return p
        return None

    def token_columns(self, name: str, step: int) -> list[str]:
        p = self.tokens_file(name, step)
        if p is None:
            return []
        return self.cache.get(
            ("token-cols", str(p)), file_sig(p),
            lambda: columns_of(self.db, p),
        )

    def frame(self, name: str) -> pl.DataFrame:
        """The scenario's long table (step, metric, value)."""
        table = self.table(name)
        if table is None:
            return pl.DataFrame(schema={"step": pl.Int64, "metric": pl.Utf8, "value": pl.Float64})
        return self.db.frame(f"SELECT step, metric, value FROM {table} ORDER BY metric, step")


def typed_columns_of(db: Db, path: Path) -> list[tuple[str, str]]:
    """Top-level ``(name, DuckDB type)`` of a Parquet file's columns."""
    return [tuple(r) for r in db.rows(
        "SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM read_parquet(?, hive_partitioning = false))",
        [str(path)], where=str(path),
    )]


def columns_of(db: Db, path: Path) -> list[str]:
    """Top-level column names of a Parquet file."""
    return [c for c, _ in typed_columns_of(db, path)]


_NUMERIC = ("DOUBLE", "FLOAT", "REAL", "BIGINT", "INTEGER", "SMALLINT", "TINYINT", "HUGEINT", "UBIGINT",
            "UINTEGER", "USMALLINT", "UTINYINT", "BOOLEAN")


def _numeric(duck_type: str) -> bool:
    return duck_type.upper() in _NUMERIC or duck_type.upper().startswith("DECIMAL")
