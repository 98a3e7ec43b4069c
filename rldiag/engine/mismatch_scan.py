"""One pass over a step's tokens for the mismatch fingerprints (:mod:`rldiag.engine.mismatch`):
every sum, product sum and count at once, chunk by chunk, on the host in numpy.

The step's tokens are read in chunks of :data:`CHUNK` tokens of the packed layout (nothing
compacted: the tokens off the actor mask set to 0 by their indices; each token's position from the
layout's row offsets, no index array of the tokens). Each chunk's two log-prob streams are
widened to float64 in arrays reused by every chunk (``(ROWS, CHUNK + 1)``, never a token-sized
copy) and reduced to one record (:data:`FIELDS`) of float64 sums. The chunk is read from the
batch's tensors as a numpy view (a copy of the chunk on the host for a batch on another device):
the pass is numpy's, whatever the device, so that its results are the same bits on every device
and every torch thread count.

Reductions (:mod:`rldiag.engine.mismatch_sums`): a sum of a chunk's series is numpy's pairwise
sum (one thread); a sum of products is ``bdot``, one BLAS dot per block of 8,192 values (one
thread each), no product array written.

Moments: the records hold plain sums of products, ``sum(a b)``, and a step's centred moment is
``sum(a b) - sum(a) sum(b) / n`` (``combine_raw``): no centred copy of any series. That form
loses about ``n mean^2 / sum((a - mean)^2)`` times the float64 rounding of the sums; where that
factor passes the caller's bound (``cancels``; a constant series, whose variance must be exactly
0, always does) the step is scanned again with each chunk centred on its own mean and the chunks
combined by Chan, Golub and LeVeque's pairwise update (``combine``): two-pass accurate, and
exactly 0 for a constant series (the float64 mean of a constant float32 value is that value).
The trainer's series ``x = y + d`` has no products of its own: its moments are ``d``'s and
``y``'s (``sum x x = sum d d + 2 sum d y + sum y y``); the centred scan sums it directly.

Quantiles: the step's first chunk sets a threshold (:func:`first_threshold`) and each chunk
keeps the d and y of its tokens whose ``|d|`` reaches it (:class:`Picked`, about 8 % of the
step; no token-sized array): :mod:`rldiag.engine.mismatch` selects the order statistics among
them exactly, or reads the step again with a lower threshold where too few reach it.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from rldiag.engine.host import values as host  # the pass's tensors as numpy arrays
from rldiag.engine.host import view as host_view
from rldiag.engine.layout import Rows
from rldiag.engine.mismatch_sums import bdot

#: tokens per chunk: large enough that the chunk's 60-odd array operations cost little per
#: token, small enough that its float64 arrays stay in the cache
CHUNK = 1 << 16

#: the series whose sums a record holds: trainer-rollout gap d, rollout y, position p, |d|, |y|
#: (all 0 off the actor tokens)
SERIES = ("d", "y", "p", "a", "ya", "x")
#: the cross-products kept (indices into SERIES): dd, dy, yy, aa, ap, pp, a|y|, |y||y|, xx, xy
PAIRS = ((0, 0), (0, 1), (1, 1), (3, 3), (3, 2), (2, 2), (3, 4), (4, 4), (5, 5), (5, 1))
#: a chunk's record: its token count, the sums of SERIES, the products PAIRS, then plain sums
#: (``d2``: sum of d^2; ``conf`` / ``unconf``: tokens with y >= / < the thresholds and their sum
#: of d; ``exp``: sum of exp|d|; ``extreme``: tokens with |d| above it; ``half``: 16-bit rollout
#: values; the adjacent pairs: count, sum of |d_t| + |d_t+1|, of |y_t - x_t+1|, of |y_t+1 - x_t|)
PLAIN = ("d2", "n_conf", "d_conf", "n_unconf", "d_unconf", "exp", "extreme", "half",
         "pairs", "pair_abs", "shift_next", "shift_prev")
FIELDS = ("n",) + tuple("s_" + s for s in SERIES) + tuple(f"m_{SERIES[i]}{SERIES[j]}" for i, j in PAIRS) + PLAIN
F = {name: i for i, name in enumerate(FIELDS)}

#: the thresholds the plain sums count against (log-probs): rollout p >= 1/2, p < 1/20, |d| > ln 2
CONFIDENT = math.log(0.5)
UNCONFIDENT = math.log(0.05)
EXTREME = math.log(2.0)
#: the normal float16 range (|y| in it, low 13 bits 0: a float16 value)
HALF_MIN, HALF_MAX = 2.0 ** -14, 65504.0

#: the rows of :attr:`Buffers.v`: the masked series d, y, |d| (in this order: one call sums
#: them), the trainer's x as read, the positions, the actor weights (where a path needs them as
#: a series) and scratch rows
D, Y, A, X, P, K, T, U, W = range(9)
ROWS = 9
def step_ranges(rows: Rows, step_ids: torch.Tensor, n_steps: int) -> list[list[tuple[int, int]]]:
    """Each step's token ranges ``[start, end)``: the runs of consecutive rows of that step
    (one range a step in a packed batch, whose steps follow each other)."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(n_steps)]
    n = step_ids.numel()
    if n == 0:
        return out
    sid, off = host_view(step_ids), host_view(rows.offsets)
    if sid is not None and off is not None:  # on the host by numpy: a few microseconds, not torch's 80
        starts = np.concatenate([[0], np.flatnonzero(sid[1:] != sid[:-1]) + 1])
        ends = np.append(starts[1:], n)
        runs = zip(sid[starts].tolist(), off[starts].tolist(), off[ends].tolist(), strict=True)
    else:
        first = torch.cat([step_ids.new_zeros(1), (step_ids[1:] != step_ids[:-1]).nonzero().squeeze(1) + 1])
        last = torch.cat([first[1:], step_ids.new_full((1,), n)])
        runs = zip(step_ids.index_select(0, first).tolist(), rows.offsets.index_select(0, first).tolist(),
                   rows.offsets.index_select(0, last).tolist(), strict=True)
    for s, a, b in runs:
        if b > a:
            out[s].append((a, b))
    return out


@dataclass
class Buffers:
    """The arrays a chunk is computed in (reused by every chunk and step)."""

    size: int

    # each allocated at its first use: a step the compiled pass reads alone never needs them

    @cached_property
    def v(self) -> np.ndarray:
        """``(ROWS, size + 1)`` float64: the rows D .. W."""
        return np.empty((ROWS, self.size + 1), dtype=np.float64)

    @cached_property
    def flags(self) -> np.ndarray:
        """``(size + 1,)`` bool: the chunk's actor flags."""
        return np.empty(self.size + 1, dtype=bool)

    @cached_property
    def cmp(self) -> np.ndarray:
        """``(size + 1,)`` bool scratch."""
        return np.empty(self.size + 1, dtype=bool)

    @cached_property
    def bits(self) -> np.ndarray:
        """``(size + 1,)`` int32 scratch."""
        return np.empty(self.size + 1, dtype=np.int32)

    @cached_property
    def base(self) -> np.ndarray:
        """``(size + 1,)`` float64 0, 1, 2, ... (written at first use: a pass that never loads a
        chunk here, the compiled one, pays nothing for it)."""
        return np.arange(self.size + 1, dtype=np.float64)


@dataclass(frozen=True)
class Inputs:
    """A packed batch's flat ``(tokens,)`` trainer and rollout log-probs and actor mask, and its
    layout's row offsets ``(rows + 1,)`` (numpy int64, and as a list)."""

    old: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    offsets: np.ndarray
    bounds: list[int]

    @staticmethod
    def of(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rows: Rows) -> Inputs:
        offsets = host(rows.offsets)
        return Inputs(old, rollout, mask, offsets, offsets.tolist())


@dataclass
class Chunk:
    """One chunk's tokens ``[a, a + m)`` in ``buf.v``, with the next token of the same run when
    there is one (``me = m + 1``: the pair the chunk's last token starts). Its rows: ``seg``, the
    starts of the row pieces in ``[0, m)`` (relative to ``a``, the first 0), ``origin`` each
    piece's row start relative to ``a`` (the first one's at or before 0), ``first`` the row of
    token ``a``, ``across`` the tokens in ``[0, me - 1)`` that end a row (their pair crosses into
    the next). Its tokens off the actor mask (mask 0 or a non-finite log-prob; ``off``, indices
    in ``[0, me)``, and ``actor``, the actor flags ``(me,)``, None when every token is one), its
    actor tokens ``n``, its rollout log-probs as stored (``rollout``, ``(m,)``) and the sums of
    the masked d, y, |d| over its ``m`` tokens."""

    a: int
    m: int
    me: int
    seg: np.ndarray
    origin: np.ndarray
    first: int
    across: np.ndarray
    off: np.ndarray
    actor: np.ndarray | None
    n: int
    rollout: np.ndarray
    sums: np.ndarray


def _rows(inp: Inputs, a: int, m: int, me: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """``(first, seg, origin, across)`` of :class:`Chunk`."""
    first = bisect_right(inp.bounds, a) - 1
    last = bisect_right(inp.bounds, a + me - 1, lo=first) - 1
    starts = inp.offsets[first + 1: last + 1] - a  # the row starts inside (0, me)
    inside = starts[starts < m]
    seg = np.concatenate([[0], inside])
    origin = np.concatenate([[inp.offsets[first] - a], inside])
    # empty rows start where the next one does: each token ends a row once
    return first, seg, origin, np.unique(starts) - 1


def load(inp: Inputs, buf: Buffers, a: int, m: int, me: int) -> Chunk:
    """Write the chunk's x (as read), y and d (0 off the actor tokens: mask > 0, both log-probs
    finite) and |d| to ``buf.v``, and sum d, y, |d|. The tokens off the mask are set to 0 by
    their indices (a few in most chunks: tool observations), not by a product with weights."""
    v = buf.v
    xs, ys, ks = host(inp.old[a: a + me]), host(inp.rollout[a: a + me]), host(inp.mask[a: a + me])
    x, y, d = v[X, :me], v[Y, :me], v[D, :me]
    np.copyto(x, xs)
    np.copyto(y, ys)
    np.subtract(x, y, out=d)
    actor = None if ks.min() > 0 else np.greater(ks, 0, out=buf.flags[:me])
    off = _EMPTY if actor is None else np.flatnonzero(~actor)
    for r in (D, Y):  # a non-finite log-prob off the mask goes too (row by row: a 2-D index costs more)
        v[r, off] = 0.0
    np.abs(d, out=v[A, :me])
    sums = v[D: A + 1, :m].sum(axis=1)
    if not (np.isfinite(sums).all() and np.isfinite(v[D: A + 1, m:me]).all()):
        # a non-finite log-prob on the mask: not an actor token
        actor = np.greater(ks, 0, out=buf.flags[:me]) & np.isfinite(xs) & np.isfinite(ys)
        off = np.flatnonzero(~actor)
        for r in (D, Y, A):
            v[r, off] = 0.0
        sums = v[D: A + 1, :m].sum(axis=1)
    first, seg, origin, across = _rows(inp, a, m, me)
    n = m - int(np.searchsorted(off, m))
    return Chunk(a, m, me, seg, origin, first, across, off, actor, n, ys[:m], sums)


_EMPTY = np.zeros(0, dtype=np.intp)


def weights(buf: Buffers, ch: Chunk) -> np.ndarray | None:
    """The chunk's actor weights (0/1 float64, ``buf.v[K, :me]``), None where every token is one."""
    if ch.actor is None:
        return None
    k = buf.v[K, :ch.me]
    np.copyto(k, ch.actor)
    return k


def positions(buf: Buffers, ch: Chunk) -> np.ndarray:
    """The chunk's positions in their rows as a series (``buf.v[P, :m]``, 0 off the actor tokens)."""
    p = buf.v[P, :ch.m]
    counts = np.diff(np.concatenate([ch.seg, [ch.m]]))
    np.subtract(buf.base[:ch.m], np.repeat(ch.origin.astype(np.float64), counts), out=p)
    p[ch.off[ch.off < ch.m]] = 0.0
    return p


def scan_chunk(buf: Buffers, ch: Chunk, centred: bool, picked: Picked) -> np.ndarray:
    """The chunk's record (:data:`FIELDS`) ``(len(FIELDS),)`` float64; its tokens for the order
    statistics go to ``picked`` (:func:`pick`; ``extreme`` is left to them where they hold every
    token above it).

    ``centred``: the ``m_*`` fields are the chunk's products centred on its own means (for
    :func:`combine`); else the plain sums of products (for :func:`combine_raw`: no centred copy
    of the series). Where no rollout log-prob of the chunk is above 0, ``|y| = -y`` and its sums
    are ``y``'s negated (the same values: a sum of negated terms is the negated sum)."""
    m, n, v = ch.m, ch.n, buf.v
    d, y, a = v[D, :m], v[Y, :m], v[A, :m]
    s_d, s_y, s_a = (float(s) for s in ch.sums)
    if ch.rollout.max() <= 0:
        ya = None
        s_ya = -s_y
    else:
        ya = np.abs(y, out=v[U, :m])
        s_ya = float(ya.sum())
    dd = bdot(d, d)
    p = positions(buf, ch)
    s_p = float(p.sum())
    out = [float(n), s_d, s_y, s_p, s_a, s_ya, s_d + s_y]
    if centred:
        out += _centred_moments(buf, ch, p, [s_d, s_y, s_p, s_a, s_ya, s_d + s_y])
    else:
        dy, yy = bdot(d, y), bdot(y, y)
        aya = -bdot(a, y) if ya is None else bdot(a, ya)
        # |d|^2 = d^2, |y|^2 = y^2, x = d + y: their plain sums are these
        out += [dd, dy, yy, dd, bdot(a, p), bdot(p, p), aya, yy, dd + 2.0 * dy + yy, dy + yy]
    out.append(dd)
    t, flags = v[T, :m], buf.cmp[:m]
    # y = 0 off the actor tokens: confident (with d = 0), so m - n of the count is theirs
    for above, threshold, off_mask in ((True, CONFIDENT, m - n), (False, UNCONFIDENT, 0)):
        (np.greater_equal if above else np.less)(y, threshold, out=flags)
        np.copyto(t, flags)
        out += [float(np.count_nonzero(flags) - off_mask), bdot(d, t)]
    out.append(float(np.exp(a, out=t).sum()) - (m - n))  # exp(0) = 1 off the actor tokens
    out.append(0.0 if picked.holds_extreme else float(np.count_nonzero(np.greater(a, EXTREME, out=flags))))
    out.append(half_count(ch.rollout, y, buf.bits[:m]))
    out += pair_sums(buf, ch)
    pick(buf, ch, picked)
    return np.array(out, dtype=np.float64)


#: the step's order statistics come from the tokens whose |d| reaches a threshold set on its
#: first chunk: the top PICK of that chunk's tokens (1.5 times the 5 % the quantiles need), read
#: from a strided sample (THRESHOLD_SAMPLE); every SAMPLE-th token's |d| is kept to set a lower
#: threshold where too few tokens reached it
PICK = 0.075
SAMPLE = 8
#: the first threshold's sample: one token in THRESHOLD_SAMPLE of the first chunk (2,048 of a
#: whole chunk: the top PICK of them estimated within about 0.6 % of the chunk's tokens, one
#: standard error, where the quantiles need 5 %), in runs of THRESHOLD_RUN consecutive tokens (a
#: run is one cache line of each stream, where a token every 32 read every other line: a chunk not
#: yet in the cache took 0.2 ms to sample, 0.05 ms in the cache)
THRESHOLD_SAMPLE = 32
THRESHOLD_RUN = 8


def threshold_positions(m: int) -> np.ndarray:
    """The sampled positions of a chunk of ``m`` tokens, ascending: runs of :data:`THRESHOLD_RUN`
    tokens, one starting every ``THRESHOLD_RUN * THRESHOLD_SAMPLE``."""
    starts = np.arange(0, m, THRESHOLD_RUN * THRESHOLD_SAMPLE)
    pos = (starts[:, None] + np.arange(THRESHOLD_RUN)[None, :]).ravel()
    return pos[pos < m]


@dataclass
class Picked:
    """The tokens a step's pass keeps for its order statistics: those whose ``|d|`` reaches
    ``threshold`` (for a threshold <= 0, those above 0: the others are exactly 0), their d and y
    (float64), and every :data:`SAMPLE`-th token's ``|d|`` (float32, 0 off the mask: to set a lower
    threshold where too few reach this one). ``holds_extreme``: every token with ``|d|`` above
    :data:`EXTREME` is kept (the threshold is at most that), so that they are counted there."""

    threshold: float
    d: list[np.ndarray] = field(default_factory=list)
    y: list[np.ndarray] = field(default_factory=list)
    sample: list[np.ndarray] = field(default_factory=list)

    @property
    def holds_extreme(self) -> bool:
        return self.threshold <= EXTREME


def threshold(sample: np.ndarray, share: float) -> float:
    """The value that the top ``share`` of ``sample`` reaches (0, every token above 0, for a
    sample of fewer than 64 values)."""
    if sample.shape[0] < 64:
        return 0.0
    j = min(int(sample.shape[0] * (1.0 - share)), sample.shape[0] - 1)
    return float(np.partition(sample, j)[j])


def first_threshold(buf: Buffers, ch: Chunk) -> float:
    """The threshold a step's first chunk sets: the top :data:`PICK` of its sampled ``|d|`` (every
    :data:`THRESHOLD_SAMPLE`-th token, in runs: :func:`threshold_positions`)."""
    return threshold(buf.v[A, threshold_positions(ch.m)], PICK)


def pick(buf: Buffers, ch: Chunk, picked: Picked) -> None:
    """Keep the chunk's tokens whose ``|d|`` reaches ``picked.threshold`` (above 0 for a
    threshold <= 0; the tokens off the mask have ``|d|`` 0, so that none is kept), and its sample."""
    m, v = ch.m, buf.v
    a = v[A, :m]
    if picked.threshold > 0:
        sel = np.greater_equal(a, picked.threshold, out=buf.cmp[:m])
    else:
        sel = np.greater(a, 0.0, out=buf.cmp[:m])
    at = np.flatnonzero(sel)
    picked.d.append(v[D, at])
    picked.y.append(v[Y, at])
    picked.sample.append(a[::SAMPLE].astype(np.float32))


def _centred_moments(buf: Buffers, ch: Chunk, p: np.ndarray, sums: list[float]) -> list[float]:
    """The chunk's products (:data:`PAIRS`) of its series centred on its own means, 0 off the
    actor tokens (the scan that :func:`cancels` asks for: no product loses to cancellation)."""
    m, v = ch.m, buf.v
    inv = 1.0 / max(ch.n, 1)
    k = weights(buf, ch)
    c = np.empty((len(SERIES), m), dtype=np.float64)
    for row, src, s in zip(range(len(SERIES)), (v[D, :m], v[Y, :m], p, v[A, :m], np.abs(v[Y, :m]),
                                                 v[D, :m] + v[Y, :m]), sums, strict=True):
        np.subtract(src, s * inv, out=c[row])
        if k is not None:
            c[row] *= k[:m]
    return [bdot(c[i], c[j]) for i, j in PAIRS]


def half_count(rollout: np.ndarray, y: np.ndarray, bits_buf: np.ndarray) -> float:
    """How many of the tokens' rollout log-probs are non-zero 16-bit floats: a bfloat16 (the
    float32's low 16 bits 0) or a normal float16 (low 13 bits 0, ``|y|`` in the normal range).
    ``rollout`` ``(m,)`` as stored, ``y`` ``(m,)`` float64, 0 off the actor tokens (so that they
    count in neither). Both kinds have the low 13 bits 0, which a float32 log-softmax's values
    almost never have: the few that do are gathered and tested."""
    bits = (rollout if rollout.dtype == np.float32 else rollout.astype(np.float32)).view(np.int32)
    low = np.bitwise_and(bits, 0x1FFF, out=bits_buf)
    at = np.flatnonzero(low == 0)
    b, size = bits[at], np.abs(y[at])
    bf16 = ((b & 0xFFFF) == 0) & (size != 0)
    fp16 = (size >= HALF_MIN) & (size <= HALF_MAX)
    return float(np.count_nonzero(bf16 | fp16))


def pair_sums(buf: Buffers, ch: Chunk) -> list[float]:
    """Over the pairs of adjacent actor tokens of a row starting in the chunk: their count, the
    sum of ``|d_t| + |d_t+1|``, of ``|y_t - x_t+1|`` and of ``|y_t+1 - x_t|``. Each pair by its
    first token; the pairs across two rows or with a token off the mask (``bad``, a few) are
    left out: their terms set to 0 by index, or, for ``|d_t| + |d_t+1|``, taken from the sums
    of ``|d|`` (no array of pair terms)."""
    k = ch.me - 1
    if k <= 0:
        return [0.0, 0.0, 0.0, 0.0]
    v = buf.v
    x, y, a = v[X, :ch.me], v[Y, :ch.me], v[A, :ch.me]
    if ch.actor is None:
        bad = ch.across
    else:
        valid = np.logical_and(ch.actor[:-1], ch.actor[1:], out=buf.cmp[:k])
        valid[ch.across] = False
        bad = np.flatnonzero(~valid)
    # sum over t < k of |d_t| + |d_t+1|: the chunk's sum of |d| over its m tokens, its first
    # token once less, the next run's first token (a pair's second, t + 1 = m) once more
    s_a = float(ch.sums[2])
    ends = s_a - float(a[0]) + (float(a[k]) if k == ch.m else -float(a[k]))
    pair_abs = (s_a + ends) - float(a[bad].sum() + a[bad + 1].sum())
    t = v[T: U + 1, :k]
    # x is the trainer's as read (not masked): its terms off the mask are set to 0
    np.subtract(y[:-1], x[1:], out=t[0])
    np.subtract(y[1:], x[:-1], out=t[1])
    np.abs(t, out=t)
    for row in t:  # row by row: a 2-D index costs 3 times as much
        row[bad] = 0.0
    shifts = t.sum(axis=1)
    return [float(k - bad.shape[0]), pair_abs, float(shifts[0]), float(shifts[1])]


def chunks(ranges: list[tuple[int, int]], size: int) -> Iterator[tuple[int, int, int, int]]:
    """``(a, m, me, at)`` per chunk of ``size`` tokens of the ranges: start, tokens, tokens read
    (one more when the range goes on: the pair of the chunk's last token), and its offset in the
    step's tokens."""
    at = 0
    for lo, hi in ranges:
        for a in range(lo, hi, size):
            m = min(size, hi - a)
            yield a, m, min(m + 1, hi - a), at
            at += m
