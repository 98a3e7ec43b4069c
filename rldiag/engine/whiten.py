"""verl's ``masked_whiten``, once per step of a packed batch (verl's float32 reductions, or its
statistics in float64 for the estimators without a verl reference).

verl (``verl.utils.torch_functional``): ``mean = sum(v*m) / (sum(m) + 1e-8)``;
``var = sum((v-mean)^2 * m) / (sum(m) + 1e-8) * n / (n - 1)`` (Bessel, n = sum(m));
``whitened = (v - mean) * rsqrt(var + 1e-8)`` — the epsilon sits inside the square root.
verl raises ``ValueError`` when n is 0 or 1; here such a step is flagged as failed.
"""

from __future__ import annotations

import torch

from rldiag.engine.layout import Rows
from rldiag.engine.precise import mean_pair, row_sums64
from rldiag.engine.segments import (
    MEAN_EPS,
    seg_sum,
    step_mask_count,
    step_masked_sum,
)
from rldiag.engine.step_failures import StepErrors

WHITEN_EPS = 1e-8


def step_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    rows: Rows,
    step_ids: torch.Tensor,
    n_steps: int,
    errors: StepErrors | None = None,
    what: str = "whitening",
    stats64: bool = False,
) -> torch.Tensor:
    """Whiten ``values`` ``(tokens,)`` over the masked tokens of each step (``step_ids``: the
    step of each row of ``rows``).

    Returns ``(tokens,)``; positions outside the mask are shifted and scaled too (as in
    verl), callers multiply by the mask where verl does. ``stats64``: the mean and variance
    accumulated in float64 (:func:`whiten64`), for estimators without a verl reference.
    """
    if stats64:
        return whiten64(values, mask, rows, step_ids, n_steps, errors, what)
    n = step_mask_count(mask, rows, step_ids, n_steps)
    mean = step_masked_sum(values, mask, rows, step_ids, n_steps) / (n + MEAN_EPS)
    centered = values - rows.expand(mean[step_ids])
    var = seg_sum(rows.masked_square_sum(centered, mask), step_ids, n_steps) / (n + MEAN_EPS)
    flag_too_few(errors, n, what)
    var = var * n / (n - 1).clamp_min(1)
    return centered.mul_(rows.expand(torch.rsqrt(var + WHITEN_EPS)[step_ids]))


def flag_too_few(errors: StepErrors | None, n: torch.Tensor, what: str) -> None:
    """Fail each step whose masked-token count ``n`` ``(n_steps,)`` is 0 or 1 (verl's
    ``masked_var`` raises ``ValueError`` there)."""
    if errors is None or not bool((n <= 1).any()):
        return
    errors.flag(
        n == 0,
        f"{what}: the step has no token with response_mask 1 (verl's masked_var raises ValueError)",
    )
    errors.flag(
        n == 1,
        f"{what}: the step has a single token with response_mask 1; its Bessel-corrected variance "
        "divides by zero (verl's masked_var raises ValueError)",
    )


def whiten64(values: torch.Tensor, mask: torch.Tensor, rows: Rows, step_ids: torch.Tensor, n_steps: int,
             errors: StepErrors | None, what: str) -> torch.Tensor:
    """:func:`step_whiten` with its statistics in float64 (:mod:`rldiag.engine.precise`).

    ``mean = sum(v m) / n``, ``var = sum((v - mean)^2 m) / (n - 1)``, ``(v - mean) * rsqrt(var +
    1e-8)``: verl's ``+ 1e-8`` on the count vanishes in float32 for any count of 1 or more and is
    left out, so the mean of an exactly tied step is its value and the step whitens to 0. The
    deviations are ``(v - hi) - lo`` with the mean as the float32 pair ``hi + lo``.
    """
    keep = mask > 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    n = seg_sum(row_sums64(keep.to(values.dtype), rows), step_ids, n_steps)
    total = seg_sum(row_sums64(torch.where(keep, values, zero), rows), step_ids, n_steps)
    hi, lo = mean_pair(total / n.clamp_min(1), values.dtype)
    dev = (values - rows.expand(hi[step_ids])).sub_(rows.expand(lo[step_ids]))
    square = seg_sum(row_sums64(torch.where(keep, dev * dev, zero), rows), step_ids, n_steps)
    flag_too_few(errors, n, what)
    scale = torch.rsqrt(square / (n - 1).clamp_min(1) + WHITEN_EPS).to(values.dtype)
    return dev.mul_(rows.expand(scale[step_ids]))
