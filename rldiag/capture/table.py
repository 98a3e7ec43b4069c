"""One step's flat columns -> a validated Arrow table -> an atomically written batch file.

This part runs on the writer thread. List columns are built from the flat values and the row
offsets (``ListArray.from_arrays``), never row by row; the table is checked with the same
validation a recompute applies when it loads the file (``rldiag.io.loader.validate_table``), so
a batch that would not load is reported at capture time, naming step, row and column.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rldiag.capture.unpad import StepPayload
from rldiag.io.atomic import write_file_atomic
from rldiag.io.loader import validate_table
from rldiag.io.rundir import StepFile
from rldiag.io.schema import LIST_COLUMNS, MASK_LIST_COLUMNS, SCALAR_COLUMNS

_INT32_MAX = np.iinfo(np.int32).max


def _list_array(values: np.ndarray, offsets: np.ndarray, large: bool, dtype: pa.DataType) -> pa.Array:
    cls = pa.LargeListArray if large else pa.ListArray
    off = pa.array(offsets, type=pa.int64() if large else pa.int32())
    return cls.from_arrays(off, pa.array(values, type=dtype))


def _row_array(name: str, values: np.ndarray) -> pa.Array:
    kind = SCALAR_COLUMNS.get(name)
    if values.dtype.kind in "OUS" or kind == "string":
        return pa.array(values.astype(str), type=pa.string())
    if kind == "int" or values.dtype.kind in "biu":
        return pa.array(values.astype(np.int64), type=pa.int64())
    return pa.array(values.astype(np.float64), type=pa.float64())


def payload_table(p: StepPayload) -> pa.Table:
    """The CONTRACT table of one step: ``step``, ``uid``, row scalars, then list columns."""
    total = int(p.lengths.sum())
    large = total > _INT32_MAX
    offsets = np.zeros(p.n_rows + 1, dtype=np.int64)
    np.cumsum(p.lengths, out=offsets[1:])
    if not large:
        offsets = offsets.astype(np.int32)
    cols: dict[str, pa.Array] = {"step": pa.array(np.full(p.n_rows, p.step, dtype=np.int64))}
    for name in ("uid", *sorted(k for k in p.rows if k != "uid")):
        cols[name] = _row_array(name, p.rows[name])
    for name in LIST_COLUMNS:
        if name in p.tokens:
            dtype = pa.int8() if name in MASK_LIST_COLUMNS else pa.float32()
            cols[name] = _list_array(p.tokens[name], offsets, large, dtype)
    return pa.table(cols)


def write_step_file(p: StepPayload, compression: str = "zstd") -> int:
    """Validate and write one step's batch file atomically; returns its size in bytes.

    The file is written under a hidden temporary name in ``batches/`` (``.step_<N>.parquet.<id>.tmp``,
    which no reader picks up) and renamed over the final name, so a reader sees no file or the
    whole file.
    """
    table = payload_table(p)
    validate_table(table, StepFile(p.step, p.path))
    write_file_atomic(
        p.path,
        lambda tmp: pq.write_table(table, tmp, compression=compression),
    )
    return p.path.stat().st_size

