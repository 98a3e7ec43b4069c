"""The run's batch files as DuckDB sources, guarded against files still being written.

A Parquet batch is read by DuckDB directly (``read_parquet`` with its row number); an Arrow IPC
batch is read with pyarrow, memory-mapped (:func:`read_arrow`, the store's one way of opening
one), and handed to DuckDB as an Arrow table. A file that cannot be opened
(its footer is not written yet, or it is cut short) is skipped: the query raises a
:class:`StoreError` naming it, and the file is listed in :attr:`Batches.problems`, so the app can
report it and carry on with the other steps.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from rldiag.errors import RldiagError
from rldiag.io.arrays import read_ipc
from rldiag.io.rundir import RunDir, StepFile
from rldiag.store.cache import SigCache, file_sig, local_path
from rldiag.store.db import Db
from rldiag.store.errors import StoreError


@dataclass
class BatchSource:
    """One step's batch as something to select from: ``FROM {sql}`` yields ``row`` and the
    file's columns; ``arrow`` holds tables to register under their names first."""

    step: int
    path: Path
    sql: str
    params: list
    columns: list[str]
    arrow: dict[str, pa.Table] = field(default_factory=dict)

    def has(self, column: str) -> bool:
        return column in self.columns


class Batches:
    """The batch files of one run."""

    def __init__(self, db: Db, run: Path, cache: SigCache):
        self.db = db
        self.rd = RunDir(run)
        self.cache = cache
        self.problems: dict[str, str] = {}  # file -> why it was skipped
        self._lock = threading.Lock()

    def files(self) -> list[StepFile]:
        return self.rd.step_files()

    def steps(self) -> list[int]:
        return [f.step for f in self.files()]

    def file(self, step: int) -> StepFile:
        for f in self.files():
            if f.step == step:
                return f
        raise StoreError(f"step {step} has no batch file in {self.rd.batches_dir}")

    def source(self, step: int) -> BatchSource:
        """The step's batch, opened; a file that fails to open is reported and raises."""
        sf = self.file(step)
        sig = file_sig(local_path(sf.path))
        try:
            src = self.cache.get(("batch-source", str(sf.path)), sig, lambda: self._open(sf))
        except RldiagError as exc:
            with self._lock:
                self.problems[str(sf.path)] = str(exc)
            raise StoreError(
                f"step {step}: batch file {sf.path} cannot be opened, skipped "
                f"(it may still be being written): {exc}"
            ) from exc
        with self._lock:
            self.problems.pop(str(sf.path), None)
        return src

    def _open(self, sf: StepFile) -> BatchSource:
        if sf.format == "parquet":
            cols = self.db.rows(
                "SELECT column_name FROM (DESCRIBE SELECT * FROM read_parquet(?, hive_partitioning = false))",
                [str(sf.path)], where=str(sf.path),
            )
            return BatchSource(
                step=sf.step,
                path=local_path(sf.path),
                sql="(SELECT file_row_number AS row, * EXCLUDE (file_row_number) "
                "FROM read_parquet(?, hive_partitioning = false, file_row_number = true))",
                params=[str(sf.path)],
                columns=[c[0] for c in cols],
            )
        table = read_arrow(sf)
        name = f"arrow_batch_{sf.step}"
        table = table.append_column("row", pa.array(np.arange(table.num_rows, dtype=np.int64)))
        return BatchSource(
            step=sf.step, path=local_path(sf.path), sql=name, params=[], columns=table.column_names[:-1], arrow={name: table}
        )

    def scan(self) -> dict[str, str]:
        """Try to open every batch file; returns (and remembers) the ones that fail."""
        for sf in self.files():
            try:
                self.source(sf.step)
            except StoreError:
                pass
        with self._lock:
            return dict(self.problems)


def read_arrow(sf: StepFile) -> pa.Table:
    """An Arrow IPC batch file, whole and memory-mapped (:func:`rldiag.io.arrays.read_ipc`); a
    :class:`StoreError` naming it when it is cut short or not written yet."""
    try:
        return read_ipc(str(sf.path))
    except (OSError, pa.ArrowException) as exc:
        raise StoreError(f"{sf.path}: cannot read the file ({exc}); it may be incomplete or still being written") from exc
