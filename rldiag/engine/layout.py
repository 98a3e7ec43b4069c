"""The packed token layout: flat ``(tokens,)`` values with row offsets ``(rows + 1,)``.

This is Arrow's list layout (a list column is its flat values and ``rows + 1`` offsets), so a
column read from Parquet needs no padding and a result goes back out as a list column by
wrapping the same offsets. Memory and work are in proportion to the tokens, whatever the
longest row of a step: a step of 8,192 rows with a few at a 32k cap costs its tokens, not
``8,192 x 32,768``.

:class:`Rows` describes the layout and reduces token tensors per row (``torch.segment_reduce``
over the offsets: one kernel per reduction on the CPU and on CUDA, no loop per row), masked
reductions included (``rows.masked_sum(values, mask)``, ``masked_square_sum``, ``mask_count``,
``masked_count``, ``masked_positive_count``, ``masked_extrema``; their CPU-fast forms are in
:mod:`rldiag.engine.kernels`). Per-step,
per-group and per-micro-batch reductions are segment reductions of the per-row results keyed by
row ids (:mod:`rldiag.engine.segments`). The time recursions are segmented scans that restart at
row boundaries (:mod:`rldiag.engine.scan`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from rldiag.engine import host, kernels, rows_native

#: tokens per chunk summed in the values' dtype before the chunk sums are accumulated in float64
PIECE = 64


def row_ids_of(offsets: torch.Tensor) -> torch.Tensor:
    """``(tokens,)`` the row of each token, from ``(rows + 1,)`` offsets: a 1 where each row after
    the first starts (empty rows add up), summed cumulatively (several times faster on the CPU
    than ``repeat_interleave``)."""
    n = int(offsets[-1]) if offsets.numel() else 0
    starts = offsets[1:-1]
    marks = torch.zeros(n + 1, dtype=torch.long, device=offsets.device)
    marks.index_add_(0, starts, torch.ones_like(starts))
    # summed in place: the marks become the row ids (one token-sized int64 tensor at the peak, not two)
    return marks[:n].cumsum_(0)


@dataclass(frozen=True)
class _ChunkPlan:
    """Each row split into whole chunks of ``PIECE`` tokens and edge fragments (see
    :meth:`Rows._chunked_sum`).

    Attributes:
        n_chunks: whole chunks in the tokens (the last ``tokens % PIECE`` are in no chunk).
        lo, hi: ``(rows,)`` the row's whole chunks are ``[lo, hi)`` (``lo == hi``: none).
        frag: ``(f,)`` positions of the rows' other tokens, row by row (fewer than ``2 PIECE``
            per row); ``frag_offsets`` ``(rows + 1,)`` where each row's start.
        mid: ``(m,)`` the whole chunks, row by row; ``mid_offsets`` ``(rows + 1,)``.
    """

    n_chunks: int
    lo: torch.Tensor
    hi: torch.Tensor
    frag: torch.Tensor
    frag_offsets: torch.Tensor
    mid: torch.Tensor
    mid_offsets: torch.Tensor


def chunk_plan(offsets: torch.Tensor, n_tokens: int) -> _ChunkPlan:
    """:meth:`Rows._chunk_plan` of the layout with ``offsets`` ``(rows + 1,)`` and ``n_tokens``
    tokens, by torch on ``offsets``' device."""
    n = n_tokens
    nf = n // PIECE
    start, end = offsets[:-1], offsets[1:]
    lo = torch.div(start + (PIECE - 1), PIECE, rounding_mode="floor").clamp_(max=nf)
    hi = torch.div(end, PIECE, rounding_mode="floor")
    whole = hi > lo
    hi = torch.where(whole, hi, lo)
    # the fragments: [start, lo PIECE) then [hi PIECE, end) where the row has whole chunks,
    # all of [start, end) where it has none
    head = torch.where(whole, lo * PIECE - start, end - start)
    tail = torch.where(whole, end - hi * PIECE, torch.zeros_like(end))
    frag_rows = Rows.from_lengths(head + tail)
    k = frag_rows.positions()
    r = frag_rows.row_ids
    head_r = head.index_select(0, r)
    frag = torch.where(k < head_r, start.index_select(0, r) + k, (hi * PIECE).index_select(0, r) + (k - head_r))
    mid_rows = Rows.from_lengths(hi - lo)
    mid = lo.index_select(0, mid_rows.row_ids) + mid_rows.positions()
    return _ChunkPlan(nf, lo, hi, frag, frag_rows.offsets, mid, mid_rows.offsets)


def _concat_ranges(first: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranges ``[first[i], first[i] + lengths[i])`` one after the other ``(sum lengths,)``
    int64, each value's range ``(sum lengths,)`` and the ranges' offsets ``(ranges + 1,)``."""
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    which = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    return np.arange(int(offsets[-1]), dtype=np.int64) - (offsets[:-1] - first)[which], which, offsets


def chunk_plan_host(offsets: torch.Tensor, n_tokens: int) -> _ChunkPlan:
    """:meth:`Rows._chunk_plan` of the layout with host ``offsets`` ``(rows + 1,)`` and
    ``n_tokens`` tokens, computed by numpy (the same integers as torch's form)."""
    off = offsets.numpy()
    nf = n_tokens // PIECE
    start, end = off[:-1], off[1:]
    lo = np.minimum((start + (PIECE - 1)) // PIECE, nf)
    hi = end // PIECE
    whole = hi > lo
    hi = np.where(whole, hi, lo)
    # the fragments: [start, lo PIECE) then [hi PIECE, end) where the row has whole chunks, all
    # of [start, end) where it has none
    head = np.where(whole, lo * PIECE - start, end - start)
    tail = np.where(whole, end - hi * PIECE, 0)
    pos, r, frag_offsets = _concat_ranges(start, head + tail)
    k = pos - start[r]  # the position in the row's fragments
    frag = np.where(k < head[r], pos, hi[r] * PIECE + (k - head[r]))
    mid, _, mid_offsets = _concat_ranges(lo, hi - lo)
    t = torch.from_numpy
    return _ChunkPlan(nf, t(lo), t(hi), t(frag), t(frag_offsets), t(mid), t(mid_offsets))


@dataclass(frozen=True)
class Rows:
    """The row layout of flat token tensors.

    Attributes:
        offsets: ``(rows + 1,)`` int64, row ``i`` holds tokens ``[offsets[i], offsets[i + 1])``.
        row_ids: ``(tokens,)`` int64, the row of each token.
    """

    offsets: torch.Tensor
    row_ids: torch.Tensor

    @staticmethod
    def from_lengths(lengths: torch.Tensor) -> Rows:
        """The layout of rows of ``lengths`` ``(rows,)`` tokens, packed in order."""
        lengths = lengths.to(torch.long)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return Rows(offsets, row_ids_of(offsets))

    @staticmethod
    def from_offsets(offsets: torch.Tensor) -> Rows:
        offsets = offsets.to(torch.long)
        return Rows.from_lengths(offsets[1:] - offsets[:-1]) if offsets.numel() > 1 else Rows.from_lengths(
            torch.zeros(0, dtype=torch.long, device=offsets.device)
        )

    @property
    def n_rows(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.row_ids.numel())

    @property
    def lengths(self) -> torch.Tensor:
        """``(rows,)`` int64."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    def to(self, device: torch.device | str) -> Rows:
        return Rows(self.offsets.to(device), self.row_ids.to(device))

    # ---- per-row reductions of token tensors ------------------------------------------------

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over each row's tokens ``(tokens,) -> (rows,)``; an empty row gives 0. Accumulated
        in float64 across chunks of ``PIECE`` tokens (a row of 32k float32 tokens sums to about
        float32 precision of the result, whatever the order), returned in ``x``'s dtype; integer
        and bool tensors as float32. A non-finite value gives its own row NaN / inf only. On the
        host, after torch's chunk sums, the rest in one compiled call where it was built
        (:mod:`rldiag.engine.rows_native`: the same bits as :meth:`_chunked_sum`'s)."""
        if not x.is_floating_point():
            x = x.to(torch.float32)
        if rows_native.usable(x, self.offsets):  # the same bits in one compiled call after torch's chunk sums
            done = rows_native.row_sums(x, self.offsets, PIECE)
            finite = done is not None
        else:
            done = self._chunked_sum(x)
            finite = host.all_finite(done)
        if not finite:  # a NaN or inf stays in its own row
            done = torch.segment_reduce(x.to(torch.float64), "sum", offsets=self.offsets)
        assert done is not None
        return done.to(x.dtype)

    def _chunked_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Row sums in float64 ``(rows,)`` without a sequential sum over a long row.

        The tokens are viewed (no copy) as chunks of ``PIECE``, each summed in one vectorised
        pass; a row is the chunks wholly inside it (their sums accumulated in float64, a
        difference of prefix sums over chunks) plus its edge fragments (the tokens of the chunks
        it shares with its neighbours: fewer than ``2 PIECE``), gathered once and summed per row
        in float64. One pass over the tokens plus a gather of the fragments; no float64 copy of
        the tokens, and no token of a neighbouring row enters a row's sum."""
        n = x.numel()
        if n == 0:
            return torch.zeros(self.n_rows, dtype=torch.float64, device=x.device)
        plan = self._chunk_plan
        chunk = x[: plan.n_chunks * PIECE].view(plan.n_chunks, PIECE).sum(-1).to(torch.float64)
        before = torch.nn.functional.pad(torch.cumsum(chunk, 0), (1, 0))  # (chunks + 1,)
        middle = before.index_select(0, plan.hi) - before.index_select(0, plan.lo)
        edges = torch.segment_reduce(x.index_select(0, plan.frag).to(torch.float64), "sum",
                                     offsets=plan.frag_offsets, initial=0.0)
        return middle + edges

    def _chunked_extreme(self, x: torch.Tensor, reduce: str, empty: float) -> torch.Tensor:
        """Per-row max or min ``(rows,)`` as :meth:`_chunked_sum` splits a row: the extreme of
        each whole chunk (one vectorised pass), reduced over the row's whole chunks, and its edge
        fragments reduced directly; ``torch.segment_reduce`` alone is sequential over a row."""
        plan = self._chunk_plan
        view = x[: plan.n_chunks * PIECE].view(plan.n_chunks, PIECE)
        chunk = view.amax(-1) if reduce == "max" else view.amin(-1)
        inner = torch.segment_reduce(chunk.index_select(0, plan.mid), reduce, offsets=plan.mid_offsets, initial=empty)
        edges = torch.segment_reduce(x.index_select(0, plan.frag), reduce, offsets=plan.frag_offsets, initial=empty)
        return torch.maximum(inner, edges) if reduce == "max" else torch.minimum(inner, edges)

    @cached_property
    def _chunk_plan(self) -> _ChunkPlan:
        """How :meth:`_chunked_sum` splits each row, fixed by the layout (computed once per
        layout): its whole chunks ``[lo, hi)`` and the positions of its other tokens. On the
        host by numpy (:func:`chunk_plan_host`: the same integers, a fraction of torch's fixed
        cost per call on these arrays of a few thousand entries), elsewhere by torch
        (:func:`chunk_plan`)."""
        if self.offsets.device.type == "cpu":
            return chunk_plan_host(self.offsets, self.n_tokens)
        return chunk_plan(self.offsets, self.n_tokens)

    def count(self, cond: torch.Tensor) -> torch.Tensor:
        """Tokens per row where ``cond`` (bool or 0/1) is true, float32 ``(rows,)``."""
        return self.sum(cond.to(torch.float32) if cond.dtype == torch.bool else (cond != 0).to(torch.float32))

    def amax(self, x: torch.Tensor, empty: float = float("-inf")) -> torch.Tensor:
        """Max over each row's tokens ``(rows,)``; ``empty`` for a row without tokens; NaN
        propagates as in ``torch.amax``."""
        if x.numel() == 0:
            return torch.full((self.n_rows,), empty, dtype=x.dtype, device=x.device)
        return self._chunked_extreme(x, "max", empty)

    def amin(self, x: torch.Tensor, empty: float = float("inf")) -> torch.Tensor:
        if x.numel() == 0:
            return torch.full((self.n_rows,), empty, dtype=x.dtype, device=x.device)
        return self._chunked_extreme(x, "min", empty)

    def any(self, cond: torch.Tensor) -> torch.Tensor:
        """``(rows,)`` bool: the row has a token where ``cond`` holds."""
        return self.count(cond) > 0

    # ---- per-row masked reductions (their CPU-fast forms: rldiag.engine.kernels) -----------

    def mask_count(self, mask: torch.Tensor) -> torch.Tensor:
        """Masked tokens per row ``(rows,)`` float32 (exact: counts below 2^24). Remembered per
        mask tensor while it lives unchanged (its version counter), so the many masked means over
        one mask count it once; each call gets its own copy."""
        return self._remembered(self._mask_counts, mask,
                                lambda: self.sum(mask if mask.dtype == torch.float32 else mask.to(torch.float32)))

    def column_sum(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`sum` of a tensor several stages sum per row (a batch column: the scores the
        advantages, the health and the rows stages each add up), remembered per tensor while it
        lives unchanged, as :meth:`mask_count`; each call gets its own copy."""
        return self._remembered(self._column_sums, x, lambda: self.sum(x))

    @staticmethod
    def _remembered(memo: dict[tuple[int, ...], tuple[tuple[weakref.ReferenceType, ...], tuple[int, ...], torch.Tensor]],
                    xs: torch.Tensor | tuple[torch.Tensor, ...], compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()``, remembered in ``memo`` per tensor ``xs`` (or tuple of tensors) while they
        live unchanged (their version counters); a copy to each caller."""
        ts = xs if isinstance(xs, tuple) else (xs,)
        try:
            versions = tuple(t._version for t in ts)
        except RuntimeError:  # an inference-mode tensor has no version counter: not remembered
            return compute()
        ids = tuple(id(t) for t in ts)
        hit = memo.get(ids)
        if hit is not None and all(r() is t for r, t in zip(hit[0], ts)) and hit[1] == versions:
            return hit[2].clone()
        out = compute()
        for k in [k for k, v in memo.items() if any(r() is None for r in v[0])]:  # tensors since freed
            del memo[k]
        memo[ids] = (tuple(weakref.ref(t) for t in ts), versions, out)
        return out.clone()

    @cached_property
    def _mask_counts(self) -> dict:
        """:meth:`mask_count`'s memory: (id(mask),) -> (the mask, its version, its counts)."""
        return {}

    @cached_property
    def _column_sums(self) -> dict:
        """:meth:`column_sum`'s memory: (id(x),) -> (the tensor, its version, its row sums)."""
        return {}

    @cached_property
    def _masked_sums(self) -> dict:
        """:meth:`masked_sum`'s memory: (id(values), id(mask)) -> (the tensors, their versions, the sums)."""
        return {}

    def masked_sum(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-row masked sum ``(rows,)``; NaN outside the mask cannot leak in (as verl's masked_sum).
        Remembered per pair of tensors while both live unchanged, as :meth:`mask_count` (the
        data metrics, the group signals and the rows stage each sum the advantages on the
        update's mask); each call gets its own copy."""
        return self._remembered(self._masked_sums, (values, mask), lambda: kernels.masked_row_sums(values, mask, self))

    def masked_square_sum(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-row ``sum(mask * values^2)`` ``(rows,)``, with :meth:`masked_sum`'s NaN rule."""
        return kernels.masked_row_square_sums(values, mask, self)

    def masked_count(self, cond: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-row count of masked positions where the bool ``cond`` holds, float32 ``(rows,)``."""
        return self.count(cond & (mask > 0))

    def masked_positive_count(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-row count of masked positions where ``x > 0``, float32 ``(rows,)``."""
        return kernels.count_positive_masked(x, mask, self)

    def masked_extrema(self, values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row (max, min) over the masked tokens ``(rows,)`` each; a row without a masked token
        gives ``-inf`` / ``+inf`` or about ``-3e38`` / ``+3e38`` (callers drop such rows)."""
        return kernels.masked_row_extrema(values, mask, self)

    # ---- per-row values on tokens -----------------------------------------------------------

    def expand(self, per_row: torch.Tensor) -> torch.Tensor:
        """``(rows,) -> (tokens,)``: each row's value on each of its tokens. On the host by
        numpy's ``repeat`` over the row lengths (a copy, the same values: several times faster
        than torch's gather by ``row_ids`` on the CPU, 0.05 against 0.33 ms for 524,288 float32
        tokens), elsewhere (or for a dtype numpy lacks) the gather."""
        v = host.view(per_row)
        if v is None or self.offsets.device.type != "cpu" or per_row.dim() != 1:
            return per_row.index_select(0, self.row_ids)
        if v.shape[0] != self.n_rows:
            raise ValueError(f"expand: {v.shape[0]} values for {self.n_rows} rows")
        return torch.from_numpy(np.repeat(v, self._lengths_host))

    @cached_property
    def _lengths_host(self) -> np.ndarray:
        """``(rows,)`` int64 row lengths as a numpy array (host layouts only)."""
        return np.diff(self.offsets.numpy())

    def positions(self) -> torch.Tensor:
        """``(tokens,)`` int64: the position of each token in its row (0 at the row's start)."""
        return torch.arange(self.n_tokens, device=self.device) - self.offsets[:-1].index_select(0, self.row_ids)

    def last(self) -> torch.Tensor:
        """``(tokens,)`` bool: the token is the last of its row."""
        out = torch.zeros(self.n_tokens, dtype=torch.bool, device=self.device)
        ends = self.offsets[1:][self.lengths > 0] - 1
        out[ends] = True
        return out

    # ---- reshaping --------------------------------------------------------------------------

    def take(self, index: torch.Tensor) -> tuple[Rows, torch.Tensor]:
        """The layout of rows ``index`` ``(k,)`` in that order, and the ``(tokens',)`` indices of
        their tokens in this layout (one gather per column then selects them)."""
        index = index.to(torch.long)
        lengths = self.lengths.index_select(0, index)
        sub = Rows.from_lengths(lengths)
        start = self.offsets[:-1].index_select(0, index)
        tok = sub.positions() + start.index_select(0, sub.row_ids)
        return sub, tok

    @staticmethod
    def cat(parts: list[Rows]) -> Rows:
        """The layout of several layouts' rows one after the other."""
        if len(parts) == 1:
            return parts[0]
        return Rows.from_lengths(torch.cat([p.lengths for p in parts]))

    # ---- the padded view, for tests and for callers that want a matrix ---------------------

    def pad(self, x: torch.Tensor, width: int | None = None, fill: float = 0.0) -> torch.Tensor:
        """``(tokens,) -> (rows, width)`` right-padded with ``fill`` (``width``: the longest row
        when None). Not used by the engine: a padded matrix is sized by the longest row."""
        lengths = self.lengths
        w = int(lengths.max()) if width is None and self.n_rows and self.n_tokens else (width or 0)
        out = torch.full((self.n_rows, w), fill, dtype=x.dtype, device=x.device)
        if self.n_tokens:
            out[self.row_ids, self.positions()] = x
        return out

    @staticmethod
    def unpad(padded: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, Rows]:
        """``(rows, width)`` right-padded -> the flat values of each row's first ``lengths[i]``
        tokens ``(tokens,)`` and their layout."""
        rows = Rows.from_lengths(lengths.to(padded.device))
        if padded.dim() != 2:
            raise ValueError(f"expected a (rows, width) tensor, got shape {tuple(padded.shape)}")
        return padded[rows.row_ids, rows.positions()], rows


class OffsetRows(Rows):
    """A layout given by its offsets and token count alone: ``row_ids`` (8 bytes a token) is
    made only when something reads it. For layouts whose per-row reductions (:meth:`Rows.sum`,
    the masked sums) read only the offsets, as the turns stage's spans
    (:mod:`rldiag.engine.stages.turns`): the same results as ``Rows(offsets, row_ids_of(offsets))``."""

    tokens: int

    def __init__(self, offsets: torch.Tensor, n_tokens: int) -> None:
        object.__setattr__(self, "offsets", offsets)  # a frozen dataclass's fields are set so
        object.__setattr__(self, "tokens", n_tokens)

    @cached_property
    def row_ids(self) -> torch.Tensor:
        """``(tokens,)`` int64, the row of each token (made when first read)."""
        return row_ids_of(self.offsets)

    @property
    def n_tokens(self) -> int:
        return self.tokens
