"""verl's data metrics (``compute_data_metrics``), one value per step of a packed batch."""

from __future__ import annotations

import torch

from rldiag.engine.batch import Batch
from rldiag.engine.critic import explained_variance
from rldiag.engine.segments import seg_max, seg_mean, seg_min, step_masked_extrema


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
) -> dict[str, torch.Tensor]:
    """``critic/score|rewards|advantages|returns/*``, ``critic/values/*``,
    ``critic/vf_explained_var``, ``response_length*``, ``response/aborted_ratio``,
    ``prompt_length/*``. Inputs ``(rows, tokens)``; ``mask`` is the post-correction mask.

    Scores and rewards are row sums over non-aborted rows (length > 0); advantages, returns and
    values are taken over masked tokens; lengths count every token of a row (tool tokens too).
    """
    n, sid = batch.n_steps, batch.step_ids
    out: dict[str, torch.Tensor] = {}
    lengths = batch.lengths.to(torch.float32)
    live = batch.lengths > 0
    out.update(_row_stats("critic/score", batch.token_level_scores.sum(-1)[live], sid[live], n))
    out.update(_row_stats("critic/rewards", token_level_rewards.sum(-1)[live], sid[live], n))
    for name, t in (("critic/advantages", advantages), ("critic/returns", returns)):
        mean, mx, mn = step_masked_extrema(t, mask, sid, n)
        out.update({f"{name}/mean": mean, f"{name}/max": mx, f"{name}/min": mn})
    if batch.values is not None:
        mean, mx, mn = step_masked_extrema(batch.values, mask, sid, n)
        out.update({"critic/values/mean": mean, "critic/values/max": mx, "critic/values/min": mn})
        out["critic/vf_explained_var"] = explained_variance(returns, batch.values, mask, sid, n)
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
        out.update(_row_stats("prompt_length", pl, sid, n))
        out["prompt_length/clip_ratio"] = seg_mean(
            (pl == batch.max_prompt_length.to(torch.float32)[sid]).float(), sid, n
        )
    return out
