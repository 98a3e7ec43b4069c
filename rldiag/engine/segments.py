"""Segment reductions: sums, counts, means, extrema and variances keyed by an index.

Two kinds of function, by what they take (no Python loop over segments in any):

- ``seg_*``: a flat tensor ``x`` of shape ``(n,)`` (tokens, rows or anything else), an int64
  index ``seg`` of shape ``(n,)`` with values in ``[0, num)``; they return ``(num,)``.
- ``step_*``: flat token tensors ``(tokens,)``, their layout, and each row's step (or micro-batch
  segment) ``step_ids`` ``(rows,)`` in ``[0, n_steps)``; they reduce per row first, then per
  step, and return ``(n_steps,)``.

The per-row reductions of token tensors are methods of :class:`rldiag.engine.layout.Rows`
(``rows.sum``, ``rows.masked_sum(values, mask)``, ``rows.mask_count(mask)``, ...).
"""

from __future__ import annotations

import torch

from rldiag.engine.layout import Rows

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


# ---- token tensors (tokens,) reduced per row, then per step ---------------------------------


def step_masked_sum(values: torch.Tensor, mask: torch.Tensor, rows: Rows, step_ids: torch.Tensor,
                    n_steps: int) -> torch.Tensor:
    return seg_sum(rows.masked_sum(values, mask), step_ids, n_steps)


def step_mask_count(mask: torch.Tensor, rows: Rows, step_ids: torch.Tensor, n_steps: int) -> torch.Tensor:
    """Masked tokens per step ``(n_steps,)``."""
    return seg_sum(rows.mask_count(mask), step_ids, n_steps)


def step_masked_mean(values: torch.Tensor, mask: torch.Tensor, rows: Rows, step_ids: torch.Tensor,
                     n_steps: int) -> torch.Tensor:
    """verl's ``masked_mean`` over each step's tokens: ``sum / (count + 1e-8)``."""
    return step_masked_sum(values, mask, rows, step_ids, n_steps) / (
        step_mask_count(mask, rows, step_ids, n_steps) + MEAN_EPS
    )


def step_masked_extrema(
    values: torch.Tensor, mask: torch.Tensor, rows: Rows, step_ids: torch.Tensor, n_steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, max, min) of the masked tokens of each step, as ``torch.masked_select`` then
    mean/max/min would give (no epsilon; NaN for a step without tokens).

    Reduced per row first (no boolean gather of the whole tensor), then per step.
    """
    count = rows.mask_count(mask)
    total = seg_sum(rows.masked_sum(values, mask), step_ids, n_steps)
    mean = total / seg_sum(count.to(values.dtype), step_ids, n_steps)
    has = count > 0
    row_max, row_min = rows.masked_extrema(values, mask)
    row_max, row_min = row_max[has], row_min[has]
    sid = step_ids[has]
    return mean, seg_max(row_max, sid, n_steps), seg_min(row_min, sid, n_steps)


def step_masked_var(values: torch.Tensor, mask: torch.Tensor, rows: Rows, step_ids: torch.Tensor,
                    n_steps: int) -> torch.Tensor:
    """Unbiased variance of each step's masked tokens (``torch.var`` of the masked selection):
    two passes, the second over the deviations from each step's mean."""
    n = seg_sum(rows.mask_count(mask).to(values.dtype), step_ids, n_steps)
    mean = seg_sum(rows.masked_sum(values, mask), step_ids, n_steps) / n
    dev = values - rows.expand(mean[step_ids])
    return seg_sum(rows.masked_square_sum(dev, mask), step_ids, n_steps) / (n - 1)


def step_token_bounds(rows: Rows, step_ids: torch.Tensor, n_steps: int) -> list[int] | None:
    """The ``n_steps + 1`` token offsets of each step's tokens, for rows in step order (a packed
    batch's: ``step_ids`` ``(rows,)`` non-decreasing), so that a step's tokens are one slice;
    None where the rows are not in step order."""
    if step_ids.numel() > 1 and not bool((step_ids[1:] >= step_ids[:-1]).all()):
        return None
    row_bounds = torch.zeros(n_steps + 1, dtype=torch.long, device=step_ids.device)
    torch.cumsum(torch.bincount(step_ids, minlength=n_steps)[:n_steps], 0, out=row_bounds[1:])
    return rows.offsets.index_select(0, row_bounds).tolist()
