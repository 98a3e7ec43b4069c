"""Padded trainer tensors -> one step's flat columns (the part that runs on the training thread).

A trainer holds a step as right-padded ``(rows, R)`` response tensors (R = the response width)
plus an attention mask over prompt and response. Unpadding keeps, for every row, the positions
where the *response attention mask* is 1: sampled tokens and tool-observation tokens alike (the
latter keep ``response_mask`` 0). The kept positions become one flat index into the row-major
``(rows, R)`` layout (computed once per step), so each column is one ``index_select`` on the
tensor's own device followed by one copy to the CPU; the flat values of row i are contiguous and
the row offsets are the cumulative lengths. No Python loop per row.

The gather is also the snapshot: the writer thread only ever sees these fresh CPU arrays, so the
trainer may reuse or modify its tensors as soon as ``write_batch`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch

from rldiag.capture.fields import (
    ATTENTION_KEY,
    KNOWN_NAMES,
    MASK_SOURCES,
    PROMPTS_KEY,
    RESPONSES_KEY,
    ROW_SOURCES,
    TOKEN_SOURCES,
    VERSION_SOURCES,
)
from rldiag.capture.reward_inputs import reward_input_columns
from rldiag.errors import BatchError, CaptureError, MissingInputError
from rldiag.io.schema import LIST_COLUMNS


class Where(TypedDict):
    """Where a batch came from, as every error raised on it names it."""

    file: str
    step: int


@dataclass
class StepPayload:
    """One step, unpadded, ready for the writer thread.

    Attributes:
        step: the training step.
        path: the batch file it will be written to.
        lengths: ``(rows,)`` int64, each row's response length T_i (tool tokens included).
        tokens: column -> flat ``(sum T_i,)`` values (float32, or int8 for masks), rows in order.
        rows: column -> ``(rows,)`` values (numpy; strings as a numpy ``str`` array).
        part: 0 for the first write of the step, K for its (K+1)-th (see ``RunWriter``).
        token_ids: flat ``(sum T_i,)`` int64 response token ids, kept when token text is wanted.
        prompt_ids: flat ``(sum P_i,)`` int64 prompt token ids (each row's real prompt tokens, in
            order), kept when token text is wanted and the batch has ``prompts``.
        prompt_lengths: ``(rows,)`` int64, each row's prompt length P_i (with ``prompt_ids``).
        sample: the capture policy's record of the step (:func:`rldiag.capture.policy.sample_record`),
            kept in the batch file's metadata; None without a policy.
    """

    step: int
    path: Path
    lengths: np.ndarray
    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    part: int = 0
    token_ids: np.ndarray | None = None
    prompt_ids: np.ndarray | None = None
    prompt_lengths: np.ndarray | None = None
    sample: dict[str, Any] | None = None

    @property
    def n_rows(self) -> int:
        return int(self.lengths.shape[0])


def split_batch(batch: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, non_tensors)`` of a verl ``DataProto``-like object or a plain mapping.

    DataProto-like (duck-typed): ``.batch`` is a mapping of tensors (a TensorDict in verl) and
    ``.non_tensor_batch`` a mapping of numpy arrays. A plain mapping is split by value: torch
    tensors and 2-D numeric numpy arrays are tensors, everything else (lists, 1-D arrays of
    strings or numbers) is kept as a non-tensor field.
    """
    if hasattr(batch, "batch") and hasattr(batch, "non_tensor_batch"):
        tb = batch.batch
        tensors = {} if tb is None else {str(k): tb[k] for k in list(tb.keys())}
        non = dict(batch.non_tensor_batch or {})
        return tensors, non
    if isinstance(batch, Mapping):
        tensors, non = {}, {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                tensors[str(k)] = v
            elif isinstance(v, np.ndarray) and v.ndim == 2 and v.dtype.kind in "biuf":
                tensors[str(k)] = torch.from_numpy(v)
            else:
                non[str(k)] = v
        return tensors, non
    raise CaptureError(
        f"write_batch expects a mapping of tensors or a DataProto-like object (.batch and "
        f".non_tensor_batch), not {type(batch).__name__}"
    )


def _first(names: Sequence[str], *maps: Mapping[str, Any]) -> tuple[str, Any] | None:
    for name in names:
        for m in maps:
            if name in m and m[name] is not None:
                return name, m[name]
    return None


def _response_attention(
    tensors: dict[str, torch.Tensor], mask: torch.Tensor, where: Where
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(response attention (rows, R) bool, prompt attention (rows, P) or None)``.

    Without an attention mask each row is taken to end at its last ``response_mask`` 1 (a tool
    observation at the very end of a row is then dropped; pass ``attention_mask`` to keep it).
    """
    rows, width = mask.shape
    am = tensors.get(ATTENTION_KEY)
    if am is None:
        pos = torch.arange(1, width + 1, device=mask.device)
        last = (mask.bool() * pos).amax(-1) if width else torch.zeros(rows, dtype=torch.long, device=mask.device)
        return pos.unsqueeze(0) <= last.unsqueeze(1), None
    if am.ndim != 2 or am.shape[0] != rows or am.shape[1] < width:
        raise BatchError(
            f"has shape {tuple(am.shape)}; expected (rows={rows}, prompt + response width >= {width})",
            column=ATTENTION_KEY, **where,
        )
    resp = am[:, am.shape[1] - width:].to(mask.device).bool()
    prompt = am[:, : am.shape[1] - width] if am.shape[1] > width else None
    return resp, prompt


def _row_values(value: Any, name: str, kind: str, rows: int, where: Where) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu").numpy()
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.shape[0] != rows:
        raise BatchError(f"has shape {arr.shape}; expected one value per row ({rows},)", column=name, **where)
    if kind == "string":
        return arr.astype(str)
    if arr.dtype.kind not in "biuf":
        raise BatchError(f"expected numbers, found dtype {arr.dtype}", column=name, **where)
    return arr.astype(np.float64 if kind == "float" else np.int64)


def _versions(value: Any, name: str, rows: int, where: Where) -> np.ndarray | None:
    """A per-row weight version (verl's ``max_global_steps`` / ``min_global_steps``: ints, an
    object array of them in verl's non-tensor batch) as int64; ``None`` when some row has none
    (``None`` or NaN, as verl leaves it where the rollout server reported no version): the step
    then gets no column rather than one with gaps. Anything but whole numbers is refused."""
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu").numpy()
    arr = np.asarray(value) if isinstance(value, np.ndarray) else np.asarray(list(value), dtype=object)
    if arr.ndim != 1 or arr.shape[0] != rows:
        raise BatchError(f"has shape {arr.shape}; expected one value per row ({rows},)", column=name, **where)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if arr.dtype == object:
        if bool(np.equal(arr, np.array(None, dtype=object)).any()):
            return None
        arr = np.asarray(arr.tolist())
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if arr.dtype.kind != "f":
        raise BatchError(f"expected whole numbers (a weight version per row), found dtype {arr.dtype}",
                         column=name, **where)
    if bool(np.isnan(arr).any()):
        return None
    bad = np.flatnonzero(~np.isfinite(arr) | (np.round(arr) != arr))
    if bad.size:
        raise BatchError(f"value {arr[bad[0]].item()} is not a weight version (a whole number)",
                         row=int(bad[0]), column=name, **where)
    return arr.astype(np.int64)


class _Gather:
    """Gathers the kept positions of ``(rows, width)`` tensors with one flat index per device."""

    def __init__(self, sel: torch.Tensor, where: Where):
        self.rows, self.width = sel.shape
        self.where = where
        self.lengths = sel.sum(-1).to("cpu", torch.int64).numpy()
        flat = torch.nonzero(sel.reshape(-1)).squeeze(1)  # (sum T_i,) row-major: rows stay contiguous
        self._index = {flat.device: flat}

    def __call__(self, t: torch.Tensor, name: str, dtype: torch.dtype) -> np.ndarray:
        if t.ndim != 2 or tuple(t.shape) != (self.rows, self.width):
            raise BatchError(f"has shape {tuple(t.shape)}; expected (rows, response width) = "
                             f"({self.rows}, {self.width})", column=name, **self.where)
        idx = self._index.setdefault(t.device, next(iter(self._index.values())).to(t.device))
        return t.detach().reshape(-1).index_select(0, idx).to("cpu", dtype).numpy()

    def mask(self, t: torch.Tensor, name: str) -> np.ndarray:
        """A 0/1 column as int8, refusing other values (the cast would hide them)."""
        values = self(t, name, torch.float64)
        bad = np.flatnonzero((values != 0) & (values != 1))
        if bad.size:
            row = int(np.searchsorted(np.cumsum(self.lengths), bad[0], side="right"))
            raise BatchError(f"mask value {float(values[bad[0]])!r}; masks hold only 0 and 1",
                             row=row, column=name, **self.where)
        return values.astype(np.int8)


def _row_columns(tensors: dict, non: dict, rows: int, extra_columns: Sequence[str], where: Where) -> dict:
    """Per-row columns: the schema's (``rldiag.io.schema``; the weight versions only when every
    row has one, :func:`_versions`), the requested extras, numeric non-tensor fields."""
    out: dict[str, np.ndarray] = {}
    for col, (names, kind) in ROW_SOURCES.items():
        hit = _first(names, tensors, non)
        if hit is not None:
            out[col] = _row_values(hit[1], hit[0], kind, rows, where)
    for col, names in VERSION_SOURCES.items():
        hit = _first(names, tensors, non)
        if hit is not None and (versions := _versions(hit[1], hit[0], rows, where)) is not None:
            out[col] = versions
    for name in extra_columns:
        hit = _first([name], tensors, non)
        if hit is None:
            raise MissingInputError(f"extra column {name!r} is not in the batch", column=name, **where)
        arr = np.asarray(hit[1].detach().cpu() if isinstance(hit[1], torch.Tensor) else hit[1])
        kind = "string" if arr.dtype.kind in "OUS" else "int" if arr.dtype.kind in "biu" else "float"
        out[name] = _row_values(arr, name, kind, rows, where)
    taken = KNOWN_NAMES | {RESPONSES_KEY, PROMPTS_KEY, ATTENTION_KEY} | set(LIST_COLUMNS) | {"step"}
    for name, value in non.items():
        if name in taken or name in out or not isinstance(value, np.ndarray):
            continue
        if value.ndim == 1 and value.shape[0] == rows and value.dtype.kind in "biuf":
            out[name] = value.astype(np.int64 if value.dtype.kind in "biu" else np.float64)
    return out


def _prompt_ids(prompts: torch.Tensor, prompt_attn: torch.Tensor | None, rows: int,
                where: Where) -> tuple[np.ndarray, np.ndarray]:
    """``(flat prompt token ids, prompt lengths)``: the positions where the prompt part of the
    attention mask is 1 (verl left-pads prompts; any padding works), one gather as for the
    response columns."""
    if prompts.ndim != 2 or prompts.shape[0] != rows:
        raise BatchError(f"has shape {tuple(prompts.shape)}; expected (rows={rows}, prompt width)",
                         column=PROMPTS_KEY, **where)
    if prompt_attn is None:
        if prompts.shape[1] > 0:
            raise MissingInputError(
                "prompt text needs the prompt part of attention_mask (rows, prompt + response width) to find "
                "each prompt's tokens among its padding", column=ATTENTION_KEY, **where)
        prompt_attn = torch.zeros((rows, 0), dtype=torch.bool, device=prompts.device)
    if tuple(prompts.shape) != tuple(prompt_attn.shape):
        raise BatchError(f"has shape {tuple(prompts.shape)}; expected (rows, prompt width) = "
                         f"{tuple(prompt_attn.shape)}, the prompt part of attention_mask",
                         column=PROMPTS_KEY, **where)
    gather = _Gather(prompt_attn.bool(), where)
    return gather(prompts, PROMPTS_KEY, torch.int64), gather.lengths


#: ``rows' uids (rows,) -> kept rows (rows,) bool, or None for all``: a capture policy's group draw
RowFilter = Callable[[np.ndarray], "np.ndarray | None"]


def unpad_batch(batch: Any, step: int, path: Path, extra_columns: Sequence[str] = (),
                token_ids: bool = False, keep_rows: RowFilter | None = None) -> StepPayload:
    """Unpad one step's batch (see the module docstring) and check its structure.

    ``extra_columns`` names further per-row fields to keep (strings allowed); per-row numeric
    fields of the non-tensor batch (e.g. reward components) are kept automatically.
    ``token_ids``: also keep the response token ids (the ``responses`` tensor) and, when the
    batch has them, the prompt token ids (``prompts``, unpadded by the prompt part of
    ``attention_mask``), for token text. ``keep_rows``: given the rows' ``uid``, the rows to keep
    (a capture policy's whole groups, :mod:`rldiag.capture.policy`); the others are not gathered.
    Raises :class:`BatchError` naming step, row and column for a malformed batch.
    """
    where: Where = {"file": str(path), "step": int(step)}
    tensors, non = split_batch(batch)
    found = _first(MASK_SOURCES["response_mask"], tensors)
    if found is None:
        raise MissingInputError("the batch has no response_mask tensor (rows, response width)",
                                column="response_mask", **where)
    mask = found[1]
    if mask.ndim != 2:
        raise BatchError(f"has shape {tuple(mask.shape)}; expected (rows, response width)",
                         column="response_mask", **where)
    rows, width = mask.shape
    if RESPONSES_KEY in tensors and tensors[RESPONSES_KEY].shape[-1] != width:
        raise BatchError(
            f"response_mask width {width} differs from responses width {tensors[RESPONSES_KEY].shape[-1]}",
            column="response_mask", **where,
        )
    sel, prompt_attn = _response_attention(tensors, mask, where)
    outside = mask.bool() & ~sel
    if bool(outside.any()):
        r, t = (int(i) for i in outside.nonzero()[0])
        raise BatchError(f"is 1 at token {t}, where the response attention mask is 0 (padding)",
                         row=r, column="response_mask", **where)
    rows_out = _row_columns(tensors, non, rows, extra_columns, where)
    rows_out.update(reward_input_columns(non, rows, where))  # data_source, ground_truth, extra_info
    if "prompt_length" not in rows_out and prompt_attn is not None:
        rows_out["prompt_length"] = prompt_attn.sum(-1).to("cpu", torch.int64).numpy()
    if "uid" not in rows_out:
        raise MissingInputError("the batch has no uid (verl's prompt-group id, one per row)", column="uid", **where)
    keep = keep_rows(rows_out["uid"]) if keep_rows is not None else None
    if keep is not None:  # the left-out rows are not gathered: their tokens select nothing
        kept = torch.from_numpy(np.asarray(keep, dtype=bool))
        sel = sel & kept.to(sel.device).unsqueeze(1)
        if prompt_attn is not None:
            prompt_attn = prompt_attn.bool() & kept.to(prompt_attn.device).unsqueeze(1)
        rows_out = {k: v[keep] for k, v in rows_out.items()}
    gather = _Gather(sel, where)
    payload = StepPayload(step=int(step), path=path, lengths=gather.lengths if keep is None else gather.lengths[keep])
    for col, names in MASK_SOURCES.items():
        hit = _first(names, tensors)
        if hit is not None:
            payload.tokens[col] = gather.mask(hit[1], hit[0])
    for col, names in TOKEN_SOURCES.items():
        hit = _first(names, tensors)
        if hit is not None:
            payload.tokens[col] = gather(hit[1], hit[0], torch.float32)
    if token_ids:
        if RESPONSES_KEY not in tensors:
            raise MissingInputError("token text needs the response token ids (a responses tensor (rows, R))",
                                    column=RESPONSES_KEY, **where)
        payload.token_ids = gather(tensors[RESPONSES_KEY], RESPONSES_KEY, torch.int64)
        if PROMPTS_KEY in tensors:
            payload.prompt_ids, payload.prompt_lengths = _prompt_ids(tensors[PROMPTS_KEY], prompt_attn, rows, where)
            if keep is not None:
                payload.prompt_lengths = payload.prompt_lengths[keep]
    payload.rows = rows_out
    if "token_level_scores" not in payload.tokens and "score" not in payload.rows:
        raise MissingInputError("the batch has neither token_level_scores / rm_scores nor a per-row score",
                                column="token_level_scores", **where)
    return payload
