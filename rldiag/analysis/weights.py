"""The effective per-token weight of one step's actor loss, ``W_t = A_t * N * w_t * rho_t``.

``w_t`` is the derivative of the step's aggregated loss (verl's ``agg_loss``, in
``verl/trainer/ppo/core_algos.py``; :mod:`rldiag.engine.aggregation` here) with respect to token
``t``'s loss, ``N`` the step's loss-mask token count (so that ``token-mean`` gives ``N w_t = 1``)
and ``rho_t`` the rollout IS weight where there is one. Every aggregation mode is linear in the
token losses, so ``w_t`` is a closed form of the mask and the row lengths, one row's tokens
sharing one factor:

- ``token-mean``: ``m_t / N``; ``token-sum``: ``m_t``;
- ``seq-mean-token-sum``: ``m_t q_i / B``, ``q_i`` = row ``i`` has a masked token, ``B`` the rows;
- ``seq-mean-token-sum-norm``: the same divided by ``loss_scale_factor`` (None: the horizon,
  ``data.max_response_length`` or else the step's longest row);
- ``seq-mean-token-mean``: ``m_t q_i / (T_i + 1e-8) / B``, ``T_i`` the row's masked tokens.

Computed in float64 on the flat (packed, row-major) tokens: one prefix sum of the mask gives
every row's ``T_i``, one ``repeat`` spreads the row factors over the tokens; no autograd and no
loop per row. A mode without a closed form here falls back to differentiating the engine's
aggregation (:func:`weights_by_autograd`), which is also the reference the tests pin this to.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rldiag.config.settings import Settings
from rldiag.engine.aggregation import AggNorm, aggregate
from rldiag.engine.layout import Rows

#: ``(mask (tokens,) float64, lengths (rows,) int64, settings, horizon, N) -> w_t / m_t`` per row
#: ``(rows,)``: the closed form of a mode registered in :data:`rldiag.engine.aggregation.AGG_MODES`
#: (the same keys; tests/analysis/test_weights.py pins each to the engine's derivative)
RowFactor = Callable[[np.ndarray, np.ndarray, Settings, float, float], np.ndarray]
ROW_FACTORS: dict[str, RowFactor] = {}


def _closed_form(mode: str) -> Callable[[RowFactor], RowFactor]:
    def deco(fn: RowFactor) -> RowFactor:
        ROW_FACTORS[mode] = fn
        return fn

    return deco


def _row_masked(mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``T_i`` ``(rows,)``: masked tokens per row (exact: a difference of integer prefix sums)."""
    ends = np.cumsum(lengths)
    csum = np.concatenate([[0.0], np.cumsum(mask, dtype=np.float64)])
    return csum[ends] - csum[ends - lengths]


def _seq_mean(mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return (_row_masked(mask, lengths) > 0) / float(max(len(lengths), 1))


@_closed_form("token-mean")
def _token_mean(mask, lengths, settings, horizon, n_norm):
    return np.full(len(lengths), 1.0 / n_norm if n_norm else np.inf)


@_closed_form("token-sum")
def _token_sum(mask, lengths, settings, horizon, n_norm):
    return np.ones(len(lengths))


@_closed_form("seq-mean-token-sum")
def _seq_mean_token_sum(mask, lengths, settings, horizon, n_norm):
    return _seq_mean(mask, lengths)


@_closed_form("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(mask, lengths, settings, horizon, n_norm):
    scale = settings["actor_rollout_ref.actor.loss_scale_factor"]
    return _seq_mean(mask, lengths) / float(horizon if scale is None else scale)


@_closed_form("seq-mean-token-mean")
def _seq_mean_token_mean(mask, lengths, settings, horizon, n_norm):
    return _seq_mean(mask, lengths) / (_row_masked(mask, lengths) + 1e-8)


def _horizon(lengths: np.ndarray, settings: Settings) -> int:
    return settings["data.max_response_length"] or max(1, int(lengths.max()) if len(lengths) else 1)


def effective_weights(adv: np.ndarray, mask: np.ndarray, lengths: np.ndarray, settings: Settings, norm_tokens: float,
                      is_weights: np.ndarray | None = None) -> np.ndarray:
    """``A_t * N * w_t * rho_t`` per token ``(tokens,)`` float64, from flat ``adv``, ``mask`` and
    ``is_weights`` ``(tokens,)`` and the rows' ``lengths`` ``(rows,)``; ``N`` = ``norm_tokens``."""
    mode = settings.actor_agg_mode
    if mode not in ROW_FACTORS:
        return weights_by_autograd(adv, mask, lengths, settings, norm_tokens, is_weights)
    m = np.asarray(mask, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.int64)
    per_row = ROW_FACTORS[mode](m, lengths, settings, _horizon(lengths, settings), float(norm_tokens))
    out = np.asarray(adv, dtype=np.float64) * m * np.repeat(per_row * float(norm_tokens), lengths)
    return out * is_weights if is_weights is not None else out


def weights_by_autograd(adv: np.ndarray, mask: np.ndarray, lengths: np.ndarray, settings: Settings,
                        norm_tokens: float, is_weights: np.ndarray | None = None) -> np.ndarray:
    """:func:`effective_weights` by differentiating the engine's aggregation of one step (float32
    gradients): the definition the closed forms are checked against, and the path of a mode
    that has none."""
    rows = len(lengths)
    if not np.asarray(mask).size:  # no tokens: nothing to differentiate
        return np.zeros(0)
    # on the CPU on purpose: numpy in, numpy out
    cpu = torch.device("cpu")
    layout = Rows.from_lengths(torch.from_numpy(np.asarray(lengths).astype(np.int64)))
    m = torch.from_numpy(np.asarray(mask).astype(np.float32))
    loss = torch.zeros(layout.n_tokens, dtype=torch.float32, device=cpu, requires_grad=True)
    norm = AggNorm(
        seg_ids=torch.zeros(rows, dtype=torch.long, device=cpu), n_seg=1,
        horizon=torch.tensor([_horizon(lengths, settings)], device=cpu), rows=layout,
        batch_num_tokens=torch.tensor([float(norm_tokens)], device=cpu),
        global_batch_size=torch.tensor([float(rows)], device=cpu),
        loss_scale_factor=settings["actor_rollout_ref.actor.loss_scale_factor"],
    )
    aggregate(settings.actor_agg_mode, loss, m, norm).sum().backward()
    assert loss.grad is not None  # a leaf that requires grad, after backward()
    w = loss.grad.to(torch.float64).numpy() * float(norm_tokens)
    out = np.asarray(adv).astype(np.float64) * w
    return out * is_weights if is_weights is not None else out
