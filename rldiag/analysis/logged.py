"""What the trainer logged: ``metrics.jsonl`` per step, and the per-token columns
``token_level_rewards`` / ``advantages`` / ``returns`` of the batch files (docs/run-directory.md),
which the engine loader does not read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rldiag.errors import BatchError
from rldiag.io.fs import RemotePath, as_path
from rldiag.io.loader import read_table
from rldiag.io.rundir import StepFile, iter_metrics_lines

#: The per-token columns a trainer logs and ``rldiag verify`` checks, in pipeline order.
LOGGED_TOKEN_COLUMNS = ("token_level_rewards", "advantages", "returns")


def logged_metrics(metrics_file: str | Path | RemotePath) -> dict[int, dict[str, float]]:
    """``{step: {name: value}}`` from ``metrics.jsonl`` (a local file or an object); for a step
    logged twice (a resumed run) the later line wins, name by name."""
    out: dict[int, dict[str, float]] = {}
    for step, values in iter_metrics_lines(as_path(metrics_file)):
        out.setdefault(step, {}).update({k: float(v) for k, v in values.items()})
    return out


def flat_list_column(table: pa.Table, name: str, lengths: np.ndarray, sf: StepFile, dtype=np.float64) -> np.ndarray:
    """The flat values of list column ``name`` (row-major, no padding), checked to have one
    value per token of each row (``lengths``) and no nulls. Non-finite values are kept."""

    def error(message: str, row: int | None = None) -> BatchError:
        return BatchError(message, file=str(sf.path), step=sf.step, row=row, column=name)

    arr = table[name].combine_chunks()
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type)):
        raise error(f"expected a list column, found type {arr.type}")
    if arr.null_count:
        row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise error("the row's list is null", row)
    got = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(got) != len(lengths):
        raise error(f"has {len(got)} rows but response_mask has {len(lengths)}")
    bad = np.flatnonzero(got != lengths)
    if bad.size:
        r = int(bad[0])
        raise error(f"has {got[r]} tokens but response_mask has {lengths[r]}; a logged column must have the row's length", r)
    flat = pc.list_flatten(arr)
    if flat.null_count:
        idx = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        row = int(np.searchsorted(offsets, idx, side="right") - 1)
        raise error(f"token {idx - offsets[row]} is null", row)
    if not (pa.types.is_floating(flat.type) or pa.types.is_integer(flat.type) or pa.types.is_boolean(flat.type)):
        raise error(f"expected list<float>, found {arr.type}")
    return flat.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def read_logged_tokens(sf: StepFile, names: list[str], lengths: np.ndarray,
                       source: bytes | None = None) -> dict[str, np.ndarray]:
    """The logged per-token columns ``names`` of one batch file, flat float64 (row-major);
    ``source``: the file's bytes when the caller holds them."""
    if not names:
        return {}
    table = read_table(sf, list(names), source)
    return {n: flat_list_column(table, n, lengths, sf) for n in names}


def row_token_of(flat_index: int, lengths: np.ndarray) -> tuple[int, int]:
    """``(row, token)`` of a flat (row-major, unpadded) token index."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    row = int(np.searchsorted(offsets, flat_index, side="right") - 1)
    return row, int(flat_index - offsets[row])
