"""The reward-side KL statistic (``algorithm.use_kl_in_reward``): verl's ``apply_kl_penalty``
(``verl/trainer/ppo/ray_trainer.py``, called by both trainers: ``fit`` of the legacy one, V1's
``_compute_advantage`` in ``verl/trainer/ppo/v1/trainer_base.py``).

verl computes it after ``_compute_old_log_prob`` and before rollout correction, so it reads

- ``old_log_probs`` as the trainer holds it then: ``rollout_log_probs`` in bypass mode
  (``algorithm.rollout_correction.bypass_mode``: verl's ``apply_bypass_mode`` copies them over),
  the recomputed π_old otherwise;
- ``ref_log_prob``;
- the mask *before* rollout correction's rejection rewrites it: ``loss_mask`` when the batch
  has one (the capture keeps it so), else ``response_mask``.

This is the one definition: the pipeline's reward-KL stage (:mod:`rldiag.engine.stages.reward`,
whose declaration names these columns) shapes the rewards with it, and the adaptive KL chain
(:mod:`rldiag.executors.klchain`) reads each step's ``current_kl`` from it, loading only that
stage's columns (the column planner's ``reward_kl_columns``). The statistic does not depend on
the KL coefficient.
"""

from __future__ import annotations

import torch

from rldiag.engine.batch import Batch
from rldiag.engine.kl import kl_estimate
from rldiag.engine.segments import MEAN_EPS, seg_mean
from rldiag.engine.settings import EngineSettings
from rldiag.errors import MissingInputError


def anchor_column(settings: EngineSettings) -> str:
    """The column that is π_old for the update and the reward KL: ``rollout_log_probs`` in bypass
    mode, else ``old_log_probs``."""
    return "rollout_log_probs" if settings["algorithm.rollout_correction.bypass_mode"] else "old_log_probs"


def anchor_log_probs(batch: Batch, settings: EngineSettings) -> torch.Tensor | None:
    """π_old as the update uses it ``(tokens,)``: ``rollout_log_probs`` in bypass mode (required
    there), else ``old_log_probs`` (None when the batch has none)."""
    name = anchor_column(settings)
    t = getattr(batch, name)
    if t is None and name == "rollout_log_probs":
        raise MissingInputError(
            f"algorithm.rollout_correction.bypass_mode needs column {name!r}, which the batch does not have",
            column=name,
        )
    return t


def original_mask(batch: Batch) -> torch.Tensor:
    """The mask before rollout correction ``(tokens,)``: ``loss_mask`` if the batch has it
    (then ``response_mask`` is the trainer's post-rejection mask), else ``response_mask``."""
    return batch.loss_mask if batch.loss_mask is not None else batch.response_mask


def reward_kl(batch: Batch, settings: EngineSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token KL on the original mask, ``kld`` ``(tokens,)`` (0 off the mask), and each
    step's ``current_kl`` ``(n_steps,)``: the mean over the step's rows of the row's masked mean
    ``sum(kld m) / (sum(m) + 1e-8)`` (verl's ``masked_mean(kld, response_mask, axis=-1)`` then
    ``torch.mean``), which the adaptive controller reads.

    Raises :class:`MissingInputError` naming the column the batch lacks.
    """
    old_lp = anchor_log_probs(batch, settings)
    for name, t in (("old_log_probs", old_lp), ("ref_log_prob", batch.ref_log_prob)):
        if t is None:
            raise MissingInputError(
                f"algorithm.use_kl_in_reward needs column {name!r}, which the batch does not have", column=name
            )
    assert old_lp is not None and batch.ref_log_prob is not None  # checked just above
    mask0 = original_mask(batch)
    rows = batch.rows
    kld = kl_estimate(settings["algorithm.kl_penalty"], old_lp, batch.ref_log_prob) * mask0
    row_kl = rows.sum(kld * mask0) / (rows.sum(mask0) + MEAN_EPS)
    return kld, seg_mean(row_kl, batch.step_ids, batch.n_steps)
