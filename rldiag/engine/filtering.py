"""The rows the filters drop (docs/algorithms-losses.md, "Filters"): verl's group filter
(``algorithm.filter_groups``), rldiag's outcome gate (``rldiag.filter.gate_*``) and its
no-signal groups (``rldiag.filter.drop_no_signal_from_denominator``). Pure functions of the
packed batch; the stages (:mod:`rldiag.engine.stages.filter`) apply them.
"""

from __future__ import annotations

import torch

from rldiag.engine.batch import Batch
from rldiag.engine.segments import seg_count, seg_max, seg_min, seg_sum
from rldiag.errors import MissingInputError

__all__ = ["DERIVED_METRICS", "flat_groups", "no_signal_groups", "row_values"]

#: the filter metrics computed from the rewards rather than read from a column, as the DAPO
#: recipe's trainer derives them: the row's summed token_level_scores, its summed
#: token_level_rewards (the KL penalty included)
DERIVED_METRICS = ("seq_reward", "seq_final_reward")
#: verl's V1 replay buffer's canonical metric: the row's summed reward-model scores (rm_scores,
#: verl's token_level_scores, before any KL penalty)
REWARD_METRIC = "reward"


def row_values(batch: Batch, rewards: torch.Tensor, name: str, who: str, canonical_reward: bool) -> torch.Tensor:
    """One number per row ``(rows,)`` float64 for the filter metric or gate column ``name``:
    ``seq_reward`` the row's summed token_level_scores, ``seq_final_reward`` its summed
    ``rewards`` (token_level_rewards); ``reward``, where ``canonical_reward`` (verl's V1
    replay buffer), the summed token_level_scores; ``score`` without a column of that name the
    summed token_level_scores (the loader puts a scalar score on the row's last token); any
    other name the batch's scalar column. ``who``: the setting, for the error naming a missing
    or per-token column."""
    rows = batch.rows
    if name == "seq_reward" or (name == REWARD_METRIC and canonical_reward):
        return rows.column_sum(batch.token_level_scores).to(torch.float64)
    if name == "seq_final_reward":
        return rows.column_sum(rewards).to(torch.float64)
    column = batch.extra.get(name)
    if column is None and name == "score":
        return rows.column_sum(batch.token_level_scores).to(torch.float64)
    if column is None:
        raise MissingInputError(
            f"{who}={name!r} needs a scalar column {name!r} (one number per row), which the batch does not have "
            f"(derived without a column: {', '.join(DERIVED_METRICS)}"
            f"{', reward' if canonical_reward else ''}, score)", column=name,
        )
    if name in batch.token_extra:
        raise MissingInputError(f"{who}={name!r}: column {name!r} is a per-token list, not one number per row",
                                column=name)
    return column.to(torch.float64)


def flat_groups(values: torch.Tensor, group_ids: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``(n_groups,)`` bool: the groups verl's group filter drops: more than one row and a
    standard deviation of ``values`` ``(rows,)`` of exactly 0, i.e. every value the same. A
    non-finite value (whose std is NaN) keeps its group, as does a single row."""
    finite = torch.isfinite(values)
    safe = torch.where(finite, values, torch.zeros_like(values))
    all_finite = seg_sum((~finite).to(torch.float32), group_ids, n_groups) == 0
    same = seg_max(safe, group_ids, n_groups) == seg_min(safe, group_ids, n_groups)
    return (seg_count(group_ids, n_groups) > 1) & all_finite & same


def no_signal_groups(adv: torch.Tensor, mask: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``(n_groups,)`` bool: groups whose advantages are all 0 on the mask (a group without a
    masked token included): they carry no policy gradient."""
    nonzero = batch.rows.masked_count(adv != 0, mask)  # masked tokens with a nonzero advantage, per row
    return seg_sum(nonzero, batch.group_ids, batch.n_groups) == 0
