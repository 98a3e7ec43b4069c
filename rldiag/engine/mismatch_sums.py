"""The reductions of the mismatch pass (:mod:`rldiag.engine.mismatch_scan`) and the algebra that
combines its chunks' records into a step's moments.

:func:`bdot`, a sum of products: the arrays cut into blocks of :data:`BLOCK` values, one BLAS dot
per block through ``np.matmul`` (no product array written), the blocks' dots summed pairwise. A
dot of at most 10,000 values runs on one thread in OpenBLAS (numpy's wheels; it splits a longer
one by its thread count), and torch's thread count does not reach numpy: no sum depends on a
thread count.

:func:`combine` / :func:`combine_raw`: a step's centred moments from its chunks' records, by the
pairwise update of Chan, Golub and LeVeque ("Algorithms for computing the sample variance",
1983) from centred chunk products, or from plain sums of products (``sum(a b) - sum(a) sum(b) /
n``), whose cancellation :func:`cancels` bounds.
"""

from __future__ import annotations

import numpy as np

#: a sum of products is taken in blocks of this many values, one BLAS dot each (one thread:
#: OpenBLAS splits a dot across its threads above 10,000 values), then the blocks' dots
BLOCK = 8192


def bdot(u: np.ndarray, v: np.ndarray) -> float:
    """``sum(u * v)`` of two 1-D float64 arrays of one length, the same bits whatever the
    thread counts: one BLAS dot per block of :data:`BLOCK` values (no product array), the
    blocks' dots summed pairwise, then the rest's dot."""
    n = u.shape[0]
    k = n - n % BLOCK
    total = 0.0
    if k:
        total = float(np.matmul(u[:k].reshape(-1, 1, BLOCK), v[:k].reshape(-1, BLOCK, 1)).sum())
    if k < n:
        total += float(np.dot(u[k:], v[k:]))
    return total


def combine(rec: np.ndarray, n_col: int, sums: slice, pairs: tuple[tuple[int, int], ...],
            moments: slice) -> tuple[float, np.ndarray, np.ndarray]:
    """The step's ``(n, sums, centred cross-products)`` from chunk records ``rec`` ``(chunks, k)``:
    ``n`` at column ``n_col``, the series' sums at ``sums``, the chunks' centred products of the
    series ``pairs`` at ``moments`` (Chan et al.'s pairwise update; a chunk without tokens adds
    nothing)."""
    n_c = rec[:, n_col]
    s_c = rec[:, sums]
    n = float(n_c.sum())
    s = s_c.sum(0)
    has = n_c > 0
    dev = np.where(has[:, None], s_c / np.where(has, n_c, 1.0)[:, None] - s / n, 0.0)
    i = [p[0] for p in pairs]
    j = [p[1] for p in pairs]
    m = rec[:, moments].sum(0) + (n_c[:, None] * dev[:, i] * dev[:, j]).sum(0)
    return n, s, m


def combine_raw(rec: np.ndarray, n_col: int, sums: slice, pairs: tuple[tuple[int, int], ...],
                moments: slice) -> tuple[float, np.ndarray, np.ndarray]:
    """As :func:`combine` from records of plain sums of products: ``sum(a b) - sum(a) sum(b) / n``.
    Its rounding grows with ``mean^2 / variance`` of a series (the caller checks it: :func:`cancels`)."""
    n = float(rec[:, n_col].sum())
    s = rec[:, sums].sum(0)
    i = [p[0] for p in pairs]
    j = [p[1] for p in pairs]
    m = rec[:, moments].sum(0) - s[i] * s[j] / n
    return n, s, m


def cancels(n: float, s: list[float], m: list[float], pairs: tuple[tuple[int, int], ...], factor: float) -> bool:
    """Whether a variance of :func:`combine_raw` lost more than ``factor`` to cancellation: its
    series' ``n mean^2`` above ``factor`` times the variance's sum (a constant series, whose
    variance must be 0 exactly, always)."""
    for (i, j), v in zip(pairs, m, strict=True):
        if i == j and s[i] * s[i] / n > factor * v:
            return True
    return False
