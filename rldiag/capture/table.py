"""One step's flat columns -> a validated Arrow table -> an atomically written batch file.

This part runs on the writer thread. List columns are built from the flat values and the row
offsets (``ListArray.from_arrays``), never row by row; the table is checked with the same
validation a recompute applies when it loads the file (``rldiag.io.loader.validate_table``), so
a batch that would not load is reported at capture time, naming step, row and column.

A step written in several parts (the trainer handed over its batch more than once for one step)
stays one batch file: each later part is appended to the rows already on disk, with an int
``part`` column (0, 1, ...) saying which write each row came from, and the whole file is
replaced atomically. A reader therefore sees the parts written so far, never half of one. A
weight-version column (``policy_version``, ``policy_version_min``) that only some parts carry is
dropped from the step: it is written only when every row has one.
Every file is fsynced before it is renamed into place, and the directory after, so a step whose
write has returned survives a crash of the machine as well as a kill of the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rldiag.capture.fields import VERSION_SOURCES
from rldiag.capture.policy import META_KEY, merge_records, read_record
from rldiag.capture.reward_inputs import decoded_texts
from rldiag.capture.unpad import StepPayload
from rldiag.errors import CaptureError
from rldiag.io.loader import validate_table
from rldiag.io.rundir import StepFile
from rldiag.io.schema import (
    LIST_COLUMNS,
    MASK_LIST_COLUMNS,
    PROMPT_TEXT_COLUMN,
    RESPONSE_TEXT_COLUMN,
    SCALAR_COLUMNS,
)
from rldiag.io.staged import replace_file

_INT32_MAX = np.iinfo(np.int32).max


def _list_array(values: np.ndarray | pa.Array, offsets: np.ndarray, large: bool, dtype: pa.DataType) -> pa.Array:
    cls = pa.LargeListArray if large else pa.ListArray
    off = pa.array(offsets, type=pa.int64() if large else pa.int32())
    return cls.from_arrays(off, values if isinstance(values, pa.Array) else pa.array(values, type=dtype))


def _offsets(lengths: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(row offsets, large)``: the cumulative lengths, int64 when they pass int32's range."""
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    large = int(offsets[-1]) > _INT32_MAX
    return (offsets if large else offsets.astype(np.int32)), large


def _row_array(name: str, values: np.ndarray) -> pa.Array:
    kind = SCALAR_COLUMNS.get(name)
    if values.dtype.kind in "OUS" or kind == "string":
        return pa.array(values.astype(str), type=pa.string())
    if values.dtype.kind == "i" and values.dtype.itemsize == 1:  # a 0/1 flag (reward_inputs_repr)
        return pa.array(values, type=pa.int8())
    if kind == "int" or values.dtype.kind in "biu":
        return pa.array(values.astype(np.int64), type=pa.int64())
    return pa.array(values.astype(np.float64), type=pa.float64())


#: The column that numbers the parts of a step written more than once.
PART_COLUMN = "part"
#: The optional list<string> columns of each response's and each prompt's token strings.
TOKENS_COLUMN = RESPONSE_TEXT_COLUMN
PROMPT_TOKENS_COLUMN = PROMPT_TEXT_COLUMN
#: each row's response and prompt decoded whole (a reward function's ``solution_str``)
RESPONSE_STRING_COLUMN = "response_text"
PROMPT_STRING_COLUMN = "prompt_text"


def token_strings(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text of each token id: ``tokenizer.convert_ids_to_tokens`` (one call for the whole
    step) when the tokenizer has it (Hugging Face tokenizers do), else ``decode([id])`` per token."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if callable(convert):
        out = convert(list(ids))
    elif callable(getattr(tokenizer, "decode", None)):
        out = [tokenizer.decode([i]) for i in ids]
    else:
        raise CaptureError(f"the tokenizer ({type(tokenizer).__name__}) has neither convert_ids_to_tokens nor decode")
    if len(out) != len(ids):
        raise CaptureError(f"the tokenizer returned {len(out)} token strings for {len(ids)} ids")
    return ["" if t is None else str(t) for t in out]


class TokenText:
    """A tokenizer's text of a step: called with ids, the text of each token
    (:func:`token_strings`); :meth:`texts`, each row's ids decoded as verl's reward manager
    decodes them (``response_text``, ``prompt_text``: :func:`rldiag.capture.reward_inputs.decoded_texts`)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def __call__(self, ids: Sequence[int]) -> list[str]:
        return token_strings(self.tokenizer, ids)

    def texts(self, ids: np.ndarray, lengths: np.ndarray) -> list[str] | None:
        return decoded_texts(self.tokenizer, ids, lengths)


def payload_table(p: StepPayload, token_text: Callable[[Sequence[int]], list[str]] | None = None) -> pa.Table:
    """The batch table of one step (docs/run-directory.md): ``step``, ``uid``, row scalars, then list columns.

    ``token_text``: ids -> strings; with it (and the payload's token ids) the table gets a
    ``response_tokens`` list<string> column, one string per token of each row, and (with the
    payload's prompt ids) ``prompt_tokens``, one string per prompt token. Both come from one
    ``token_text`` call on the step's response ids followed by its prompt ids. A ``token_text``
    that also decodes whole rows (:class:`TokenText` with a tokenizer that decodes) adds
    ``response_text`` and ``prompt_text``, one string per row."""
    offsets, large = _offsets(p.lengths)
    cols: dict[str, pa.Array] = {"step": pa.array(np.full(p.n_rows, p.step, dtype=np.int64))}
    for name in ("uid", *sorted(k for k in p.rows if k != "uid")):
        cols[name] = _row_array(name, p.rows[name])
    for name in LIST_COLUMNS:
        if name in p.tokens:
            dtype = pa.int8() if name in MASK_LIST_COLUMNS else pa.float32()
            cols[name] = _list_array(p.tokens[name], offsets, large, dtype)
    if token_text is not None and p.token_ids is not None:
        prompts = (p.prompt_ids, p.prompt_lengths) if p.prompt_ids is not None and p.prompt_lengths is not None else None
        ids = p.token_ids if prompts is None else np.concatenate([p.token_ids, prompts[0]])
        text = pa.array(token_text(ids.tolist()), type=pa.string())
        n = int(p.token_ids.shape[0])  # the response strings first, then the prompt strings
        cols[TOKENS_COLUMN] = _list_array(text.slice(0, n), offsets, large, pa.string())
        if prompts is not None:
            prompt_offsets, prompt_large = _offsets(prompts[1])
            cols[PROMPT_TOKENS_COLUMN] = _list_array(text.slice(n), prompt_offsets, prompt_large, pa.string())
        texts = getattr(token_text, "texts", None)
        if callable(texts) and (rows := texts(p.token_ids, p.lengths)) is not None:
            cols[RESPONSE_STRING_COLUMN] = pa.array(rows, type=pa.string())
            if prompts is not None and (rows := texts(prompts[0], prompts[1])) is not None:
                cols[PROMPT_STRING_COLUMN] = pa.array(rows, type=pa.string())
    return pa.table(cols)


def _with_part(table: pa.Table, part: int) -> pa.Table:
    if PART_COLUMN in table.column_names:
        return table
    return table.append_column(PART_COLUMN, pa.array(np.full(table.num_rows, part, dtype=np.int64)))


def _append_part(p: StepPayload, table: pa.Table) -> pa.Table:
    """The rows already on disk for ``p.step`` followed by ``table`` (part ``p.part``)."""
    if not p.path.is_file():
        raise CaptureError(f"step {p.step}: part {p.part} arrived but the file of its earlier parts, "
                           f"{p.path}, is missing")
    old = _with_part(pq.read_table(p.path), 0)
    new = _with_part(table, p.part)
    # a weight version only some parts have: not every row of the step has one, so no column
    unversioned = (set(old.column_names) ^ set(new.column_names)) & set(VERSION_SOURCES)
    if unversioned:
        old = old.drop_columns([c for c in old.column_names if c in unversioned])
        new = new.drop_columns([c for c in new.column_names if c in unversioned])
    if set(old.column_names) != set(new.column_names):
        extra = sorted(set(new.column_names) ^ set(old.column_names))
        raise CaptureError(f"step {p.step}: part {p.part} does not have the columns of the earlier parts "
                           f"in {p.path} (differing: {', '.join(extra)}); every part of a step must carry the "
                           "same fields")
    new = new.select(old.column_names)
    try:
        return pa.concat_tables([old, new.cast(old.schema)])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise CaptureError(f"step {p.step}: part {p.part} does not match the types of the earlier parts "
                           f"in {p.path}: {exc}") from exc


#: float list columns whose values vary token to token (log-probs, entropies, values): their bytes
#: split by significance (Parquet's BYTE_STREAM_SPLIT) before the codec, which then finds the
#: sign/exponent bytes' regularity; the others (scores, rewards, advantages, returns: constant
#: over a row or mostly 0) compress best as dictionary indices (run-length encoded)
SPLIT_FLOAT_COLUMNS = ("old_log_probs", "log_probs", "ref_log_prob", "rollout_log_probs", "values", "vpreds",
                       "entropy", "sum_pi_squared")
#: the Parquet layouts of a batch file: name -> (how the SPLIT_FLOAT_COLUMNS are encoded, zstd
#: level or None for the codec's default). ``dictionary``: pyarrow's defaults, a dictionary page
#: tried on every column, as batch files were written before issue 38 (on log-probs the
#: dictionary overflows and costs more than the plain floats); ``plain``: those floats as they
#: are; ``split``: byte-stream-split. Every other column keeps a dictionary (masks, strings and
#: the row-constant floats: their indices run-length encoded). ``tuned`` is the default, chosen
#: by bench/bench_capture.py (docs/performance.md); the others are the variations measured
LAYOUTS: dict[str, tuple[str, int | None]] = {
    "legacy": ("dictionary", None),
    "tuned": ("split", 1),
    "split-zstd3": ("split", 3),
    "split-zstd9": ("split", 9),
    "plain-zstd1": ("plain", 1),
}
DEFAULT_LAYOUT = "tuned"


def parquet_options(table: pa.Table, compression: str = "zstd", layout: str = DEFAULT_LAYOUT) -> dict[str, Any]:
    """The keyword arguments of ``pq.write_table`` for a batch table under ``layout``
    (:data:`LAYOUTS`). Every layout is lossless: the same Arrow table reads back. ``compression``:
    the codec (the level applies to zstd only)."""
    if layout not in LAYOUTS:
        raise CaptureError(f"unknown Parquet layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    floats, level = LAYOUTS[layout]
    opts: dict[str, Any] = {"compression": compression}
    if level is not None and compression == "zstd":
        opts["compression_level"] = level
    if floats != "dictionary":
        # the encodings name Parquet's leaf columns: a list column's values are ``<name>.list.element``
        leaf = {f.name: f"{f.name}.list.element" if pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
                else f.name for f in table.schema}
        names = [leaf[c] for c in SPLIT_FLOAT_COLUMNS if c in leaf]
        if floats == "split":
            opts["use_byte_stream_split"] = names
        opts["use_dictionary"] = [v for v in leaf.values() if v not in names]
    return opts


def write_step_file(p: StepPayload, compression: str = "zstd",
                    token_text: Callable[[Sequence[int]], list[str]] | None = None, layout: str = DEFAULT_LAYOUT) -> int:
    """Validate and write one step's batch file atomically; returns its size in bytes.

    The file is written under a hidden temporary name in ``batches/`` (``.step_<N>.parquet.<id>.tmp``,
    which no reader picks up), fsynced, and renamed over the final name, its directory fsynced
    after (:func:`rldiag.io.staged.replace_file`), so a reader sees no file or the whole file. A
    later part (``p.part > 0``) is appended to the parts on disk (see the module docstring).
    ``layout``: the Parquet encodings (:func:`parquet_options`).
    """
    table = payload_table(p, token_text)
    record = p.sample
    if p.part > 0:
        if record is not None and p.path.is_file():
            record = merge_records(read_record(pq.read_schema(p.path).metadata), record)
        table = _append_part(p, table)
    validate_table(table, StepFile(p.step, p.path))
    if record is not None:  # the capture policy's record of the step (rldiag.capture.policy)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: json.dumps(record)})

    def write(tmp: Path) -> None:
        pq.write_table(table, tmp, **parquet_options(table, compression, layout))

    replace_file(p.path, write, durable=True)
    return p.path.stat().st_size

