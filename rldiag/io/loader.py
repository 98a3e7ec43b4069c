"""Batch files (Parquet or Arrow IPC) -> the engine's packed token layout.

Arrow's list layout is the engine's: a list column is its flat values and its row offsets, so a
token column becomes a flat ``(tokens,)`` tensor sharing Arrow's buffer (zero-copy when the
file holds float32 values and one chunk; a cast or a concatenation otherwise), never padded to
the longest row. Everything is done on Arrow's flat values and offsets, never with a Python loop
per row. Only the columns the caller names are read (a plan of the column planner,
:mod:`rldiag.engine.requirements`), and one step is loaded at a time so memory does not grow
with the run.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import torch

from rldiag.engine.batch import ROW_FIELDS, TOKEN_FIELDS, Batch
from rldiag.engine.layout import Rows, row_ids_of
from rldiag.engine.repetition import COMPRESSION_COLUMN, compression_ratios
from rldiag.engine.requirements import BASE_NEED, ColumnPlan
from rldiag.engine.settings import EngineSettings
from rldiag.errors import BatchError, MissingInputError
from rldiag.io.arrays import open_ipc, parquet_file, to_numpy
from rldiag.io.fs import RemotePath, arrow_source, open_input_file
from rldiag.io.rundir import StepFile, step_number_problem
from rldiag.io.schema import (
    LIST_COLUMNS,
    MASK_LIST_COLUMNS,
    RESPONSE_TEXT_COLUMN,
    REWARD_INPUT_COLUMNS,
    REWARD_INPUT_REPR_COLUMN,
    SCALAR_COLUMNS,
    TEXT_LIST_COLUMNS,
    id_type_problem,
)

#: columns with a dedicated place in the engine Batch (its token fields, its per-row ones the
#: schema has); any other column read lands in ``Batch.extra`` (string ids as int64 codes, other
#: scalars as numbers, lists padded)
BATCH_COLUMNS = frozenset(("uid", "score", "step") + TOKEN_FIELDS + tuple(f for f in ROW_FIELDS if f in SCALAR_COLUMNS))


def _unreadable(sf: StepFile, exc: Exception) -> BatchError:
    return BatchError(f"cannot read the file ({exc}); it may be incomplete or still being written",
                      file=str(sf.path), step=sf.step)


#: what a caller may hand the readers below in place of the file's path: its bytes, already read
#: (to hash them), or the file open for reading (binary), which the caller closes
Source = bytes | BinaryIO | None


def _reader(source: bytes | BinaryIO):
    """An Arrow input of ``source``: a buffer over bytes, the open file itself (from its start)."""
    if isinstance(source, bytes):
        return pa.BufferReader(source)
    source.seek(0)
    return source


def _parquet(sf: StepFile, source: Source) -> pq.ParquetFile:
    """The step's Parquet file, from ``source`` when the caller has it (:data:`Source`)."""
    if source is not None:
        return parquet_file(_reader(source))
    src, fs = arrow_source(sf.path)
    return parquet_file(src, fs)


def read_schema(sf: StepFile, source: Source = None) -> pa.Schema:
    """The schema of one batch file; ``source``: the file's bytes or the open file (:data:`Source`)."""
    try:
        if sf.format == "parquet":
            return _parquet(sf, source).schema_arrow
        if source is not None:
            return open_ipc(_reader(source)).schema
        with open_input_file(sf.path) as src:
            return open_ipc(src).schema
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(sf, exc) from exc


def token_count(sf: StepFile) -> int:
    """About how many tokens the step holds, without reading its data: the values of
    ``response_mask`` in a Parquet file's footer (a row without a token counts one), or the
    column's list lengths of an Arrow file (memory-mapped, locally). An estimate for sizing
    outputs; 0 when the file cannot be read (its load reports why)."""
    try:
        if sf.format == "parquet":
            meta = _parquet(sf, None).metadata
            cols = [j for j in range(meta.num_columns)
                    if meta.schema.column(j).path.split(".")[0] == "response_mask"]
            return sum(meta.row_group(g).column(j).num_values for g in range(meta.num_row_groups) for j in cols[:1])
        with pa.memory_map(str(sf.path)) as src:
            table = open_ipc(src).read_all()
            return int(pc.sum(pc.list_value_length(table["response_mask"])).as_py() or 0)
    except (pa.ArrowException, OSError, KeyError, ValueError, TypeError):
        return 0


def row_count(sf: StepFile) -> int:
    """The rows of one batch file, from its metadata (Parquet) or its record batches (Arrow IPC),
    without reading a column."""
    try:
        if sf.format == "parquet":
            return int(_parquet(sf, None).metadata.num_rows)
        with open_input_file(sf.path) as src:
            reader = open_ipc(src)
            if isinstance(reader, ipc.RecordBatchFileReader):
                return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            return sum(b.num_rows for b in reader)
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(sf, exc) from exc


#: a Parquet file with this many list values (tokens) in a column or more is read one column at a
#: time: Parquet's reader of a list column holds its repetition and definition levels (2 bytes each
#: a value), the growing output and the decompressed pages while it decodes, and reading every
#: column at once holds all of them together: about 100-130 bytes a token at the read's peak for
#: a step of 2.7 M tokens (8 list columns), against about 60 read column by column (30 live)
#: (bench/bench_memory.py). The values read are the same; a smaller step keeps the parallel read.
#: From 262,144 values (1 M before): a tail16k step of 0.63 M tokens peaked at 143 bytes a token
#: loaded at once, 103 by column, in the same time (about 0.13 s; a uniform 512 x 1,024 step
#: 53-107 ms either way under load, threads off as on 2 cores).
BY_COLUMN_VALUES = 1 << 18


def _values(pf: pq.ParquetFile) -> int:
    """The most values of one leaf column in the file's row groups (from its footer)."""
    md = pf.metadata
    if md.num_row_groups == 0 or md.num_columns == 0:
        return 0
    return max(sum(md.row_group(g).column(j).num_values for g in range(md.num_row_groups))
               for j in range(md.num_columns))


def _read_by_column(pf: pq.ParquetFile, columns: list[str] | None) -> pa.Table:
    """``columns`` of ``pf`` read one after the other, as one table with the file's schema
    metadata (what :meth:`pq.ParquetFile.read` returns, with less memory at the read's peak)."""
    schema = pf.schema_arrow
    names = list(columns) if columns is not None else list(schema.names)
    arrays = [pf.read(columns=[name], use_threads=False).column(0) for name in names]
    return pa.Table.from_arrays(arrays, schema=pa.schema([schema.field(n) for n in names], metadata=schema.metadata))


def read_table(sf: StepFile, columns: list[str] | None = None, source: Source = None,
               threads: bool = True, choose=None) -> pa.Table:
    """Read ``columns`` (all when None) of one batch file; ``source``: its bytes, already read,
    or the open file (:data:`Source`).

    ``threads``: decode columns on Arrow's thread pool (the fastest read alone; a pipeline whose
    other stages keep the cores busy spends less CPU with ``False``). ``choose(names)``, when
    given, picks the columns from the file's schema (the footer is then parsed once).
    """
    try:
        if sf.format == "parquet":
            pf = _parquet(sf, source)
            if choose is not None:
                columns = choose(pf.schema_arrow.names)
            if _values(pf) >= BY_COLUMN_VALUES:
                return _read_by_column(pf, columns)
            return pf.read(columns=columns, use_threads=threads)
        if source is not None:
            table = open_ipc(_reader(source)).read_all()
        else:
            with open_input_file(sf.path) as src:
                table = open_ipc(src).read_all()
        if choose is not None:
            columns = choose(table.column_names)
        return table.select(columns) if columns is not None else table
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(sf, exc) from exc


def plan_columns(plan: ColumnPlan, names: list[str], sf: StepFile | None = None) -> list[str]:
    """The columns of ``plan`` to read from a file having ``names`` (``sf``: that file, named in
    the error when a required column is missing)."""
    missing = plan.missing(names)
    if missing:
        where: dict[str, Any] = {"file": str(sf.path), "step": sf.step} if sf is not None else {}
        raise MissingInputError(f"{plan.who} needs {', '.join(missing)}, missing", column=missing[0], **where)
    return plan.select(names)


def _first_true(arr: np.ndarray) -> int | None:
    idx = np.flatnonzero(arr)
    return int(idx[0]) if idx.size else None


@dataclass
class Ragged:
    """A list column as flat values and per-row lengths."""

    values: np.ndarray  # (total,)
    lengths: np.ndarray  # (rows,) int64
    offsets: np.ndarray  # (rows + 1,) int64


def _ragged(col: pa.ChunkedArray | pa.Array, name: str, where: dict) -> Ragged:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type)):
        raise BatchError(f"expected a list column, found type {arr.type}", column=name, **where)
    if arr.null_count:
        row = _first_true(to_numpy(arr.is_null()))
        raise BatchError("the row's list is null", row=row, column=name, **where)
    lengths = to_numpy(pc.list_value_length(arr)).astype(np.int64)
    flat = pc.list_flatten(arr)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if flat.null_count and (idx := _first_true(to_numpy(flat.is_null()))) is not None:
        row = int(np.searchsorted(offsets, idx, side="right") - 1)
        raise BatchError(f"token {idx - offsets[row]} is null", row=row, column=name, **where)
    if name in MASK_LIST_COLUMNS:
        if pa.types.is_boolean(flat.type):
            values = to_numpy(flat).astype(np.int8)
        elif pa.types.is_integer(flat.type) or pa.types.is_floating(flat.type):
            values = to_numpy(flat)
            bad = (values != 0) & (values != 1)
            idx = _first_true(bad)
            if idx is not None:
                row = int(np.searchsorted(offsets, idx, side="right") - 1)
                raise BatchError(
                    f"mask value {values[idx].item()!r} at token {idx - offsets[row]}; masks hold only 0 and 1",
                    row=row, column=name, **where,
                )
            values = values.astype(np.int8)
        else:
            raise BatchError(f"expected list<int8 or bool>, found {arr.type}", column=name, **where)
    else:
        if not (pa.types.is_floating(flat.type) or pa.types.is_integer(flat.type)):
            raise BatchError(f"expected list<float>, found {arr.type}", column=name, **where)
        values = to_numpy(flat).astype(np.float32, copy=False)
        bad = ~np.isfinite(values)
        idx = _first_true(bad)
        if idx is not None:
            row = int(np.searchsorted(offsets, idx, side="right") - 1)
            raise BatchError(
                f"non-finite value {values[idx].item()} at token {idx - offsets[row]}", row=row, column=name, **where
            )
    return Ragged(values=values, lengths=lengths, offsets=offsets)


def _text_lengths(col: pa.ChunkedArray, name: str, where: dict) -> np.ndarray:
    """A list<string> text column (``response_tokens``, ``prompt_tokens``): its per-row lengths,
    after checking the type and that no list and no token is null."""
    arr = col.combine_chunks()
    t = arr.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not (
            pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)):
        raise BatchError(f"expected list<string> (one string per token), found type {t}", column=name, **where)
    if arr.null_count:
        raise BatchError("the row's list is null", row=_first_true(to_numpy(arr.is_null())), column=name, **where)
    lengths = to_numpy(pc.list_value_length(arr)).astype(np.int64)
    flat = pc.list_flatten(arr)
    if flat.null_count and (idx := _first_true(to_numpy(flat.is_null()))) is not None:
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        row = int(np.searchsorted(offsets, idx, side="right") - 1)
        raise BatchError(f"token {idx - offsets[row]} is null", row=row, column=name, **where)
    return lengths


def _scalar(col: pa.ChunkedArray, name: str, kind: str, where: dict) -> np.ndarray:
    arr = col.combine_chunks()
    if arr.null_count:
        row = _first_true(to_numpy(arr.is_null()))
        raise BatchError("value is null", row=row, column=name, **where)
    if kind == "string":
        if (problem := id_type_problem(arr.type)) is not None:
            raise BatchError(problem, column=name, **where)
        return arr
    if not (pa.types.is_floating(arr.type) or pa.types.is_integer(arr.type)):
        raise BatchError(f"expected a number, found type {arr.type}", column=name, **where)
    values = to_numpy(arr)
    if kind == "float":
        values = values.astype(np.float64)
        idx = _first_true(~np.isfinite(values))
        if idx is not None:
            raise BatchError(f"non-finite value {values[idx].item()}", row=idx, column=name, **where)
    elif pa.types.is_floating(arr.type):  # an int column stored as floats: whole numbers only
        idx = _first_true(~np.isfinite(values) | (np.round(values) != values))
        if idx is not None:
            raise BatchError(f"value {values[idx].item()} is not an integer", row=idx, column=name, **where)
    return values


def validate_table(table: pa.Table, sf: StepFile) -> dict[str, Ragged]:
    """Check one step's table against the schema; return its list columns as ragged arrays
    (the text columns, ``response_tokens`` and ``prompt_tokens``, are checked, not returned).

    Raises :class:`BatchError` naming file, step, row and column for the first problem.
    """
    where: dict[str, Any] = {"file": str(sf.path), "step": sf.step}
    if (problem := step_number_problem(sf.step)) is not None:
        raise BatchError(problem, **where)
    if table.num_rows == 0:
        raise BatchError("the step has no rows (an empty batch)", **where)
    names = set(table.column_names)
    missing = BASE_NEED.missing(names)
    if missing:
        raise MissingInputError(f"required column {missing[0]} is missing", column=missing[0].split(" ")[0], **where)
    if "step" in names:
        steps = _scalar(table["step"], "step", "int", where)
        idx = _first_true(steps != sf.step)
        if idx is not None:
            raise BatchError(
                f"step column says {int(steps[idx])} but the file name says {sf.step}", row=idx, column="step", **where
            )
    for name, kind in SCALAR_COLUMNS.items():
        if name in names and name != "step":
            _scalar(table[name], name, kind, where)
    ragged: dict[str, Ragged] = {}
    ref = _ragged(table["response_mask"], "response_mask", where)
    ragged["response_mask"] = ref
    for name in LIST_COLUMNS:
        if name == "response_mask" or name not in names:
            continue
        r = _ragged(table[name], name, where)
        idx = _first_true(r.lengths != ref.lengths)
        if idx is not None:
            raise BatchError(
                f"has {r.lengths[idx]} tokens but response_mask has {ref.lengths[idx]}; every list column "
                "of a row must have the row's length",
                row=idx, column=name, **where,
            )
        ragged[name] = r
    for name in TEXT_LIST_COLUMNS:  # for display only: checked here, never handed to the engine
        if name not in names:
            continue
        text_lengths = _text_lengths(table[name], name, where)
        idx = _first_true(text_lengths != ref.lengths) if name == RESPONSE_TEXT_COLUMN else None
        if idx is not None:
            raise BatchError(
                f"has {text_lengths[idx]} token strings but response_mask has {ref.lengths[idx]} tokens; "
                "response_tokens holds one string per response token",
                row=idx, column=name, **where,
            )
    for name in REWARD_INPUT_COLUMNS:  # a reward function's inputs: strings, never handed to the engine
        if name in names:
            _string_column(table[name], name, where)
    return ragged


def _string_column(col: pa.ChunkedArray, name: str, where: dict) -> None:
    """A per-row string column (``data_source``, ``ground_truth``, ...): string type, no null."""
    t = col.type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise BatchError(f"expected a string per row, found type {t}", column=name, **where)
    if col.null_count:
        raise BatchError("value is null", row=_first_true(to_numpy(col.combine_chunks().is_null())), column=name,
                         **where)


def _flat(r: Ragged) -> torch.Tensor:
    """The flat values as a float32 ``(tokens,)`` tensor, sharing Arrow's buffer when they are
    float32 already. The engine never writes into its inputs (tests/engine/test_inputs_read_only.py)."""
    with warnings.catch_warnings():  # Arrow's buffers are read-only; the engine only reads them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(r.values.astype(np.float32, copy=False))


def _extra_column(col: pa.ChunkedArray, name: str, where: dict) -> torch.Tensor:
    """A scalar column for ``Batch.extra`` ``(rows,)``: string ids (and the id columns of the
    schema, whatever their type) as int64 codes in order of first appearance, the schema's int
    columns (integers, or floats holding whole numbers) as int64, any other number or bool as
    float32 (verl reads reward components so)."""
    arr = col.combine_chunks()
    if arr.null_count:
        row = _first_true(to_numpy(arr.is_null()))
        raise BatchError("value is null", row=row, column=name, **where)
    kind = SCALAR_COLUMNS.get(name)
    if kind == "string":
        codes = pc.dictionary_encode(pc.cast(arr, pa.string())).indices
        return torch.from_numpy(to_numpy(codes).astype(np.int64))
    if pa.types.is_boolean(arr.type):
        return torch.from_numpy(to_numpy(arr).astype(np.float32))
    if kind == "int":
        if pa.types.is_floating(arr.type):  # whole numbers stored as floats (any other value is refused by row)
            return torch.from_numpy(_scalar(col, name, "int", where).astype(np.int64))
        if not pa.types.is_integer(arr.type):
            raise BatchError(f"expected an integer, found type {arr.type}", column=name, **where)
        return torch.from_numpy(to_numpy(arr).astype(np.int64))
    values = _scalar(col, name, "float", where)
    return torch.from_numpy(values.astype(np.float32))


def _check_positions(pos: torch.Tensor, where: dict) -> None:
    """``batch_position``: distinct places >= 0 (one step's rows in the trainer's batch)."""
    negative = _first_true((pos < 0).numpy())
    if negative is not None:
        raise BatchError(f"is {int(pos[negative])}; a place in the trainer's batch is >= 0", row=negative,
                         column="batch_position", **where)
    order = torch.argsort(pos, stable=True)
    dup = _first_true((pos[order][1:] == pos[order][:-1]).numpy())
    if dup is not None:
        row = int(order[dup + 1])
        raise BatchError(f"is {int(pos[row])}, the place of row {int(order[dup])} too", row=row,
                         column="batch_position", **where)


@dataclass
class StepData:
    """One loaded step: the engine batch and what the outputs need to name rows."""

    step: int
    file: Path | RemotePath
    batch: Batch
    uids: pa.Array
    n_rows: int
    n_tokens: int


def load_step(sf: StepFile, settings: EngineSettings, columns: ColumnPlan | Sequence[str],
              source: Source = None, threads: bool = True) -> StepData:
    """Load one batch file into a one-step :class:`Batch` (on the CPU). ``columns``: the columns
    to read, or a :class:`~rldiag.engine.requirements.ColumnPlan` (the column planner's, e.g.
    ``recompute_columns(settings)``) whose columns the file has are read. ``settings``: the
    response and prompt horizons (``data.max_response_length``, ``data.max_prompt_length``).
    ``source``: the file's bytes when the caller has read them (to hash them), so that the file
    is not read again, or the file open for reading (:data:`Source`). ``threads``: see
    :func:`read_table`."""
    if isinstance(columns, ColumnPlan):
        plan = columns

        def choose(names: list[str]) -> list[str]:
            return plan_columns(plan, names, sf)

        table = read_table(sf, None, source, threads=threads, choose=choose)
    else:
        table = read_table(sf, list(columns), source, threads=threads)
    ragged = validate_table(table, sf)
    rows = table.num_rows
    lengths = ragged["response_mask"].lengths
    total = int(lengths.sum())
    offsets = torch.from_numpy(ragged["response_mask"].offsets)
    layout = Rows(offsets, row_ids_of(offsets))
    tensors = {name: _flat(r) for name, r in ragged.items()}
    where: dict[str, Any] = {"file": str(sf.path), "step": sf.step}
    if "token_level_scores" not in tensors:
        score = torch.from_numpy(_scalar(table["score"], "score", "float", where).astype(np.float32))
        scores = torch.zeros(total, dtype=torch.float32, device="cpu")
        live = torch.from_numpy(lengths > 0)
        scores[layout.offsets[1:][live] - 1] = score[live]  # the row's last token
        tensors["token_level_scores"] = scores
    uids = pc.cast(table["uid"].combine_chunks(), pa.string())
    groups = pc.dictionary_encode(uids)
    group_ids = torch.from_numpy(to_numpy(groups.indices).astype(np.int64))
    max_resp = settings["data.max_response_length"]
    kwargs: dict = {}
    if "prompt_length" in table.column_names:
        pl = _scalar(table["prompt_length"], "prompt_length", "int", where).astype(np.int64)
        kwargs["prompt_length"] = torch.from_numpy(pl)
        max_prompt = settings["data.max_prompt_length"]
        kwargs["max_prompt_length"] = torch.tensor([max_prompt if max_prompt is not None else int(pl.max())], device="cpu")
    if "reward_baselines" in table.column_names:
        kwargs["reward_baselines"] = torch.from_numpy(
            _scalar(table["reward_baselines"], "reward_baselines", "float", where).astype(np.float32)
        )
    extra = {name: tensors.pop(name) for name in list(tensors) if name not in BATCH_COLUMNS}
    token_extra = tuple(extra)
    for name in table.column_names:
        if (name not in BATCH_COLUMNS and name not in extra and name not in TEXT_LIST_COLUMNS  # text: display only
                and name not in REWARD_INPUT_COLUMNS and name != REWARD_INPUT_REPR_COLUMN):  # a reward's inputs
            extra[name] = _extra_column(table[name], name, where)
    if "batch_position" in extra:
        _check_positions(extra["batch_position"], where)
    if RESPONSE_TEXT_COLUMN in table.column_names:  # the text's one number for the engine: its compressibility
        mask = ragged["loss_mask"] if "loss_mask" in ragged else ragged["response_mask"]
        extra[COMPRESSION_COLUMN] = torch.from_numpy(compression_ratios(table[RESPONSE_TEXT_COLUMN], mask.values))
    batch = Batch(
        response_mask=tensors.pop("response_mask"),
        token_level_scores=tensors.pop("token_level_scores"),
        lengths=torch.from_numpy(lengths),
        step_ids=torch.zeros(rows, dtype=torch.int64, device="cpu"),
        group_ids=group_ids,
        steps=[sf.step],
        n_groups=len(groups.dictionary),
        max_response_length=torch.tensor([max_resp if max_resp is not None else int(lengths.max())], device="cpu"),
        **{k: v for k, v in tensors.items() if k in TOKEN_FIELDS},
        **kwargs,
        extra=extra,
        token_extra=token_extra,
        rows=layout,
    )
    return StepData(step=sf.step, file=sf.path, batch=batch, uids=uids, n_rows=rows, n_tokens=total)


#: columns the per-row table never copies from a batch file: the engine writes its own values of
#: these (``score``: the row's summed token scores) or they are the table's keys; a reward
#: function's inputs (texts, JSON) stay in the batch file
ROW_TABLE_SKIP = frozenset(("step", "row", *REWARD_INPUT_COLUMNS, REWARD_INPUT_REPR_COLUMN))


def row_columns(sf: StepFile, source: Source = None, exclude: frozenset[str] = ROW_TABLE_SKIP) -> pa.Table:
    """The file's per-row (scalar) columns for the per-row table: ``uid``, reward components,
    ids, counts, anything not a list (list columns hold one value per token) and not in
    ``exclude``. Reads only those columns."""
    schema = read_schema(sf, source)
    names = [f.name for f in schema if f.name not in exclude and not (
        pa.types.is_list(f.type) or pa.types.is_large_list(f.type) or pa.types.is_fixed_size_list(f.type)
        or pa.types.is_struct(f.type) or pa.types.is_map(f.type))]
    if not names:
        return pa.table({})
    table = read_table(sf, names, source)
    cols = {}
    for name in names:
        col = table[name].combine_chunks()
        if pa.types.is_dictionary(col.type):
            col = col.dictionary_decode()
        cols[name] = col
    return pa.table(cols)
