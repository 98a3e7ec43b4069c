"""verl's data metrics (``compute_data_metrics``), one value per step of a packed batch."""

from __future__ import annotations

import numpy as np
import torch

from rldiag.engine import host, kernels, probs_native
from rldiag.engine.batch import Batch
from rldiag.engine.critic import explained_variance
from rldiag.engine.layout import Rows
from rldiag.engine.segments import (
    seg_max,
    seg_mean,
    seg_min,
    seg_sum,
    step_masked_extrema,
)

#: ``rldiag/advantages/centre_offset``: a std at most this share of the mean's magnitude is a
#: constant advantage (float32 keeps about 7 digits; its rounding alone gives a std near 1e-7).
CONSTANT_REL_STD = 1e-5


def _row_stats(prefix: str, x: torch.Tensor, seg: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}/mean": seg_mean(x, seg, n),
        f"{prefix}/max": seg_max(x, seg, n),
        f"{prefix}/min": seg_min(x, seg, n),
    }


def data_metrics(
    batch: Batch,
    token_level_rewards: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    use_critic: bool = True,
) -> dict[str, torch.Tensor]:
    """``critic/score|rewards|advantages|returns/*``, ``critic/values/*``,
    ``critic/vf_explained_var``, ``response_length*``, ``response/aborted_ratio``,
    ``prompt_length/*``. Inputs ``(tokens,)``; ``mask`` is the post-correction mask.

    ``critic/values/*`` and ``critic/vf_explained_var`` only with ``use_critic`` (and a ``values``
    column), as verl's ``compute_data_metrics(batch, use_critic=need_critic(config))``: without a
    critic the values are not the returns' baseline and their explained variance means nothing.

    Scores and rewards are row sums over non-aborted rows (length > 0); advantages, returns and
    values are taken over masked tokens; lengths count every token of a row (tool tokens too).
    """
    n, sid, rows = batch.n_steps, batch.step_ids, batch.rows
    out: dict[str, torch.Tensor] = {}
    lengths = batch.lengths.to(torch.float32)
    live = batch.lengths > 0
    score_sums = rows.column_sum(batch.token_level_scores)
    reward_sums = score_sums if token_level_rewards is batch.token_level_scores else rows.column_sum(token_level_rewards)
    out.update(_row_stats("critic/score", score_sums[live], sid[live], n))
    out.update(_row_stats("critic/rewards", reward_sums[live], sid[live], n))
    adv_stats = step_masked_extrema(advantages, mask, rows, sid, n)
    # outcome estimators return the advantages as returns: one pass serves both
    ret_stats = adv_stats if returns is advantages else step_masked_extrema(returns, mask, rows, sid, n)
    for name, (mean, mx, mn) in (("critic/advantages", adv_stats), ("critic/returns", ret_stats)):
        out.update({f"{name}/mean": mean, f"{name}/max": mx, f"{name}/min": mn})
    if use_critic and batch.values is not None:
        mean, mx, mn = step_masked_extrema(batch.values, mask, rows, sid, n)
        out.update({"critic/values/mean": mean, "critic/values/max": mx, "critic/values/min": mn})
        out["critic/vf_explained_var"] = explained_variance(returns, batch.values, mask, rows, sid, n)
    horizon = batch.max_response_length.to(torch.float32)
    out.update(_row_stats("response_length", lengths, sid, n))
    out["response_length/clip_ratio"] = seg_mean((lengths == horizon[sid]).float(), sid, n)
    out.update(_row_stats("response_length_non_aborted", lengths[live], sid[live], n))
    out["response_length_non_aborted/clip_ratio"] = seg_mean(
        (lengths[live] == horizon[sid[live]]).float(), sid[live], n
    )
    out["response/aborted_ratio"] = seg_mean((~live).float(), sid, n)
    if batch.prompt_length is not None:
        pl = batch.prompt_length.to(torch.float32)
        assert batch.max_prompt_length is not None  # the loader gives both or neither
        out.update(_row_stats("prompt_length", pl, sid, n))
        out["prompt_length/clip_ratio"] = seg_mean(
            (pl == batch.max_prompt_length.to(torch.float32)[sid]).float(), sid, n
        )
    # multi-turn rows: the agent loop's per-row counts, when the batch carries them
    # (verl's compute_data_metrics; the V1 trainer logs num_turns/* under training/ as well)
    for column, prefixes in (("num_turns", ("num_turns", "training/num_turns")), ("tool_call_counts", ("tool_call_counts",))):
        if column in batch.extra:
            counts = batch.extra[column].to(torch.float32)
            for prefix in prefixes:
                out.update(_row_stats(prefix, counts, sid, n))
    return out


def rollout_probs_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, rows: Rows,
    step_ids: torch.Tensor, n_steps: int,
) -> dict[str, torch.Tensor]:
    """``training/rollout_probs_diff_{valid,max,mean,std}`` and
    ``training/rollout_actor_probs_pearson_corr``: the trainer's and the rollout engine's token
    probabilities ``p = exp(log p)`` compared over each step's masked tokens (verl's
    ``calculate_debug_metrics``): ``|p_old - p_rollout|`` max, mean, unbiased std, and the
    Pearson correlation of the two (arXiv:2506.13585). A step without tokens: valid 0, NaN.
    Inputs ``(tokens,)``, ``step_ids`` ``(rows,)``; outputs ``(n_steps,)``. On the host, in
    one compiled read where the library is built (:mod:`rldiag.engine.probs_native`)."""
    fields = probs_native.step_fields(old_log_probs, rollout_log_probs, mask, rows, step_ids, n_steps)
    if fields is not None:
        return _rollout_probs_from(fields, old_log_probs.device)
    p_old, p_roll = torch.exp(old_log_probs), torch.exp(rollout_log_probs)  # in the inputs' dtype, as verl
    m = mask if mask.dtype == p_old.dtype else mask.to(p_old.dtype)
    diff = (p_old - p_roll).abs()

    def total(x: torch.Tensor) -> torch.Tensor:  # (n_steps,) float64: per-row sums in float64
        return seg_sum(rows.masked_sum(x, m).to(torch.float64), step_ids, n_steps)

    row_count = rows.mask_count(m)
    count = seg_sum(row_count.to(torch.float64), step_ids, n_steps)
    valid = count > 0

    def centred(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # mean (n_steps,), x - mean
        mean = total(x) / count
        return mean, x - rows.expand(mean.to(x.dtype)[step_ids])

    mean, dd = centred(diff)
    var = total(dd * dd) / (count - 1)  # unbiased, as torch.std
    has = row_count > 0
    mx = seg_max(kernels.masked_row_max(diff, m, rows)[has], step_ids[has], n_steps)
    _, do = centred(p_old)
    _, dr = centred(p_roll)
    corr = total(do * dr) / torch.sqrt(total(do * do) * total(dr * dr))  # Pearson (arXiv:2506.13585)
    nan = torch.full_like(count, float("nan"))
    return {
        "training/rollout_probs_diff_valid": valid.to(torch.float32),
        "training/rollout_probs_diff_max": torch.where(valid, mx.to(torch.float64), nan).to(torch.float32),
        "training/rollout_probs_diff_mean": torch.where(valid, mean, nan).to(torch.float32),
        "training/rollout_probs_diff_std": torch.sqrt(var).to(torch.float32),
        "training/rollout_actor_probs_pearson_corr": torch.where(valid, corr.clamp(-1.0, 1.0), nan).to(torch.float32),
    }


def _rollout_probs_from(f: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """:func:`rollout_probs_metrics` from the compiled read's per-step fields, by the same
    formulas as its torch twin (a step without tokens: valid 0, NaN)."""
    t = {k: torch.from_numpy(v.copy()).to(device) for k, v in f.items()}
    count = t["n"]
    valid = count > 0
    nan = torch.full_like(count, float("nan"))
    std = torch.sqrt(t["diff_m2"] / (count - 1))  # unbiased, as torch.std
    corr = t["cross"] / torch.sqrt(t["old_m2"] * t["roll_m2"])  # Pearson (arXiv:2506.13585)
    return {
        "training/rollout_probs_diff_valid": valid.to(torch.float32),
        "training/rollout_probs_diff_max": torch.where(valid, t["diff_max"], nan).to(torch.float32),
        "training/rollout_probs_diff_mean": torch.where(valid, t["diff_mean"], nan).to(torch.float32),
        "training/rollout_probs_diff_std": std.to(torch.float32),
        "training/rollout_actor_probs_pearson_corr": torch.where(valid, corr.clamp(-1.0, 1.0), nan).to(torch.float32),
    }


def after_last_zero(mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``(rows,)`` float32: ``z_i + 1``, where ``z_i`` is the position in its row of the row's
    last token with ``mask == 0`` (0 for a row without one). On the host from numpy's scan of
    the zeros and a binary search per row end (exact integers, the same as the token-sized
    form used elsewhere: the rows' maxima of the zeros' 1-based indices, less each row's start)."""
    v = host.view(mask)
    if v is None or rows.offsets.device.type != "cpu":
        idx1 = torch.arange(1, rows.n_tokens + 1, dtype=torch.float64, device=mask.device)
        last_zero = rows.amax(torch.where(mask == 0, idx1, torch.zeros((), dtype=torch.float64, device=mask.device)),
                              empty=0.0)
        return (last_zero - rows.offsets[:-1].to(torch.float64)).clamp_(min=0.0).to(torch.float32)
    off = rows.offsets.numpy()
    zeros = np.flatnonzero(v == 0)
    if zeros.size == 0:
        return torch.zeros(rows.n_rows, dtype=torch.float32, device=mask.device)
    k = np.searchsorted(zeros, off[1:], side="left") - 1  # the last zero before each row's end
    last = np.where(k >= 0, zeros[np.maximum(k, 0)], -1)
    return torch.from_numpy(np.where(last >= off[:-1], last + 1 - off[:-1], 0).astype(np.float32))


def signal_metrics(
    batch: Batch,
    token_level_rewards: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kl_in_reward: bool,
    mask_resets_return: bool = True,
) -> dict[str, torch.Tensor]:
    """rldiag's per-step signals for the health checks, ``(n_steps,)`` each:

    - ``rldiag/mask/credit_cut_fraction``: share of actor tokens (mask 1) with a mask-0 position
      later in their row: under REINFORCE++'s mask-resetting reward-to-go (verl 0.8.0's
      ``compute_reinforce_plus_plus_outcome_advantage``) such a token gets none of the outcome
      reward. 0 where the release reproduced carries the return through mask-0 tokens (0.9.0
      on: ``mask_resets_return`` False), which cuts no credit.
    - ``rldiag/advantages/centre_offset``: masked mean of the advantages over their masked
      population std (0 when every advantage is 0 or the step has no masked token; +-inf for a
      constant nonzero advantage, which is one whose std is at most ``CONSTANT_REL_STD`` of its
      mean: float32 rounding).
    - ``rldiag/rewards/kl_sign_flip_fraction`` (with KL in reward): among non-aborted rows with a
      nonzero summed score, the share whose summed reward has the opposite sign.
    """
    n, sid, rows = batch.n_steps, batch.step_ids, batch.rows
    out: dict[str, torch.Tensor] = {}
    # The cut tokens of a row are its actor tokens less those after its last mask-0 token z_i:
    # T_i - (z_i + 1) of them (none cut when the row has no zero: z_i + 1 = 0).
    m0 = batch.loss_mask if batch.loss_mask is not None else batch.response_mask  # before rejection
    last1 = after_last_zero(m0, rows)
    actor = rows.mask_count(m0)
    cut = actor - (batch.lengths.to(torch.float32) - last1)
    if not mask_resets_return:  # the release carries the return through mask-0 tokens: none is cut
        cut = torch.zeros_like(cut)
    out["rldiag/mask/credit_cut_fraction"] = seg_sum(cut, sid, n) / seg_sum(actor, sid, n)
    # two passes in float32 (centred before squaring), row sums accumulated per step in float64
    # a step without a masked token (every row filtered out) has no advantage: offset 0
    cnt = seg_sum(rows.mask_count(mask).to(torch.float64), sid, n).clamp_min(1)
    mean = seg_sum(rows.masked_sum(advantages, mask).to(torch.float64), sid, n) / cnt
    dev = advantages - rows.expand(mean.to(advantages.dtype)[sid])
    std = (seg_sum(rows.masked_square_sum(dev, mask).to(torch.float64), sid, n) / cnt).sqrt()
    # A std within float32 rounding of the mean (the deviations are taken in float32) is a constant
    # advantage: its ratio would be rounding noise (1e7 in one row order, inf in another).
    spread = std > CONSTANT_REL_STD * mean.abs()
    offset = torch.where(spread, mean / std, torch.where(mean == 0, torch.zeros_like(mean), mean.sign() * float("inf")))
    out["rldiag/advantages/centre_offset"] = offset.to(torch.float32)
    if kl_in_reward:
        rows_live = batch.lengths > 0
        s = rows.column_sum(batch.token_level_scores).to(torch.float64)
        r = rows.column_sum(token_level_rewards).to(torch.float64)
        keep = rows_live & (s != 0)
        flip = keep & (torch.sign(r) != torch.sign(s))
        out["rldiag/rewards/kl_sign_flip_fraction"] = seg_sum(flip.float(), sid, n) / seg_sum(keep.float(), sid, n)
    return out
