"""``loss_agg_mode``: how a ``(tokens,)`` token loss becomes one number per step.

Semantics of verl's ``agg_loss`` (``verl/trainer/ppo/core_algos.py``) with data-parallel
size 1 and each step taken as one global batch:

- ``token-mean``: ``sum(m * l) / N``, N = ``batch_num_tokens`` (the loss-mask token count of the
  step; with rollout rejection the *original* mask, so rejected tokens still count) or, when not
  given, ``sum(m)``.
- ``token-sum``: ``sum(m * l)``.
- ``seq-mean-token-sum``: ``sum_i q_i sum_t m l / B``; q_i = row has a masked token.
- ``seq-mean-token-sum-norm``: the same divided by ``loss_scale_factor`` (None: the step's
  response horizon, as verl's fallback to the padded width).
- ``seq-mean-token-mean``: ``sum_i q_i (sum_t m l) / (T_i + 1e-8) / B``.

B is ``global_batch_size`` (rows of the step in the actor path) or, when not given, the number of
rows with a masked token (verl's fallback, used by the critic path).

Every mode is linear in the token losses: :func:`token_weights` gives each token's weight ``w_t``,
``aggregate(mode, l, m, norm)[s] = sum_{t in s} w_t l_t`` (a token's share of the aggregate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rldiag.engine.layout import Rows
from rldiag.engine.segments import seg_sum
from rldiag.registry import Registry


@dataclass(frozen=True)
class AggNorm:
    """Normalisers of one packed batch, each ``(n_seg,)`` or ``None`` for verl's fallback.

    ``rows``: the layout of the token tensors; ``seg_ids`` ``(rows,)``: each row's segment (a step,
    or one emulated micro-batch of one DP rank of a step) in ``[0, n_seg)``."""

    seg_ids: torch.Tensor
    n_seg: int
    horizon: torch.Tensor
    rows: Rows
    batch_num_tokens: torch.Tensor | None = None
    global_batch_size: torch.Tensor | None = None
    loss_scale_factor: float | None = None


AggFn = Callable[[torch.Tensor, torch.Tensor, AggNorm], torch.Tensor]
AGG_MODES: Registry[AggFn] = Registry("loss_agg_mode")


def _row_sums(loss: torch.Tensor, mask: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    return norm.rows.masked_sum(loss, mask)


def _seq_denominator(mask: torch.Tensor, norm: AggNorm) -> tuple[torch.Tensor, torch.Tensor]:
    q = (norm.rows.sum(mask) > 0).to(torch.float32)
    if norm.global_batch_size is not None:
        return q, norm.global_batch_size.to(torch.float32)
    return q, seg_sum(q, norm.seg_ids, norm.n_seg)


@AGG_MODES.register("token-mean")
def agg_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    total = seg_sum(_row_sums(loss, mask, norm), norm.seg_ids, norm.n_seg)
    if norm.batch_num_tokens is not None:
        denom = norm.batch_num_tokens.to(total.dtype)
    else:
        denom = seg_sum(norm.rows.sum(mask).to(total.dtype), norm.seg_ids, norm.n_seg)
    return total / denom


@AGG_MODES.register("token-sum")
def agg_token_sum(loss: torch.Tensor, mask: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    return seg_sum(_row_sums(loss, mask, norm), norm.seg_ids, norm.n_seg)


@AGG_MODES.register("seq-mean-token-sum")
def agg_seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    q, denom = _seq_denominator(mask, norm)
    return seg_sum(_row_sums(loss, mask, norm) * q, norm.seg_ids, norm.n_seg) / denom


@AGG_MODES.register("seq-mean-token-sum-norm")
def agg_seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    scale = norm.horizon.to(torch.float32) if norm.loss_scale_factor is None else norm.loss_scale_factor
    return agg_seq_mean_token_sum(loss, mask, norm) / scale


@AGG_MODES.register("seq-mean-token-mean")
def agg_seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    q, denom = _seq_denominator(mask, norm)
    per_row = _row_sums(loss, mask, norm) / (norm.rows.sum(mask).to(loss.dtype) + 1e-8)
    return seg_sum(per_row * q, norm.seg_ids, norm.n_seg) / denom


def aggregate(mode: str, loss: torch.Tensor, mask: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    """One value per segment ``(n_seg,)`` of ``loss`` ``(tokens,)`` under ``mode``."""
    return AGG_MODES.get(mode)(loss, mask, norm)


def _per_row_weight(mode: str, mask: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    """``(rows,)`` the weight of each of a row's masked tokens under ``mode``."""
    rows, seg = norm.rows, norm.seg_ids
    if mode == "token-sum":
        return torch.ones(rows.n_rows, dtype=torch.float32, device=mask.device)
    if mode == "token-mean":
        if norm.batch_num_tokens is not None:
            denom = norm.batch_num_tokens.to(torch.float32)
        else:
            denom = seg_sum(rows.sum(mask).to(torch.float32), seg, norm.n_seg)
        return 1.0 / denom.index_select(0, seg)
    q, denom = _seq_denominator(mask, norm)
    per_row = q / denom.index_select(0, seg)
    if mode == "seq-mean-token-sum-norm":
        scale = norm.horizon.to(torch.float32) if norm.loss_scale_factor is None else norm.loss_scale_factor
        return per_row / (scale.index_select(0, seg) if isinstance(scale, torch.Tensor) else scale)
    if mode == "seq-mean-token-mean":
        return per_row / (rows.sum(mask).to(torch.float32) + 1e-8)
    if mode == "seq-mean-token-sum":
        return per_row
    raise NotImplementedError(f"token_weights has no weights for loss_agg_mode {mode!r}")


def token_weights(mode: str, mask: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    """Each token's weight in :func:`aggregate` ``(tokens,)``: ``aggregate(mode, l, mask, norm)`` is
    the per-segment sum of ``w_t l_t`` (up to rounding); 0 outside ``mask``."""
    AGG_MODES.get(mode)  # an unknown mode: the registry's error, naming the valid ones
    return mask.to(torch.float32) * norm.rows.expand(_per_row_weight(mode, mask, norm))
