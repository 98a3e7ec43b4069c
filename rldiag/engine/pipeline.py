"""One recompute over a packed batch: the order of operations of verl's V1 trainer.

0. ``algorithm.rollout_correction.bypass_mode``: ``old_log_probs := rollout_log_probs``
   (``_compute_old_log_prob`` in verl's ``ray_trainer.py``). Nothing else changes (the loss_mode stays).
The *original* mask is ``loss_mask`` when the batch has one (the rollout's mask, captured after
rejection rewrote ``response_mask``: verl's V1 trainer keeps it so), else ``response_mask``;
every step below starts from it, as verl does.

1. token_level_scores -> token_level_rewards: optional KL shaping on the *original*
   response_mask (``algorithm.use_kl_in_reward``; verl ``ray_trainer.apply_kl_penalty``).
2. Rollout correction when the batch has ``rollout_log_probs`` and bypass mode is off
   (:mod:`rldiag.engine.rollout_correction`): IS weights, rejection rewrites response_mask
   (rewards at rejected tokens stay), ``rollout_corr/*`` metrics (verl ``rollout_corr_helper``).
3. The advantage estimator reads the rewritten mask.
4. Actor metrics (policy loss with the IS weights, entropy, KL loss), critic metrics (only where
   the trainer has a critic: verl's ``need_critic``, ``critic.enable`` else ``adv_estimator == gae``),
   data metrics. Token-mean denominators count the original mask (``loss_mask`` if given). Actor and
   critic metrics are computed per emulated micro-batch (:mod:`rldiag.engine.microbatch`) and
   combined as verl logs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from rldiag.engine.advantage import AdvInput, estimate
from rldiag.engine.aggregation import AggNorm, aggregate
from rldiag.engine.batch import Batch
from rldiag.engine.critic import value_loss
from rldiag.engine.kl import KL_ESTIMATORS, kl_estimate, kl_k1, kl_row_sums
from rldiag.engine.metrics import data_metrics, rollout_probs_metrics, signal_metrics
from rldiag.engine.microbatch import Segmentation, segmentations_for
from rldiag.engine.policy_loss import PolicyLossInput, PolicyLossOutput, policy_loss
from rldiag.engine.reward_kl import anchor_log_probs, original_mask, reward_kl
from rldiag.engine.rollout_correction import CorrectionConfig, correct
from rldiag.engine.segments import (
    MEAN_EPS,
    seg_count,
    seg_max,
    seg_std,
    seg_sum,
    step_mask_count,
)
from rldiag.engine.settings import EngineSettings
from rldiag.engine.step_failures import StepErrors
from rldiag.errors import MissingInputError


@dataclass
class KLControllerState:
    """The reward-side KL coefficient carried from step to step (verl's Fixed/Adaptive
    controllers; adaptive from Ziegler et al. 2019, arXiv:1909.08593)."""

    value: float

    def advance(self, settings: EngineSettings, current_kl: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Coefficients used by each step ``(n_steps,)`` in order; updates ``self.value`` past them.

        ``current_kl`` and ``rows`` are ``(n_steps,)``; the update of step s uses its own KL and
        its number of rows (verl passes the batch size as ``n_steps``).
        """
        kind = settings["algorithm.kl_ctrl.type"]
        if kind == "fixed":
            return torch.full_like(current_kl, float(settings["algorithm.kl_ctrl.kl_coef"]))
        target = float(settings["algorithm.kl_ctrl.target_kl"])
        horizon = float(settings["algorithm.kl_ctrl.horizon"])
        used = []
        for kl, n in zip(current_kl.tolist(), rows.tolist()):
            used.append(self.value)
            err = min(max(kl / target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + err * n / horizon
        return torch.tensor(used, dtype=current_kl.dtype, device=current_kl.device)


@dataclass
class PresetKLCoefficients:
    """Reward-side KL coefficients fixed in advance, one per packed step in order: a distributed
    recompute chains the adaptive controller over every step first (from each step's
    :func:`reward_kl`), then recomputes a pack with its steps' coefficients. Same interface as
    :class:`KLControllerState`."""

    values: list[float]

    def advance(self, settings: EngineSettings, current_kl: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if len(self.values) != current_kl.numel():
            raise ValueError(f"{len(self.values)} preset KL coefficients for {current_kl.numel()} steps")
        return torch.tensor(self.values, dtype=current_kl.dtype, device=current_kl.device)


@dataclass
class Result:
    """What a recompute of one packed batch produced."""

    steps: list[int]
    metrics: dict[str, torch.Tensor]  # name -> (n_steps,)
    tokens: dict[str, torch.Tensor]  # name -> (tokens,), the batch's packed layout
    failed: dict[int, str] = field(default_factory=dict)  # run step -> message


def _require(batch: Batch, name: str, why: str) -> torch.Tensor:
    t = getattr(batch, name)
    if t is None:
        raise MissingInputError(f"{why} needs column {name!r}, which the batch does not have", column=name)
    return t


def initial_kl_state(settings: EngineSettings) -> KLControllerState:
    kind = settings["algorithm.kl_ctrl.type"]
    if kind not in ("fixed", "adaptive"):
        from rldiag.errors import UnknownKeyError

        raise UnknownKeyError("KL controller type", kind, ["fixed", "adaptive"])
    if kind == "adaptive" and not float(settings["algorithm.kl_ctrl.horizon"]) > 0:
        from rldiag.errors import ConfigError

        raise ConfigError("algorithm.kl_ctrl.horizon must be > 0 for the adaptive KL controller")
    return KLControllerState(float(settings["algorithm.kl_ctrl.kl_coef"]))


def _combine_policy_loss(out: PolicyLossOutput, segs: Segmentation, errors: StepErrors) -> dict[str, torch.Tensor]:
    """Per-segment policy-loss results -> per-step metrics as verl logs them: ``actor/pg_loss``
    summed over a step's micro-batches (global normalisation), verl's metrics averaged with equal
    weight, rldiag's counts summed. Segments on which verl raises fail their step."""
    for message, bad in out.failed.items():
        errors.flag(segs.total(bad.float()) > 0, message)
    combined = {"actor/pg_loss": segs.loss(out.pg_loss)}
    combined.update({k: segs.mean(v) for k, v in out.metrics.items()})
    combined.update({k: segs.total(v) for k, v in out.sums.items()})
    return combined


def recompute_batch(
    batch: Batch, settings: EngineSettings, kl_state: KLControllerState | PresetKLCoefficients | None = None
) -> Result:
    """Recompute everything rldiag derives for the steps packed in ``batch``."""
    errors = StepErrors(batch.steps)
    n, sid, rows = batch.n_steps, batch.step_ids, batch.rows
    metrics: dict[str, torch.Tensor] = {}
    tokens: dict[str, torch.Tensor] = {}
    mask0 = original_mask(batch)
    scores = batch.token_level_scores
    rows_per_step = seg_count(sid, n)

    # 0. bypass mode: the rollout policy is the PPO anchor
    bypass = bool(settings["algorithm.rollout_correction.bypass_mode"])
    old_lp = anchor_log_probs(batch, settings)

    # 1. reward-side KL shaping on the original mask
    if settings["algorithm.use_kl_in_reward"]:
        kld, current_kl = reward_kl(batch, settings)
        state = kl_state or initial_kl_state(settings)
        beta = state.advance(settings, current_kl, rows_per_step)
        rewards = scores - rows.expand(beta[sid]) * kld
        metrics["actor/reward_kl_penalty"] = current_kl
        metrics["actor/reward_kl_penalty_coeff"] = beta
    else:
        rewards = scores

    # 2. rollout correction: IS weights, rejection rewrites the mask (rewards stay)
    mask, is_weights = mask0, None
    if batch.rollout_log_probs is not None and not bypass:
        cfg = CorrectionConfig.from_settings(settings, "algorithm.rollout_correction")
        if old_lp is None:
            if cfg.active:
                _require(batch, "old_log_probs", "algorithm.rollout_correction (rollout_is / rollout_rs)")
        else:
            rc = correct(old_lp, batch.rollout_log_probs, mask0, cfg, rows, sid, n)
            for message, bad in rc.failed.items():
                errors.flag(bad, message)
            mask, is_weights = rc.mask, rc.weights
            metrics.update(rc.metrics)
            if is_weights is not None:
                tokens["rollout_is_weights"] = is_weights

    # 3. advantages (gae reads the critic's values: verl builds no critic when need_critic is false)
    use_critic = settings.uses_critic
    if settings.estimator == "gae" and not use_critic:
        errors.flag_all("algorithm.adv_estimator=gae needs the critic's values, but critic.enable=false "
                        "(verl's need_critic: the trainer builds no critic); set critic.enable=true or null")
    adv, ret = estimate(
        settings.estimator, AdvInput(batch, rewards, mask, settings, errors, rollout_is_weights=is_weights)
    )
    tokens.update(advantages=adv, returns=ret, token_level_rewards=rewards, response_mask=mask)

    # 4. metrics
    metrics.update(data_metrics(batch, rewards, adv, ret, mask, use_critic))
    seq_len = batch.lengths if batch.prompt_length is None else batch.lengths + batch.prompt_length.to(batch.lengths.dtype)
    segs, critic_segs = segmentations_for(sid, n, settings, seq_len, list(batch.steps), batch.extra.get("batch_position"))
    for message, bad in {**segs.failed, **critic_segs.failed}.items():
        errors.flag(bad.to(sid.device), message)
    # seq-mean-token-sum-norm's fallback divisor: the V1 trainer pads per micro-batch (its longest
    # row); the legacy one to data.max_response_length (else the step's longest row)
    use_v1 = settings["trainer.use_v1"]
    fixed_width = not (settings.has("v1_trainer") if use_v1 is None else use_v1)
    count_mask = mask0
    token_count = step_mask_count(count_mask, rows, sid, n)

    def global_norm_of(s: Segmentation) -> AggNorm:
        return AggNorm(
            seg_ids=s.seg_ids,
            n_seg=s.n_seg,
            horizon=s.horizon(batch.lengths, batch.max_response_length, fixed_width),
            rows=rows,
            batch_num_tokens=s.normaliser(rows.sum(count_mask.to(torch.float32)), token_count),
            global_batch_size=s.batch_size(),  # the mini-batch's rows, V1's padding rows included
            loss_scale_factor=settings["actor_rollout_ref.actor.loss_scale_factor"],
        )

    actor_norm = global_norm_of(segs)
    agg_mode = settings.actor_agg_mode
    if batch.log_probs is not None and old_lp is not None:
        out = policy_loss(
            settings["actor_rollout_ref.actor.policy_loss.loss_mode"],
            PolicyLossInput(
                old_log_prob=old_lp,
                log_prob=batch.log_probs,
                advantages=adv,
                mask=mask,
                agg_mode=agg_mode,
                norm=actor_norm,
                settings=settings,
                rollout_is_weights=is_weights,
                dp_size=segs.dp_size,
            ),
        )
        metrics.update(_combine_policy_loss(out, segs, errors))
        tokens.update(ratio=out.ratio, pg_losses=out.pg_losses)
    if batch.entropy is not None:
        metrics["actor/entropy_loss"] = segs.loss(aggregate(agg_mode, batch.entropy, mask, actor_norm))
    if settings["actor_rollout_ref.actor.use_kl_loss"] and batch.ref_log_prob is not None and batch.log_probs is not None:
        kld = kl_estimate(settings["actor_rollout_ref.actor.kl_loss_type"], batch.log_probs, batch.ref_log_prob)
        metrics["actor/kl_loss"] = segs.loss(aggregate(agg_mode, kld, mask, actor_norm))
        metrics["actor/kl_coef"] = torch.full((n,), float(settings["actor_rollout_ref.actor.kl_loss_coef"]), device=sid.device)
    if use_critic and batch.vpreds is not None and batch.values is not None:
        global_norm = settings.has("critic_global_norm")
        if global_norm:
            # verl >= 0.9.0 (commit 2eb020aa9): the actor's global normalisers (original-mask token
            # count, batch size) with the critic's own loss_scale_factor; vf_loss is a SUM metric
            base = actor_norm if critic_segs is segs else global_norm_of(critic_segs)
            critic_norm = replace(base, loss_scale_factor=settings.critic_loss_scale_factor)
        else:
            # verl 0.8.0: every normaliser is the micro-batch's own; the metrics are micro-batch means
            critic_norm = AggNorm(seg_ids=critic_segs.seg_ids, n_seg=critic_segs.n_seg, rows=rows,
                                  horizon=critic_segs.horizon(batch.lengths, batch.max_response_length, fixed_width))
        vf = value_loss(
            batch.vpreds, batch.values, ret, mask, float(settings["critic.cliprange_value"]),
            settings.critic_agg_mode, critic_norm,
        )
        metrics.update({k: critic_segs.mean(v) for k, v in vf.items()})
        if global_norm:
            metrics["critic/vf_loss"] = critic_segs.loss(vf["critic/vf_loss"])

    if "actor/pg_loss" in metrics:
        # the update's total loss (verl's actor/loss, summed over micro-batches like its parts)
        total = metrics["actor/pg_loss"]
        if "actor/entropy_loss" in metrics:
            total = total - float(settings["actor_rollout_ref.actor.entropy_coeff"]) * metrics["actor/entropy_loss"]
        if "actor/kl_loss" in metrics:
            total = total + metrics["actor/kl_coef"] * metrics["actor/kl_loss"]
        metrics["actor/loss"] = total
    if not bypass:
        # logged where verl recomputes pi_old (_compute_old_log_prob; skipped in bypass mode), on
        # the original mask: the old policy's entropy aggregated over the whole step, and the
        # rollout engine's probabilities against the trainer's
        if batch.entropy is not None:
            step_norm = AggNorm(seg_ids=sid, n_seg=n, horizon=batch.max_response_length if fixed_width else
                                seg_max(batch.lengths.to(torch.float32), sid, n), rows=rows,
                                loss_scale_factor=settings["actor_rollout_ref.actor.loss_scale_factor"])
            metrics["actor/entropy"] = aggregate(agg_mode, batch.entropy, mask0, step_norm)
        if batch.rollout_log_probs is not None and batch.old_log_probs is not None:
            metrics.update(rollout_probs_metrics(batch.old_log_probs, batch.rollout_log_probs, mask0, rows, sid, n))

    # rldiag's own: reference KL of the old and current policy side by side, group signal
    if batch.ref_log_prob is not None:
        count = step_mask_count(mask, rows, sid, n) + MEAN_EPS
        for who, lp in (("old", old_lp), ("current", batch.log_probs)):
            if lp is None:
                continue
            sums, d = kl_row_sums(lp, batch.ref_log_prob, mask, rows)
            for est, row_sum in sums.items():
                metrics[f"rldiag/ref_kl/{who}/{est}"] = seg_sum(row_sum, sid, n) / count
            if who == "old":
                penalty = settings["algorithm.kl_penalty"]
                same = KL_ESTIMATORS.get(penalty) is kl_k1
                tokens["ref_kl"] = d if same else kl_estimate(penalty, lp, batch.ref_log_prob)
    seq_scores = rows.sum(rewards)
    _, gstd, gcnt = seg_std(seq_scores, batch.group_ids, batch.n_groups)
    group_step = torch.zeros(batch.n_groups, dtype=torch.long, device=sid.device).index_copy_(0, batch.group_ids, sid)
    multi = gcnt > 1
    flat = multi & (gstd == 0)
    metrics["rldiag/groups/count"] = seg_count(group_step, n)
    metrics["rldiag/groups/no_signal_fraction"] = seg_sum(flat.float(), group_step, n) / seg_sum(multi.float(), group_step, n)
    metrics["rldiag/groups/singleton_fraction"] = seg_sum((gcnt == 1).float(), group_step, n) / seg_count(group_step, n)
    metrics["rldiag/advantages/positive_fraction"] = seg_sum(rows.masked_positive_count(adv, mask), sid, n) / (
        step_mask_count(mask, rows, sid, n) + MEAN_EPS
    )
    metrics.update(signal_metrics(batch, rewards, adv, mask, bool(settings["algorithm.use_kl_in_reward"]),
                                  mask_resets_return=not settings.has("reinforce_pp_carry")))
    return Result(steps=list(batch.steps), metrics=metrics, tokens=tokens, failed=errors.failed())
