"""The mismatch body's second pass (:mod:`rldiag.engine.mismatch`): where the body's moments
cannot be the step's less its outliers' (they would cancel) and, with ``policy_version``, always
(the on- / off-policy split and each row's mean ``|d|``), a step's chunks are read again
(:func:`rldiag.engine.mismatch_scan.load`) and each reduces to one record (:data:`BODY`, then
:data:`LAG`), its moments centred on the chunk's own means (for
:func:`rldiag.engine.mismatch_sums.combine`)."""

from __future__ import annotations

import numpy as np

from rldiag.engine.mismatch_scan import A, Buffers, Chunk, D, T, U, W, X, Y
from rldiag.engine.mismatch_sums import bdot

#: a body chunk's record: the body's tokens (|d| at most the step's gap_abs_p95), their sums of
#: d, y, |d| and centred d d, d y, y y; with the lag, the same over the body's tokens of
#: on-policy (lag 0) rows (d, |d|, d d) and of lagged rows (d, d d), and the tokens and sum of
#: |d| of on-policy and lagged rows
BODY = ("n", "s_d", "s_y", "s_a", "m_dd", "m_dy", "m_yy")
LAG = ("on_n", "on_s_d", "on_s_a", "on_m_dd", "off_n", "off_s_d", "off_m_dd", "lag0_n", "lag0_s_a", "lagged_n",
       "lagged_s_a")


def weighted_moments(w: np.ndarray, series: list[np.ndarray], out: np.ndarray) -> list[float]:
    """The count of ``w`` (0/1), the sums of each series weighted by it and their centred
    products (every pair for two series, the square for one); ``out``: ``(len(series), m)``
    scratch."""
    n = float(w.sum())
    sums = [bdot(s, w) for s in series]
    inv = 1.0 / max(n, 1.0)
    cen = [np.multiply(np.subtract(s, t * inv, out=o), w, out=o) for s, t, o in zip(series, sums, out, strict=False)]
    prods = [bdot(cen[0], cen[0])]
    if len(cen) == 2:
        prods += [bdot(cen[0], cen[1]), bdot(cen[1], cen[1])]
    return [n] + sums + prods


def body_chunk(buf: Buffers, ch: Chunk, p95: float, lag_rows: np.ndarray | None, row_abs: np.ndarray | None,
               row_n: np.ndarray | None) -> np.ndarray:
    """The chunk's body record (:data:`BODY`, then :data:`LAG` with ``lag_rows`` ``(rows,)``),
    its tokens already in ``buf`` (:func:`load`); with the lag, each row's sum of |d| and actor
    tokens are added to ``row_abs`` / ``row_n`` ``(rows,)``."""
    m, v = ch.m, buf.v
    y, d, a = v[Y, :m], v[D, :m], v[A, :m]
    off = ch.off[ch.off < m]
    scratch = np.empty((2, m), dtype=np.float64)
    wb = v[T, :m]
    np.copyto(wb, np.less_equal(a, p95, out=buf.cmp[:m]))
    wb[off] = 0.0
    nb, s_d, s_y, m_dd, m_dy, m_yy = weighted_moments(wb, [d, y], scratch)
    out = [nb, s_d, s_y, bdot(a, wb), m_dd, m_dy, m_yy]
    if lag_rows is not None and row_abs is not None and row_n is not None:
        rows = np.arange(ch.first, ch.first + ch.seg.shape[0])
        counts = np.diff(np.concatenate([ch.seg, [m]]))
        on, lagged = v[U, :m], v[X, :m]  # the body pass reads no x
        np.copyto(on, np.repeat(lag_rows[rows] == 0, counts))
        np.subtract(1.0, on, out=lagged)
        on[off] = 0.0
        lagged[off] = 0.0
        won = np.multiply(wb, on, out=v[W, :m])
        on_m = weighted_moments(won, [d], scratch)
        of_m = weighted_moments(np.subtract(wb, won, out=scratch[1]), [d], scratch)
        out += [on_m[0], on_m[1], bdot(a, won), on_m[2], of_m[0], of_m[1], of_m[2],
                float(on.sum()), bdot(a, on), float(lagged.sum()), bdot(a, lagged)]
        row_abs[rows] += np.add.reduceat(a, ch.seg)
        row_n[rows] += counts - np.bincount(np.searchsorted(ch.seg, off, side="right") - 1, minlength=rows.shape[0])
    return np.array(out, dtype=np.float64)
