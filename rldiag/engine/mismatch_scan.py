"""One pass over a step's tokens for the mismatch fingerprints (:mod:`rldiag.engine.mismatch`):
every sum, product sum, count and the histogram of ``|d|`` at once, chunk by chunk.

The step's tokens are read in chunks of :data:`CHUNK` tokens of the packed layout (the actor
mask applied as 0/1 weights, nothing compacted, no index array of the tokens: each token's row
and position come from the layout's own ``row_ids`` and offsets); each chunk's two log-prob
streams are widened to float64 there (``(6, CHUNK)`` float64 arrays reused by every chunk,
never a token-sized float64 copy), and its statistics reduce to one record (:data:`FIELDS`) of
float64 sums.

Moments: the records hold plain sums of products, ``sum(a b)``, and a step's centred moment is
``sum(a b) - sum(a) sum(b) / n`` (:func:`combine_raw`): no centred copy of any series. That
form loses about ``n mean^2 / sum((a - mean)^2)`` times the float64 rounding of the sums; where
that factor passes the caller's bound (:func:`cancels`; a constant series, whose variance must
be exactly 0, always does) the step is scanned again with each chunk centred on its own mean and
the chunks combined by the pairwise update of Chan, Golub and LeVeque ("Algorithms for computing
the sample variance", 1983), :func:`combine`: ``M = sum_c [M_c + n_c (m_c - mu)(m'_c - mu')]``,
two-pass accurate, and exactly 0 for a constant series (the float64 mean of a constant float32
value is that value).

Quantiles: each token's ``|d|`` rounded to float32 (whose bits, for a non-negative value, order
like the values) falls in bucket ``bits >> HIST_SHIFT`` of the step's histogram, and is kept in
float32 (4 bytes a token of the step, -1 off the mask); the bucket of the lowest rank needed
bounds the tokens that can hold it or any rank above, and only those (about 5 % of the step) are
read back, their ``|d|`` recomputed in float64 and sorted (rldiag.engine.mismatch): the order
statistics are the exact float64 values, as a full sort would give them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from rldiag.engine.layout import Rows

#: a long sum is taken as rows of this many values (each row summed by one thread), then the
#: few row sums: torch splits a single sum of 32,768 values or more across its threads, and its
#: value would then depend on the thread count (tests/engine/test_thread_count.py); a reduction
#: with several outputs gives each output to one thread, whatever their number
BLOCK = 4096


def dsum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum()`` of a 1-D tensor, the same bits whatever torch's thread count."""
    k = x.numel() // BLOCK
    if k == 0:
        return x.sum()
    head = x[: k * BLOCK].view(k, BLOCK).sum(1)
    return torch.cat([head, x[k * BLOCK:].sum(0, keepdim=True)]).sum()


def ddot(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``u @ v`` of two 1-D tensors as :func:`dsum` of their product (a BLAS dot splits its sum
    by the thread count too)."""
    return dsum(u * v)


#: tokens per chunk: large enough that the chunk's 100-odd tensor operations cost little per
#: token, small enough that its float64 arrays (about 20 of CHUNK values) stay in the cache
CHUNK = 1 << 17
#: a non-negative float32's bucket is its bits shifted right by this (5 mantissa bits kept: a
#: bucket spans a factor of 1 + 1/32 at most)
HIST_SHIFT = 18
N_BUCKETS = 1 << (31 - HIST_SHIFT)

#: the series of a chunk whose moments are kept: trainer x, rollout y, d = x - y, |d|, the
#: position in the row, |y|
SERIES = ("x", "y", "d", "a", "p", "ya")
#: the cross-products kept (indices into SERIES)
PAIRS = ((0, 1), (0, 0), (1, 1), (2, 2), (2, 1), (3, 3), (3, 4), (4, 4), (3, 5), (5, 5))
#: a chunk's record: its token count, the sums of SERIES, the products PAIRS, then plain sums
#: (``d2``: sum of d^2; ``conf`` / ``unconf``: tokens with y >= / < the thresholds and their sum
#: of d; ``exp``: sum of exp|d|; ``extreme``: tokens with |d| above it; ``half``: 16-bit rollout
#: values; the adjacent pairs: count, sum of |d_t| + |d_t+1|, of |y_t - x_t+1|, of |y_t+1 - x_t|),
#: and the largest |d|
PLAIN = ("d2", "n_conf", "d_conf", "n_unconf", "d_unconf", "exp", "extreme", "half",
         "pairs", "pair_abs", "shift_next", "shift_prev")
FIELDS = ("n",) + tuple("s_" + s for s in SERIES) + tuple(f"m_{SERIES[i]}{SERIES[j]}" for i, j in PAIRS) + PLAIN + (
    "max",)
F = {name: i for i, name in enumerate(FIELDS)}

#: the thresholds the plain sums count against (log-probs): rollout p >= 1/2, p < 1/20, |d| > ln 2
CONFIDENT = math.log(0.5)
UNCONFIDENT = math.log(0.05)
EXTREME = math.log(2.0)
#: the normal float16 range (|y| in it, low 13 bits 0: a float16 value)
HALF_MIN, HALF_MAX = 2.0 ** -14, 65504.0


def step_ranges(rows: Rows, step_ids: torch.Tensor, n_steps: int) -> list[list[tuple[int, int]]]:
    """Each step's token ranges ``[start, end)``: the runs of consecutive rows of that step
    (one range a step in a packed batch, whose steps follow each other)."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(n_steps)]
    n = step_ids.numel()
    if n == 0:
        return out
    starts = torch.cat([step_ids.new_zeros(1), (step_ids[1:] != step_ids[:-1]).nonzero().squeeze(1) + 1])
    ends = torch.cat([starts[1:], step_ids.new_full((1,), n)])
    off = rows.offsets
    for s, a, b in zip(step_ids.index_select(0, starts).tolist(), off.index_select(0, starts).tolist(),
                       off.index_select(0, ends).tolist(), strict=True):
        if b > a:
            out[s].append((a, b))
    return out


def combine(rec: torch.Tensor, n_col: int, sums: slice, pairs: tuple[tuple[int, int], ...],
            moments: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's ``(n, sums, centred cross-products)`` from chunk records ``rec`` ``(chunks, k)``:
    ``n`` at column ``n_col``, the series' sums at ``sums``, the chunks' centred products of the
    series ``pairs`` at ``moments`` (Chan et al.'s pairwise update; a chunk without tokens adds
    nothing)."""
    n_c = rec[:, n_col]
    s_c = rec[:, sums]
    n = n_c.sum()
    s = s_c.sum(0)
    has = n_c > 0
    dev = torch.where(has[:, None], s_c / torch.where(has, n_c, 1.0)[:, None] - s / n, 0.0)
    i = torch.tensor([p[0] for p in pairs], device=rec.device)
    j = torch.tensor([p[1] for p in pairs], device=rec.device)
    m = rec[:, moments].sum(0) + (n_c[:, None] * dev.index_select(1, i) * dev.index_select(1, j)).sum(0)
    return n, s, m


def combine_raw(rec: torch.Tensor, n_col: int, sums: slice, pairs: tuple[tuple[int, int], ...],
                moments: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`combine` from records of plain sums of products: ``sum(a b) - sum(a) sum(b) / n``.
    Its rounding grows with ``mean^2 / variance`` of a series (the caller checks it: :func:`cancels`)."""
    n = rec[:, n_col].sum()
    s = rec[:, sums].sum(0)
    i = torch.tensor([p[0] for p in pairs], device=rec.device)
    j = torch.tensor([p[1] for p in pairs], device=rec.device)
    m = rec[:, moments].sum(0) - s.index_select(0, i) * s.index_select(0, j) / n
    return n, s, m


def cancels(n: float, s: list[float], m: list[float], pairs: tuple[tuple[int, int], ...], factor: float) -> bool:
    """Whether a variance of :func:`combine_raw` lost more than ``factor`` to cancellation: its
    series' ``n mean^2`` above ``factor`` times the variance's sum (a constant series, whose
    variance must be 0 exactly, always)."""
    for (i, j), v in zip(pairs, m, strict=True):
        if i == j and s[i] * s[i] / n > factor * v:
            return True
    return False


@dataclass
class Buffers:
    """The float64 arrays a chunk is computed in (reused by every chunk and step), the step's
    histogram of ``|d|`` and its ``|d|`` in float32 (``abs32``, -1 off the actor tokens: what
    ``rldiag.engine.mismatch`` reads back for the quantiles)."""

    size: int
    step_tokens: int
    device: torch.device
    v: torch.Tensor = field(init=False)  # (6, size + 1): x, y, d, |d|, position, |y|
    c: torch.Tensor = field(init=False)  # (6, size): the same, centred on the chunk's means
    t: torch.Tensor = field(init=False)  # (8, size + 1) scratch; t[3] the chunk's weights
    abs32: torch.Tensor = field(init=False)  # (step_tokens,) float32
    hist: torch.Tensor = field(init=False)  # (N_BUCKETS,) int64
    base: torch.Tensor = field(init=False)  # (size + 1,) float64 0, 1, 2, ...
    offsets: torch.Tensor = field(init=False)  # (rows + 1,) the layout's offsets in float64

    def __post_init__(self) -> None:
        f64, dev = torch.float64, self.device
        self.v = torch.empty(6, self.size + 1, dtype=f64, device=dev)
        self.c = torch.empty(6, self.size, dtype=f64, device=dev)
        self.t = torch.empty(8, self.size + 1, dtype=f64, device=dev)
        self.abs32 = torch.empty(self.step_tokens, dtype=torch.float32, device=dev)
        self.hist = torch.zeros(N_BUCKETS, dtype=torch.long, device=dev)
        self.base = torch.arange(self.size + 1, dtype=f64, device=dev)
        self.offsets = torch.zeros(0, dtype=f64, device=dev)


@dataclass(frozen=True)
class Inputs:
    """A packed batch's flat ``(tokens,)`` trainer and rollout log-probs and actor mask, and its
    layout."""

    old: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    rows: Rows


@dataclass
class Chunk:
    """One chunk's tokens ``[a, a + m)`` in ``buf.v``, with the next token of the same run when
    there is one (``me = m + 1``: the pair the chunk's last token starts), the row starts inside
    it (``starts``: offsets relative to ``a``), and the actor-token weights (``keep``, float64
    0/1 ``(me,)``; None when every token is one)."""

    a: int
    m: int
    me: int
    starts: torch.Tensor
    keep: torch.Tensor | None
    n: int


def _starts(inp: Inputs, a: int, me: int) -> torch.Tensor:
    """The row starts strictly inside ``(a, a + me)``, relative to ``a`` ``(k,)``."""
    rows = inp.rows
    lo, hi = rows.row_ids[a].item(), rows.row_ids[a + me - 1].item()
    return rows.offsets[lo + 1: hi + 1] - a


def load(inp: Inputs, buf: Buffers, a: int, m: int, me: int) -> Chunk:
    """Write the chunk's x, y, d, |d| and position to ``buf.v`` (0 off the actor tokens), and
    tell where its rows start and which tokens are actor tokens (mask > 0, both log-probs
    finite)."""
    x, y, d, a_, p = buf.v[:5, :me]
    x.copy_(inp.old[a: a + me])
    y.copy_(inp.rollout[a: a + me])
    torch.sub(x, y, out=d)
    finite = bool(torch.isfinite(d.sum()))  # a non-finite log-prob anywhere makes the sum so
    mk = inp.mask[a: a + me]
    keep = None
    n = m
    if not finite or not (bool(mk.all()) if mk.dtype == torch.bool else bool(mk.amin() > 0)):
        keep = buf.t[3, :me]
        torch.gt(mk, 0, out=keep)
        if finite:  # x * 0 = 0: weights zero the tokens off the mask
            for v in (x, y, d):
                v.mul_(keep)
        else:
            keep.mul_(torch.mul(d, 0.0).eq_(0.0))  # d * 0 is NaN where d is not finite
            buf.v[:3, :me].masked_fill_(keep == 0, 0.0)
        n = int(keep[:m].sum().item())
    torch.abs(d, out=a_)
    starts = _starts(inp, a, me)
    # positions: each token's index less its row's start (the offsets in float64, gathered by row)
    torch.sub(buf.base[:me], buf.offsets.index_select(0, inp.rows.row_ids[a: a + me]), out=p).add_(a)
    if keep is not None:
        p.mul_(keep)
    return Chunk(a, m, me, starts, keep, n)


def scan_chunk(inp: Inputs, buf: Buffers, ch: Chunk, at: int, nonpositive: bool, centred: bool) -> torch.Tensor:
    """The chunk's record (:data:`FIELDS`) ``(len(FIELDS),)`` float64; its ``|d|`` in float32
    goes to ``buf.abs32[at: at + m]`` and into the step's histogram.

    ``centred``: the ``m_*`` fields are the chunk's products centred on its own means (for
    :func:`combine`); else the plain sums of products (for :func:`combine_raw`: no centred copy
    of the series, one pass fewer per series). ``nonpositive``: no rollout log-prob of the batch
    is above 0, so that ``|y| = -y`` and its sums are ``y``'s negated (the same values: a sum of
    negated terms is the negated sum)."""
    m, me, keep = ch.m, ch.me, ch.keep
    x, y, d, a, _, ya = buf.v[:, :me]
    dm, ym, am = d[:m], y[:m], a[:m]
    if not nonpositive:
        torch.abs(ym, out=ya[:m])
    k = 5 if nonpositive else 6
    vm = buf.v[:k, :m]
    s = vm.sum(1)
    n = float(ch.n)
    km = None if keep is None else keep[:m]
    c = vm
    if centred:
        c = torch.sub(vm, (s / max(n, 1.0))[:, None], out=buf.c[:k, :m])
        if km is not None:
            c.mul_(km)
    out = [ddot(c[i], c[j]) for i, j in PAIRS[:5]]  # xy, xx, yy, dd, dy
    # |d|^2 = d^2: the plain sum is the same; centred, |d| is its own series
    out.append(ddot(c[3], c[3]) if centred else out[3])
    out += [ddot(c[3], c[4]), ddot(c[4], c[4])]  # a p, p p
    if nonpositive:
        s = torch.cat([s, -s[1:2]])
        out += [-ddot(c[3], c[1]), out[2]]  # a |y| = -(a y), |y| |y| = y y
    else:
        out += [ddot(c[3], c[5]), ddot(c[5], c[5]) if centred else out[2]]
    t = buf.t[0, :m]
    out.append(ddot(dm, dm))
    # y = 0 off the actor tokens: confident (with d = 0), so m - n of the count is theirs
    torch.ge(ym, CONFIDENT, out=t)
    out += [t.sum() - (m - n), ddot(dm, t)]
    torch.lt(ym, UNCONFIDENT, out=t)
    out += [t.sum(), ddot(dm, t)]
    out.append(dsum(torch.exp(am, out=t)) - (m - n))  # exp(0) = 1 off the actor tokens
    out.append(torch.gt(am, EXTREME, out=t).sum())
    out.append(half_count(inp.rollout[ch.a: ch.a + m], ym))
    out += pair_sums(x, y, a, ch, buf)
    out.append(am.max())
    # |d| in float32 for the quantiles: its bucket in the step's histogram
    a32 = buf.abs32[at: at + m]
    a32.copy_(am)
    buf.hist += torch.bincount(a32.view(torch.int32) >> HIST_SHIFT, minlength=N_BUCKETS)
    if km is not None:
        buf.hist[0] -= m - ch.n  # the tokens off the mask, at |d| = 0
        a32.sub_(torch.sub(1.0, km, out=t))  # -1 off the mask: below every bucket
    return torch.cat([torch.tensor([n], dtype=torch.float64, device=s.device), s, torch.stack(out)])


def half_count(rollout: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How many of the tokens' rollout log-probs are non-zero 16-bit floats: a bfloat16 (the
    float32's low 16 bits 0) or a normal float16 (low 13 bits 0, ``|y|`` in the normal range).
    ``rollout`` ``(m,)`` as stored, ``y`` ``(m,)`` float64, 0 off the actor tokens (so that they
    count in neither). Both kinds have the low 13 bits 0, which a float32 log-softmax's values
    almost never have: the few that do are gathered and tested."""
    bits = (rollout if rollout.dtype == torch.float32 else rollout.to(torch.float32)).view(torch.int32)
    low = (bits & 0x1FFF).eq_(0)  # 1 where the low 13 bits are 0 (in int32: cheaper than a bool array)
    if not bool(low.sum()):
        return y.new_zeros(())
    at = low.nonzero().squeeze(1)
    b, size = bits.index_select(0, at), y.index_select(0, at).abs()
    bf16 = ((b & 0xFFFF) == 0) & (size != 0)
    fp16 = (size >= HALF_MIN) & (size <= HALF_MAX)
    return (bf16 | fp16).sum().to(torch.float64)


def pair_sums(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, ch: Chunk, buf: Buffers) -> list[torch.Tensor]:
    """Over the pairs of adjacent actor tokens of a row starting in the chunk: their count, the
    sum of ``|d_t| + |d_t+1|``, of ``|y_t - x_t+1|`` and of ``|y_t+1 - x_t|``. Each pair by its
    first token; a pair across two rows counts 0 (its term set to 0 where every token is an
    actor token, its weight otherwise)."""
    k = ch.me - 1
    if k <= 0:
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        return [zero, zero, zero, zero]
    across = ch.starts - 1
    w = None
    if ch.keep is not None:
        w = torch.mul(ch.keep[:-1], ch.keep[1:], out=buf.t[1, :k]).index_fill_(0, across, 0.0)
    t = buf.t[2, :k]

    def total(v: torch.Tensor) -> torch.Tensor:
        return dsum(v.index_fill_(0, across, 0.0)) if w is None else ddot(w, v)

    out = [torch.tensor(float(k - across.unique().numel()), dtype=torch.float64, device=x.device) if w is None else w.sum(),
           total(torch.add(a[:-1], a[1:], out=t))]
    out.append(total(torch.sub(y[:-1], x[1:], out=t).abs_()))
    out.append(total(torch.sub(y[1:], x[:-1], out=t).abs_()))
    return out


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


#: a body chunk's record: the body's tokens (|d| at most the step's gap_abs_p95), their sums of
#: d, y, |d| and centred d d, d y, y y; with the lag, the same over the body's tokens of
#: on-policy (lag 0) rows (d, |d|, d d) and of lagged rows (d, d d), and the tokens and sum of
#: |d| of on-policy and lagged rows
BODY = ("n", "s_d", "s_y", "s_a", "m_dd", "m_dy", "m_yy")
LAG = ("on_n", "on_s_d", "on_s_a", "on_m_dd", "off_n", "off_s_d", "off_m_dd", "lag0_n", "lag0_s_a", "lagged_n",
       "lagged_s_a")


def _moments(w: torch.Tensor, n: torch.Tensor, series: list[torch.Tensor], out: torch.Tensor) -> list[torch.Tensor]:
    """Sums of each series weighted by ``w`` (0/1) and their centred products (every pair for
    two series, the square for one); ``out``: ``(len(series), m)`` scratch."""
    sums = [ddot(v, w) for v in series]
    inv = 1.0 / n.clamp_min(1.0)
    cen = [torch.sub(v, s * inv, out=o).mul_(w) for v, s, o in zip(series, sums, out, strict=False)]
    prods = [ddot(cen[0], cen[0])]
    if len(cen) == 2:
        prods += [ddot(cen[0], cen[1]), ddot(cen[1], cen[1])]
    return sums + prods


def body_chunk(inp: Inputs, buf: Buffers, ch: Chunk, p95: float, lag_rows: torch.Tensor | None,
               row_abs: torch.Tensor | None, row_n: torch.Tensor | None) -> torch.Tensor:
    """The chunk's body record (:data:`BODY`, then :data:`LAG` with ``lag_rows``), its tokens
    already in ``buf`` (:func:`load`); with the lag, each row's sum of |d| and actor tokens are
    added to ``row_abs`` / ``row_n`` ``(rows,)``."""
    m, km = ch.m, None if ch.keep is None else ch.keep[:ch.m]
    _, y, d, a, _, _ = buf.v[:, :m]
    wb = buf.t[4, :m]
    torch.le(a, p95, out=wb)
    if km is not None:
        wb.mul_(km)
    nb = wb.sum()
    sums = _moments(wb, nb, [d, y], buf.c[:, :m])
    out = [nb, sums[0], sums[1], ddot(a, wb), *sums[2:]]
    if lag_rows is not None and row_abs is not None and row_n is not None:
        rid = inp.rows.row_ids[ch.a: ch.a + m]
        on = buf.t[5, :m]
        torch.eq(lag_rows.index_select(0, rid), 0, out=on)
        if km is not None:
            on.mul_(km)
        off = buf.t[6, :m]
        won, wof = torch.mul(wb, on, out=buf.t[0, :m]), torch.sub(wb, on.mul(wb), out=buf.t[1, :m])
        n_on, n_of = won.sum(), wof.sum()
        on_m = _moments(won, n_on, [d], buf.c[:, :m])
        of_m = _moments(wof, n_of, [d], buf.c[:, :m])
        torch.sub(1.0, on, out=off) if km is None else torch.sub(km, on, out=off)
        out += [n_on, on_m[0], ddot(a, won), on_m[1], n_of, of_m[0], of_m[1],
                on.sum(), ddot(a, on), off.sum(), ddot(a, off)]
        row_abs.index_add_(0, rid, a)
        row_n.index_add_(0, rid, torch.ones_like(a) if km is None else km)
    return torch.stack(out)
