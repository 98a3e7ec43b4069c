"""verl's ``masked_whiten``, once per step of a packed batch.

verl (``verl.utils.torch_functional``): ``mean = sum(v*m) / (sum(m) + 1e-8)``;
``var = sum((v-mean)^2 * m) / (sum(m) + 1e-8) * n / (n - 1)`` (Bessel, n = sum(m));
``whitened = (v - mean) * rsqrt(var + 1e-8)`` — the epsilon sits inside the square root.
verl raises ``ValueError`` when n is 0 or 1; here such a step is flagged as failed.
"""

from __future__ import annotations

import torch

from rldiag.engine.layout import Rows
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
) -> torch.Tensor:
    """Whiten ``values`` ``(tokens,)`` over the masked tokens of each step (``step_ids``: the
    step of each row of ``rows``).

    Returns ``(tokens,)``; positions outside the mask are shifted and scaled too (as in
    verl), callers multiply by the mask where verl does.
    """
    n = step_mask_count(mask, rows, step_ids, n_steps)
    mean = step_masked_sum(values, mask, rows, step_ids, n_steps) / (n + MEAN_EPS)
    centered = values - rows.expand(mean[step_ids])
    var = seg_sum(rows.masked_square_sum(centered, mask), step_ids, n_steps) / (n + MEAN_EPS)
    bad = n <= 1
    if errors is not None and bool(bad.any()):
        errors.flag(
            n == 0,
            f"{what}: the step has no token with response_mask 1 (verl's masked_var raises ValueError)",
        )
        errors.flag(
            n == 1,
            f"{what}: the step has a single token with response_mask 1; its Bessel-corrected variance "
            "divides by zero (verl's masked_var raises ValueError)",
        )
    var = var * n / (n - 1).clamp_min(1)
    return centered.mul_(rows.expand(torch.rsqrt(var + WHITEN_EPS)[step_ids]))
