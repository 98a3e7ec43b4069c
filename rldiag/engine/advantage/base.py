"""What every advantage estimator shares: its input, its registry and the helpers of several.

Every estimator has one signature: ``fn(inp: AdvInput) -> (advantages, returns)``, both flat
``(tokens,)`` in the batch's packed layout (``inp.rows``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rldiag.engine.batch import Batch
from rldiag.engine.layout import Rows
from rldiag.engine.scan import (
    gae_segmented,
    reverse_cumsum_segmented,
    reward_to_go_carry_segmented,
    reward_to_go_segmented,
)
from rldiag.engine.segments import seg_std, seg_sum
from rldiag.engine.settings import EngineSettings
from rldiag.engine.step_failures import StepErrors
from rldiag.errors import MissingInputError
from rldiag.registry import Entry, Registry

GRPO_EPS = 1e-6
#: verl's ``f_norm`` of GPG (the dispatcher never overrides the function default).
GPG_F_NORM = 1.0


@dataclass
class AdvInput:
    """What an estimator reads.

    Attributes:
        batch: the packed batch (``batch.extra`` holds estimator-specific columns).
        rewards: ``(tokens,)`` token-level rewards.
        mask: ``(tokens,)`` post-correction response_mask.
        settings: resolved settings.
        errors: per-step failures.
        rollout_is_weights: ``(tokens,)`` rollout IS weights when rollout correction computed
            them before the estimator (verl passes them to the optimal-token-baseline pair), else None.
    """

    batch: Batch
    rewards: torch.Tensor
    mask: torch.Tensor
    settings: EngineSettings
    errors: StepErrors
    rollout_is_weights: torch.Tensor | None = None

    @property
    def rows(self) -> Rows:
        """The row layout of the token tensors."""
        return self.batch.rows


AdvFn = Callable[[AdvInput], tuple[torch.Tensor, torch.Tensor]]
@dataclass(frozen=True)
class EstimatorMeta(Entry):
    """An estimator's registration: ``needs``, the columns it always reads; ``needs_fn``,
    settings -> the further columns its settings name (or a description of the setting that
    would name them); ``optional``, columns it reads when the batch has them; ``check``,
    settings -> None, raising :class:`~rldiag.errors.ConfigError` before any work where verl
    would reject the configuration. ``grouped``: its baseline is the other responses of the same
    prompt (the uid group), so a group of one response gets no relative signal."""

    needs: tuple[str, ...] = ()
    needs_fn: Callable[[EngineSettings], tuple[str, ...]] | None = None
    optional: tuple[str, ...] = ()
    check: Callable[[EngineSettings], None] | None = None
    #: what it whitens over, dividing by a spread: ``"group"`` (each uid group's values by their
    #: std), ``"step"`` (the step's values), ``""`` (nothing). On an exactly tied group or step,
    #: verl's float32 value there is rounding noise of a whitened constant (docs/algorithms-estimators.md).
    whitens: str = ""
    #: its baseline is the other responses of the same prompt (the uid group)
    grouped: bool = False


ESTIMATORS: Registry[AdvFn] = Registry("advantage estimator", meta=EstimatorMeta)


# ---- shared helpers ---------------------------------------------------------------------------


def require_extra(inp: AdvInput, name: str, estimator: str, hint: str = "") -> torch.Tensor:
    """``batch.extra[name]``, or a :class:`MissingInputError` naming the column."""
    t = inp.batch.extra.get(name)
    if t is None:
        more = f" ({hint})" if hint else ""
        raise MissingInputError(
            f"{estimator} needs column {name!r}, which the batch does not have{more}", column=name
        )
    return t


def require_field(inp: AdvInput, name: str, estimator: str, hint: str = "") -> torch.Tensor:
    """A standard optional Batch tensor (``values``, ``old_log_probs``, ...) or a precise error."""
    t = getattr(inp.batch, name)
    if t is None:
        more = f" ({hint})" if hint else ""
        raise MissingInputError(
            f"{estimator} needs column {name!r}, which the batch does not have{more}", column=name
        )
    return t


def flag_rows(errors: StepErrors, bad_rows: torch.Tensor, batch: Batch, message: str) -> None:
    """Fail every step holding a row where ``bad_rows`` ``(rows,)`` is true."""
    if bool(bad_rows.any()):
        per_step = seg_sum(bad_rows.to(torch.float32), batch.step_ids, batch.n_steps) > 0
        errors.flag(per_step, message)


def group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor, n_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row ``(rows,)``: group mean, group sample std (two-pass, as ``torch.std`` of the stacked
    group) and group size, with verl's singleton rule (mean 0, std 1 for a group of one)."""
    mean, std, cnt = seg_std(scores, group_ids, n_groups)
    single = cnt <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[group_ids], std[group_ids], cnt[group_ids]


def group_mean(scores: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Per row ``(rows,)``: the mean score of its prompt group (0 for a group of one, verl's rule)."""
    mean, _, _ = group_stats(scores, batch.group_ids, batch.n_groups)
    return mean


def grpo_scalar(scores: torch.Tensor, group_ids: torch.Tensor, n_groups: int, norm_by_std: bool) -> torch.Tensor:
    """Outcome GRPO scalar per row ``(rows,)``: ``(R - mean) / (std + 1e-6)`` or ``R - mean``."""
    mean, std, _ = group_stats(scores, group_ids, n_groups)
    if norm_by_std:
        return (scores - mean) / (std + GRPO_EPS)  # Shao et al. 2024 (arXiv:2402.03300), eq. GRPO outcome
    return scores - mean  # Dr. GRPO, Liu et al. 2025 (arXiv:2503.20783): no std division


def broadcast(scalar: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``(rows,)`` -> ``(tokens,)``: each row's scalar on its tokens, times the mask."""
    return rows.expand(scalar) * mask


def gae_scan(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float, rows: Rows
) -> torch.Tensor:
    """verl's mask-skipping GAE recursion; raw advantages ``(tokens,)``.

    At a mask-0 position (tool observation, rejected token) neither the next value nor the
    running advantage is updated, so credit flows across it (verl ``compute_gae_advantage_return``). The recursion
    (Schulman et al. 2016, arXiv:1506.02438) is a segmented scan over the packed rows that
    restarts at each row's end (:func:`rldiag.engine.scan.gae_segmented`); verl's
    one-position-at-a-time form is the reference it is tested against.
    """
    return gae_segmented(rewards, values, mask, rows.last(), gamma, lam)


def reward_to_go_resetting(rewards: torch.Tensor, mask: torch.Tensor, gamma: float, rows: Rows) -> torch.Tensor:
    """REINFORCE++ reward-to-go of verl 0.8.0 ``(tokens,)``: ``G_t = r_t + gamma * G_{t+1}``,
    where the running return is zeroed *after* position t when ``mask[t] == 0``, so a mask-0
    token keeps its own future but cuts it off from every earlier token (Williams 1992
    REINFORCE return; Hu 2025, arXiv:2501.03262)."""
    return reward_to_go_segmented(rewards, mask, rows.last(), gamma)


def reward_to_go_carrying(rewards: torch.Tensor, mask: torch.Tensor, gamma: float, rows: Rows) -> torch.Tensor:
    """REINFORCE++ reward-to-go since verl commit 8a1bf6d5b ``(tokens,)``: a mask-0 token neither
    adds its reward nor resets; the running return passes it unchanged and its return is 0
    (verl's ``compute_reinforce_plus_plus_outcome_advantage``). Mask [1, 0, 1], rewards [0, 0, 1]:
    returns [1, 0, 1]."""
    return reward_to_go_carry_segmented(rewards, mask, rows.last(), gamma)


def reverse_cumsum(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``(tokens,)`` sum of ``x`` from each position to the end of its row (no reset)."""
    return reverse_cumsum_segmented(x, rows)


def estimate(name: str, inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    return ESTIMATORS.get(name)(inp)
