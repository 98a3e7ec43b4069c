"""One recompute over a packed batch: the engine's stages (:mod:`rldiag.engine.stages`) in the
order of operations of verl's V1 trainer, over one shared state.

0. ``anchor``: the *original* mask is ``loss_mask`` when the batch has one (the rollout's mask,
   captured after rejection rewrote ``response_mask``: verl's V1 trainer keeps it so), else
   ``response_mask``; every stage below starts from it, as verl does. In
   ``algorithm.rollout_correction.bypass_mode``, ``old_log_probs := rollout_log_probs``
   (``_compute_old_log_prob`` in verl's ``ray_trainer.py``); nothing else changes (the loss_mode stays).
1. ``reward_kl``: token_level_scores -> token_level_rewards, optional KL shaping on the original
   response_mask (``algorithm.use_kl_in_reward``; verl ``ray_trainer.apply_kl_penalty``).
2. ``rollout_correction`` when the batch has ``rollout_log_probs`` and bypass mode is off
   (:mod:`rldiag.engine.rollout_correction`): IS weights, rejection rewrites response_mask
   (rewards at rejected tokens stay), ``rollout_corr/*`` metrics (verl ``rollout_corr_helper``).
3. ``filter`` (only with ``algorithm.filter_groups.enable`` or ``rldiag.filter.gate_column``): the
   dropped rows leave the update's mask and denominators (not refilled, as verl would);
   ``advantages``: the advantage estimator reads the rewritten mask (the kept rows alone after a
   filter); ``data_metrics``.
4. ``layout`` (micro-batches), ``filter_weight`` (the no-signal groups out of the denominators,
   ``rldiag/filter/*``; only with a filter set), then the actor's metrics (``actor_loss`` with the IS weights,
   ``entropy_loss``, ``kl_loss``), the critic's (only where the trainer has a critic: verl's
   ``need_critic``, ``critic.enable`` else ``adv_estimator == gae``), ``total_loss``, and
   ``old_policy`` (what verl logs where it recomputes pi_old). Token-mean denominators count the
   original mask (``loss_mask`` if given). Actor and critic metrics are computed per emulated
   micro-batch (:mod:`rldiag.engine.microbatch`) and combined as verl logs them.
5. rldiag's own: ``ref_kl``, ``group_signal``, ``mismatch``; ``diag_is`` (after rollout correction:
   token- and sequence-level IS weights at threshold 2.0, whatever the correction settings, never
   in the loss), ``turns`` (after the actor: per-turn statistics) and ``rows`` (per-row values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rldiag.engine.batch import Batch
from rldiag.engine.kl_control import KLControllerState, PresetKLCoefficients, initial_kl_state
from rldiag.engine.liveness import release_plan
from rldiag.engine.settings import EngineSettings
from rldiag.engine.stages import STAGES, State
from rldiag.engine.step_failures import StepErrors

__all__ = ["KLControllerState", "PresetKLCoefficients", "Result", "initial_kl_state", "recompute_batch"]


@dataclass
class Result:
    """What a recompute of one packed batch produced."""

    steps: list[int]
    metrics: dict[str, torch.Tensor]  # name -> (n_steps,)
    tokens: dict[str, torch.Tensor]  # name -> (tokens,), the batch's packed layout
    failed: dict[int, str] = field(default_factory=dict)  # run step -> message
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (rows,), the batch's packed row order


def recompute_batch(
    batch: Batch, settings: EngineSettings, kl_state: KLControllerState | PresetKLCoefficients | None = None,
    *, release: bool = False, keep_tokens: bool = True,
) -> Result:
    """Recompute everything rldiag derives for the steps packed in ``batch``: every stage of
    :data:`~rldiag.engine.stages.STAGES` in order over one state.

    ``release``: drop each state field and batch column once the last stage that reads it has
    run (:mod:`rldiag.engine.liveness`), so that its memory is reused by the stages after it; the
    caller's ``batch`` object keeps its columns, so this only saves memory where the caller holds
    no other reference to them. ``keep_tokens=False``: the per-token outputs are dropped as they
    are made (``Result.tokens`` is empty), for a caller that does not write them. Neither changes
    a number."""
    steps = list(batch.steps)
    state = State(batch, settings, kl_state, StepErrors(batch.steps), keep_tokens=keep_tokens)
    del batch  # the state's reference alone, so that a released column is freed
    plan = release_plan(STAGES, settings) if release else None
    for i, stage in enumerate(STAGES):
        stage.run(state)
        if not keep_tokens:
            state.tokens.clear()
        if plan is not None:
            plan[i].apply(state, stage.name)
    return Result(steps=steps, metrics=state.metrics, tokens=state.tokens, failed=state.errors.failed(),
                  rows=state.rows)
