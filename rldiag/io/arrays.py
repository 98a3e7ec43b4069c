"""Arrow <-> NumPy for number columns, and Parquet reading, without pandas.

``pa.array(...)``, ``Array.to_numpy()`` and ``pq.read_table`` each import pandas on first use
when it is installed (it is: Streamlit needs it): about 0.2 s of every CLI run, spent before the
first batch is read or after the last is computed, for nothing rldiag uses. The same conversions
through Arrow's buffers and DLPack are zero-copy where the layout allows and import nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

if TYPE_CHECKING:
    import polars as pl


def to_numpy(arr: pa.Array) -> np.ndarray:
    """``(n,)``: a read-only view of a number array without nulls (DLPack); bools as ``bool``;
    anything else (nulls, strings) through Arrow's own conversion, a copy."""
    if arr.null_count == 0:
        kind = arr.type
        if pa.types.is_boolean(kind):
            return np.from_dlpack(pc.cast(arr, pa.uint8())).view(np.bool_)
        if pa.types.is_integer(kind) or pa.types.is_floating(kind):
            return np.from_dlpack(arr)
    return arr.to_numpy(zero_copy_only=False)


def from_numpy(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    """A number array ``(n,)`` as Arrow, sharing its memory; ``valid`` ``(n,)`` bool: False where
    the value is null. The Arrow type is the array's (``float32`` -> ``float``, ...)."""
    values = np.ascontiguousarray(values)
    if values.ndim != 1 or values.dtype.kind not in "iuf":
        raise TypeError(f"expected a 1-D number array, got {values.dtype} with shape {values.shape}")
    n = len(values)
    nulls = 0
    bitmap = None
    if valid is not None:
        valid = np.asarray(valid, dtype=bool)
        nulls = int(n - np.count_nonzero(valid))
        if nulls:
            bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), n, [bitmap, pa.py_buffer(values)], null_count=nulls)


def floats_or_null(values: list[float | None]) -> pa.Array:
    """A Python list of floats, ``None`` for null, as a float64 array (NaN stays NaN)."""
    valid = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    data = np.fromiter((0.0 if v is None else float(v) for v in values), dtype=np.float64, count=len(values))
    return from_numpy(data, valid)


def parquet_file(source, filesystem=None) -> pq.ParquetFile:
    """One Parquet file (a path, a file-like object or a ``pa.BufferReader``), its footer parsed
    once for its schema and its columns; not ``pq.read_table``, which goes through
    ``pyarrow.dataset`` and so imports pandas."""
    return pq.ParquetFile(source, filesystem=filesystem)


def read_parquet(source, columns: list[str] | None = None, filesystem=None, threads: bool = True) -> pa.Table:
    """``pq.read_table`` for one file, without pandas."""
    return parquet_file(source, filesystem).read(columns=columns, use_threads=threads)


def open_ipc(source) -> ipc.RecordBatchFileReader | ipc.RecordBatchStreamReader:
    """A reader of an Arrow IPC source (a file-like object) in either form: the file format
    (Feather v2, with its footer), else the stream format (read again from its start)."""
    try:
        return ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return ipc.open_stream(source)


def read_ipc(path: str) -> pa.Table:
    """An Arrow IPC file on local disk, whole, memory-mapped (the columns are not copied).
    Raises what pyarrow raises (``OSError``, ``ArrowException``) for a file cut short or not written yet."""
    return open_ipc(pa.memory_map(str(path))).read_all()


def rows_frame(rows: list[dict], columns: list[str]) -> pl.DataFrame:
    """Row dicts as a polars frame with ``columns`` in that order (the reports' ``*_frame()``
    methods); with no rows, the columns are still there (of type null)."""
    import polars as pl

    if not rows:
        return pl.DataFrame(schema=columns)
    return pl.DataFrame([{c: r.get(c) for c in columns} for r in rows], strict=False)
