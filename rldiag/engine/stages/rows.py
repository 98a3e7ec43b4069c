"""Per-row values (``Result.rows``: name -> ``(rows,)``, the batch's packed row order), the rows/
files of a scenario (:func:`rldiag.io.outputs.rows_table`; docs/run-directory.md).

"Actor tokens" are the tokens the update trains on: mask 1 of the mask after rollout rejection
(``loss_mask``, else ``response_mask``, when ``rollout_rs`` is off), as the turns' statistics
(:mod:`.turns`). A mean over a row without one is NaN. The rows' uid, reward components and
ids come from the batch file, added by the writer.
"""

from __future__ import annotations

import torch

from rldiag.engine import host
from rldiag.engine.kl import kl_row_sums
from rldiag.engine.layout import Rows
from rldiag.engine.stages.base import Stage, State
from rldiag.engine.stages.signals import group_flatness


def last_masked(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``(rows,)`` ``values`` at each row's last token of ``mask``, NaN for a row without one.

    The last masked token of a row is where the running count of masked tokens (one int32
    cumulative sum; int64 past 2^31 tokens) first reaches the count up to the row's end: a binary
    search per row (``torch.searchsorted``), no per-token index array."""
    nan = torch.full((rows.n_rows,), float("nan"), dtype=values.dtype, device=values.device)
    if rows.n_tokens == 0:
        return nan
    dtype = torch.int32 if rows.n_tokens < 2**31 else torch.long
    running = host.running_count(mask, dtype)
    def count_before(pos: torch.Tensor) -> torch.Tensor:  # masked tokens before each position (rows,)
        got = running.index_select(0, (pos - 1).clamp_(min=0))
        return torch.where(pos > 0, got, torch.zeros_like(got))

    at_end = count_before(rows.offsets[1:])
    found = at_end > count_before(rows.offsets[:-1])  # the row has a masked token
    last = torch.searchsorted(running, at_end).clamp_(max=rows.n_tokens - 1)
    return torch.where(found, values.index_select(0, last), nan)


def _rows(st: State) -> None:
    batch, out = st.batch, st.rows
    rows, mask = batch.rows, st.mask
    actor = rows.mask_count(mask)
    out["length"] = batch.lengths.to(torch.long)
    out["actor_tokens"] = actor.to(torch.long)
    out["score"] = rows.column_sum(batch.token_level_scores)
    out["reward"] = rows.column_sum(st.rewards)
    out["advantage_mean"] = rows.masked_sum(st.adv, mask) / actor  # 0 / 0: NaN without an actor token
    out["advantage_last"] = last_masked(st.adv, mask, rows)
    if st.diag_is_token is not None and batch.rollout_log_probs is not None and st.old_lp is not None:
        sums, _ = kl_row_sums(st.old_lp, batch.rollout_log_probs, mask, rows, keep_diff=False)
        out["rollout_kl"] = sums["k1"] / actor
        out["rollout_kl_k3"] = sums["k3"] / actor
    gcnt, multi, flat = group_flatness(batch, st.rewards)
    out["group_has_signal"] = (multi & ~flat).index_select(0, batch.group_ids).to(torch.int8)
    out["group_size"] = gcnt.index_select(0, batch.group_ids).to(torch.long)


def _rows_loss(st: State) -> None:
    rows, out = st.batch.rows, st.rows
    if st.policy is not None and st.policy.clipped is not None:
        out["clipped_tokens"] = rows.column_sum(st.policy.clipped)
    if st.loss_weights is not None:
        out["loss_weight"] = rows.sum(st.loss_weights)


ROWS = Stage(
    "rows",
    "per-row values: length, actor tokens, score, reward, advantages, rollout KL, its group's signal "
    "and size (the scenario's rows/ files; the policy loss's part: rows_loss)",
    _rows,
    optional=("loss_mask", "rollout_log_probs", "old_log_probs"),
    rows=("length", "actor_tokens", "score", "reward", "advantage_mean", "advantage_last", "rollout_kl",
          "rollout_kl_k3", "group_has_signal", "group_size"),
    uses=("adv", "diag_is_token", "mask", "old_lp", "rewards"),
    sets=(),
)

ROWS_LOSS = Stage(
    "rows_loss",
    "per-row values of the policy loss: clipped tokens, the row's share of the loss",
    _rows_loss,
    optional=("log_probs", "old_log_probs"),
    rows=("clipped_tokens", "loss_weight"),
    uses=("loss_weights", "policy"),
    sets=(),
)
