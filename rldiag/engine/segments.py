"""Segment reductions: sums, counts, means, extrema and variances keyed by an index.

All functions take a flat tensor ``x`` of shape ``(n,)``, an int64 index ``seg`` of shape
``(n,)`` with values in ``[0, num)``, and return ``(num,)``. No Python loop over segments.
"""

from __future__ import annotations

import weakref

import torch

#: verl adds this to denominators of masked means (verl.utils.torch_functional.masked_mean).
MEAN_EPS = 1e-8


def seg_sum(x: torch.Tensor, seg: torch.Tensor, num: int) -> torch.Tensor:
    """Sum of ``x`` per segment; empty segments give 0."""
    out = torch.zeros(num, dtype=x.dtype, device=x.device)
    return out.index_add_(0, seg, x)


def seg_count(seg: torch.Tensor, num: int, dtype=torch.float32) -> torch.Tensor:
    return torch.bincount(seg, minlength=num)[:num].to(dtype)


def seg_mean(x: torch.Tensor, seg: torch.Tensor, num: int) -> torch.Tensor:
    """Plain mean per segment (NaN for empty segments)."""
    return seg_sum(x, seg, num) / seg_count(seg, num, x.dtype)


def seg_std(x: torch.Tensor, seg: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, Bessel-corrected std, count) per segment, as ``torch.std`` of each group would give.

    Segments of one element get std NaN (as torch.std does); callers apply verl's rules.
    """
    cnt = seg_count(seg, num, x.dtype)
    mean = seg_sum(x, seg, num) / cnt
    dev = x - mean[seg]
    var = seg_sum(dev * dev, seg, num) / (cnt - 1)
    return mean, var.clamp_min(0).sqrt(), cnt


def seg_max(x: torch.Tensor, seg: torch.Tensor, num: int) -> torch.Tensor:
    """Max per segment; NaN for empty segments."""
    out = torch.full((num,), float("nan"), dtype=x.dtype, device=x.device)
    if x.numel():
        out.scatter_reduce_(0, seg, x, reduce="amax", include_self=False)
    return out


def seg_min(x: torch.Tensor, seg: torch.Tensor, num: int) -> torch.Tensor:
    """Min per segment; NaN for empty segments."""
    out = torch.full((num,), float("nan"), dtype=x.dtype, device=x.device)
    if x.numel():
        out.scatter_reduce_(0, seg, x, reduce="amin", include_self=False)
    return out


# ---- token tensors (rows, tokens) reduced per step -------------------------------------------
#
# A step's metrics reduce dozens of token tensors over the same few masks, so what depends on a
# mask alone (its per-row counts, its extrema offset) is computed once per mask tensor and
# remembered by identity and version (an in-place change of the mask is noticed).

_MEMO: dict[tuple[str, int], tuple] = {}


def _signature(key: tuple) -> tuple:
    """Tensors in a memo key stand for themselves at their current version (identity + version)."""
    return tuple((x, x._version) if isinstance(x, torch.Tensor) else x for x in key)


def _same_key(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        x is y or (isinstance(x, tuple) and isinstance(y, tuple) and len(x) == len(y) == 2
                   and x[0] is y[0] and x[1] == y[1])
        or (not isinstance(x, (torch.Tensor, tuple)) and x == y)
        for x, y in zip(a, b)
    )


def _memo(kind: str, t: torch.Tensor, key: tuple, fn):
    """``fn()`` remembered for tensor ``t`` and ``key`` (tensors in it compared by identity and
    version, like ``t`` itself). The entry goes when ``t`` is freed, so nothing it holds
    outlives the step."""
    slot = (kind, id(t))
    sig = _signature(key)
    hit = _MEMO.get(slot)
    if hit is not None and hit[0]() is t and hit[1] == t._version and _same_key(hit[2], sig):
        return hit[3]
    out = fn()

    def forget(ref, slot=slot):
        entry = _MEMO.get(slot)
        if entry is not None and entry[0] is ref:
            del _MEMO[slot]

    _MEMO[slot] = (weakref.ref(t, forget), t._version, sig, out)
    return out


def row_mask_count(mask: torch.Tensor) -> torch.Tensor:
    """Masked tokens per row ``(rows,)`` float32 (exact: counts below 2^24)."""
    return _memo("rows", mask, (), lambda: mask.sum(-1, dtype=torch.float32))


def masked_sum_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row masked sum ``(rows,)``; NaN outside the mask cannot leak in (as verl's masked_sum).

    The fast path multiplies by the 0/1 mask (one fused pass on the CPU, several times faster than
    a ``where``); only when that yields a non-finite row sum is it redone with ``where``, which
    keeps a NaN or inf outside the mask out and one inside the mask in. Remembered per (values,
    mask) pair: a step's metrics ask for the same sums more than once (means, extrema,
    variances and signals of the same advantages).
    """
    return _memo("msum", values, (mask,), lambda: _masked_sum_rows(values, mask))


def _masked_sum_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask if mask.dtype == values.dtype else mask.to(values.dtype)
    out = (values * m).sum(-1)
    if not bool(torch.isfinite(out).all()):
        out = torch.where(mask.bool(), values, 0.0).sum(-1)
    return out


def masked_square_sum_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row ``sum(mask * values^2)`` ``(rows,)``, with :func:`masked_sum_rows`' NaN rule."""
    m = mask if mask.dtype == values.dtype else mask.to(values.dtype)
    out = torch.linalg.vecdot(values * m, values)
    if not bool(torch.isfinite(out).all()):
        out = torch.where(mask.bool(), values.square(), 0.0).sum(-1)
    return out


def masked_count_rows(cond: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row count of masked positions where the bool ``cond`` holds, float32 ``(rows,)``."""
    mb = mask if mask.dtype == torch.bool else _memo("bool", mask, (), lambda: mask > 0)
    return torch.count_nonzero(cond & mb, dim=-1).to(torch.float32)


def masked_positive_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row count of masked positions where ``x > 0``, float32 ``(rows,)``.

    ``a > b`` is counted as ``a - b > 0`` (exact for finite floats: the difference of two
    distinct floats is never 0 with gradual underflow). Counted in float arithmetic, as
    ``max(sign(x), 0)`` against the 0/1 mask, because comparisons into bool tensors and their
    sums are several times slower on the CPU; a NaN (``inf - inf``) falls back to the comparison.
    """
    m = mask if mask.dtype == x.dtype else mask.to(x.dtype)
    out = torch.linalg.vecdot(torch.sign(x).clamp_(min=0.0), m)
    if not bool(torch.isfinite(out).all()):
        out = masked_count_rows(x > 0, mask).to(x.dtype)
    return out


_BIG = 3.0e38  # pushes masked-out positions out of max/min without a `where` pass


def _masked_row_extrema(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (max, min) over the mask ``(rows,)`` each; rows without a masked token give
    about -3e38 / +3e38 (callers drop them).

    Masked-out positions are shifted by -/+3e38, which takes them out of the max/min only when
    no value is within a quarter of that: otherwise (or with a non-finite value) a `where`."""
    if values.numel() and max(abs(float(values.amax())), abs(float(values.amin()))) < _BIG / 4:
        off = _memo("offset", mask, (values.dtype,), lambda: (1.0 - mask.to(values.dtype)) * _BIG)
        return torch.sub(values, off).amax(-1), torch.add(values, off).amin(-1)
    mb = mask.bool()
    return torch.where(mb, values, float("-inf")).amax(-1), torch.where(mb, values, float("inf")).amin(-1)


def step_masked_sum(values: torch.Tensor, mask: torch.Tensor, step_ids: torch.Tensor, n_steps: int) -> torch.Tensor:
    return seg_sum(masked_sum_rows(values, mask), step_ids, n_steps)


def step_mask_count(mask: torch.Tensor, step_ids: torch.Tensor, n_steps: int) -> torch.Tensor:
    """Masked tokens per step ``(n_steps,)``, remembered per mask (every masked mean of a step
    asks for it again)."""
    return _memo("steps", mask, (step_ids, n_steps), lambda: seg_sum(row_mask_count(mask), step_ids, n_steps))


def step_masked_mean(values: torch.Tensor, mask: torch.Tensor, step_ids: torch.Tensor, n_steps: int) -> torch.Tensor:
    """verl's ``masked_mean`` over each step's tokens: ``sum / (count + 1e-8)``."""
    return step_masked_sum(values, mask, step_ids, n_steps) / (step_mask_count(mask, step_ids, n_steps) + MEAN_EPS)


def step_masked_extrema(
    values: torch.Tensor, mask: torch.Tensor, step_ids: torch.Tensor, n_steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, max, min) of the masked tokens of each step, as ``torch.masked_select`` then
    mean/max/min would give (no epsilon; NaN for a step without tokens).

    Reduced per row first (no boolean gather of the whole tensor), then per step.
    """
    count = row_mask_count(mask)
    total = seg_sum(masked_sum_rows(values, mask), step_ids, n_steps)
    mean = total / seg_sum(count.to(values.dtype), step_ids, n_steps)
    has = count > 0
    row_max, row_min = _masked_row_extrema(values, mask)
    row_max, row_min = row_max[has], row_min[has]
    sid = step_ids[has]
    return mean, seg_max(row_max, sid, n_steps), seg_min(row_min, sid, n_steps)


def step_masked_var(values: torch.Tensor, mask: torch.Tensor, step_ids: torch.Tensor, n_steps: int) -> torch.Tensor:
    """Unbiased variance of each step's masked tokens (``torch.var`` of the masked selection):
    two passes, the second over the deviations from each step's mean."""
    n = seg_sum(row_mask_count(mask).to(values.dtype), step_ids, n_steps)
    mean = seg_sum(masked_sum_rows(values, mask), step_ids, n_steps) / n
    dev = values - mean[step_ids].unsqueeze(-1)
    return seg_sum(masked_square_sum_rows(dev, mask), step_ids, n_steps) / (n - 1)
