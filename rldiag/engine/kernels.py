"""Faster forms of a few plain formulas, each named for what it computes.

The registered functions of the engine read as verl's formulas; where a plain form costs extra
passes over the tokens on the CPU (a ``where`` on a bool mask, a comparison into a bool tensor, a
``where`` on the sign of the advantage), the engine calls one of these instead: the masked
per-row reductions through :class:`~rldiag.engine.layout.Rows` (``rows.masked_sum`` ->
:func:`masked_row_sums`, ...), the others directly. Each kernel but
:func:`dual_clip` has its plain form next to it (``*_plain``, its fallback on non-finite values;
dual_clip's, used by no code path, is in the test), and tests/engine/test_kernels.py pins the two
together (equal values, NaN / inf and signed zeros included) on random inputs.

Token tensors are flat ``(tokens,)`` with a :class:`rldiag.engine.layout.Rows` layout.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from rldiag.engine import host


class Rows(Protocol):
    """The per-row reductions the kernels build on: :class:`rldiag.engine.layout.Rows` (which
    calls these kernels, so they name its shape here rather than import it)."""

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``(tokens,) -> (rows,)`` sum over each row's tokens."""

    def count(self, cond: torch.Tensor) -> torch.Tensor:
        """Tokens per row where ``cond`` is true, float32 ``(rows,)``."""

    def amax(self, x: torch.Tensor, empty: float = ...) -> torch.Tensor:
        """Max over each row's tokens ``(rows,)``."""

    def amin(self, x: torch.Tensor, empty: float = ...) -> torch.Tensor:
        """Min over each row's tokens ``(rows,)``."""


def _as(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return mask if mask.dtype == dtype else mask.to(dtype)


# ---- masked per-row sums ----------------------------------------------------------------------


def masked_row_sums(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``sum_t mask_t values_t`` per row ``(rows,)``, a NaN or inf outside the mask kept out (as
    verl's ``masked_sum``: a ``where``). Multiplies by the 0/1 mask (one fused pass); only when
    a row sum comes out non-finite is it redone as the plain form."""
    return masked_row_sums_of(values * _as(mask, values.dtype), values, mask, rows)


def masked_row_sums_of(products: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """:func:`masked_row_sums` from its products ``values * mask`` ``(tokens,)``, made already (in a
    compiled read that had the tokens at hand): the same row sums, the same rule for a non-finite
    one."""
    out = rows.sum(products)
    if not host.all_finite(out):
        out = masked_row_sums_plain(values, mask, rows)
    return out


def masked_row_sums_plain(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    return rows.sum(torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)))


def masked_row_square_sums(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``sum_t mask_t values_t^2`` per row ``(rows,)``, with :func:`masked_row_sums`' rule."""
    out = rows.sum(values * values * _as(mask, values.dtype))
    if not host.all_finite(out):
        out = masked_row_square_sums_plain(values, mask, rows)
    return out


def masked_row_square_sums_plain(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    return rows.sum(torch.where(mask.bool(), values.square(), torch.zeros((), dtype=values.dtype, device=values.device)))


# ---- masked counts of a comparison ------------------------------------------------------------


def count_positive_masked(x: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Per row, the masked tokens where ``x > 0`` ``(rows,)`` float32, counted as
    ``max(sign(x), 0)`` against the 0/1 mask (float arithmetic: no bool tensor); a NaN in ``x``
    falls back to the plain comparison. On the host, the plain form's 0/1 products by numpy
    (:func:`rldiag.engine.host.greater_on`): the same counts, cheaper there."""
    if host.view(x) is not None and host.view(mask) is not None and x.shape == mask.shape:
        return rows.sum(host.greater_on(x, torch.zeros((), dtype=x.dtype, device=x.device), mask))  # 0/1 by numpy: exact counts
    out = rows.sum(torch.sign(x).clamp_(min=0.0).mul_(_as(mask, x.dtype)))
    if not host.all_finite(out):
        out = count_positive_masked_plain(x, mask, rows)
    return out.to(torch.float32)


def count_positive_masked_plain(x: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    return rows.count((x > 0) & (mask > 0))


def count_greater_masked(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Per row, the masked tokens where ``a > b`` ``(rows,)`` float32, counted as ``a - b > 0``:
    exact for floats (the difference of two distinct floats is never 0 with gradual underflow;
    ``inf - inf`` is NaN, which takes the plain comparison). On the host, the plain form's 0/1
    products by numpy (:func:`rldiag.engine.host.greater_on`): the same counts, cheaper there."""
    if host.view(a) is not None and host.view(b) is not None and host.view(mask) is not None and \
            a.shape == b.shape == mask.shape:
        return rows.sum(host.greater_on(a, b, mask))  # the comparison's 0/1 by numpy: exact counts
    d = a - b
    out = rows.sum(torch.sign(d).clamp_(min=0.0).mul_(_as(mask, d.dtype)))
    if not host.all_finite(out):
        out = count_greater_masked_plain(a, b, mask, rows)
    return out.to(torch.float32)


def count_greater_masked_plain(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    return rows.count((a > b) & (mask > 0))


# ---- masked per-row extrema -------------------------------------------------------------------

_BIG = 3.0e38  # pushes masked-out tokens out of a max / min without a `where`


def _shift_is_exact(values: torch.Tensor) -> bool:
    """Every value finite and within a quarter of the shift (one pass: ``aminmax``; NaN fails)."""
    if not values.numel():
        return False
    lo, hi = torch.aminmax(values)
    return max(abs(float(lo)), abs(float(hi))) < _BIG / 4


def masked_row_extrema(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (max, min) over the masked tokens ``(rows,)`` each; a row without a masked token
    gives ``-inf`` / ``+inf`` or about ``-3e38`` / ``+3e38`` (callers drop such rows).

    Masked-out tokens are shifted by -/+3e38, which takes them out of the max / min when every
    value is within a quarter of that; otherwise (or with a non-finite value) the plain form."""
    if _shift_is_exact(values):
        off = (1.0 - _as(mask, values.dtype)) * _BIG
        return rows.amax(values - off), rows.amin(values + off)
    return masked_row_extrema_plain(values, mask, rows)


def masked_row_max(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The max of :func:`masked_row_extrema` alone ``(rows,)``. On the host, the plain form with
    its ``where`` made by numpy (one pass, no check of the values; a row without a masked token
    gives ``-inf``)."""
    v, m = host.view(values), host.view(mask)
    if v is not None and m is not None and v.shape == m.shape:
        return rows.amax(torch.from_numpy(np.where(m != 0, v, v.dtype.type(-np.inf))))
    if _shift_is_exact(values):
        return rows.amax(values - (1.0 - _as(mask, values.dtype)) * _BIG)
    return masked_row_max_plain(values, mask, rows)


def masked_row_max_plain(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    return rows.amax(torch.where(mask.bool(), values, float("-inf")))


def masked_row_extrema_plain(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    mb = mask.bool()
    return rows.amax(torch.where(mb, values, float("-inf"))), rows.amin(torch.where(mb, values, float("inf")))


# ---- PPO's dual clip ------------------------------------------------------------------------


def dual_clip(adv: torch.Tensor, clipped1: torch.Tensor, l3: torch.Tensor) -> torch.Tensor:
    """verl's dual clip ``where(A < 0, min(clipped1, l3), clipped1)`` with ``l3 = |A| c`` and
    ``clipped1 = max(-A r, -A clip(r))`` (``r > 0``), without the ``where`` on the sign of A:
    where ``A >= 0``, ``clipped1 <= 0 <= l3``, so the minimum is clipped1 already; at ``A = +0``
    the two are zeros of opposite sign and ``copysign`` restores clipped1's sign."""
    return torch.minimum(clipped1, l3).copysign_(clipped1)
