"""One recompute over a packed batch: the order of operations of verl's V1 trainer.

1. token_level_scores -> token_level_rewards: optional KL shaping on the *original*
   response_mask (``algorithm.use_kl_in_reward``; seed 002 section 4).
2. (rollout correction may rewrite response_mask; rewards at rejected tokens stay.)
3. The advantage estimator reads the rewritten mask.
4. Actor metrics (policy loss, entropy, KL loss), critic metrics, data metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rldiag.config.settings import Settings
from rldiag.engine.advantage import AdvInput, estimate
from rldiag.engine.aggregation import AggNorm, aggregate
from rldiag.engine.batch import Batch
from rldiag.engine.critic import value_loss
from rldiag.engine.errors import StepErrors
from rldiag.engine.kl import kl_estimate
from rldiag.engine.metrics import data_metrics
from rldiag.engine.policy_loss import PolicyLossInput, policy_loss
from rldiag.engine.segments import MEAN_EPS, seg_count, seg_mean, seg_std, seg_sum, step_mask_count, step_masked_mean
from rldiag.errors import MissingInputError


@dataclass
class KLControllerState:
    """The reward-side KL coefficient carried from step to step (verl's Fixed/Adaptive
    controllers; adaptive from Ziegler et al. 2019, arXiv:1909.08593)."""

    value: float

    def advance(self, settings: Settings, current_kl: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
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
class Result:
    """What a recompute of one packed batch produced."""

    steps: list[int]
    metrics: dict[str, torch.Tensor]  # name -> (n_steps,)
    tokens: dict[str, torch.Tensor]  # name -> (rows, tokens)
    failed: dict[int, str] = field(default_factory=dict)  # run step -> message


def _require(batch: Batch, name: str, why: str) -> torch.Tensor:
    t = getattr(batch, name)
    if t is None:
        raise MissingInputError(f"{why} needs column {name!r}, which the batch does not have", column=name)
    return t


def initial_kl_state(settings: Settings) -> KLControllerState:
    kind = settings["algorithm.kl_ctrl.type"]
    if kind not in ("fixed", "adaptive"):
        from rldiag.errors import UnknownKeyError

        raise UnknownKeyError("KL controller type", kind, ["fixed", "adaptive"])
    if kind == "adaptive" and not float(settings["algorithm.kl_ctrl.horizon"]) > 0:
        from rldiag.errors import ConfigError

        raise ConfigError("algorithm.kl_ctrl.horizon must be > 0 for the adaptive KL controller")
    return KLControllerState(float(settings["algorithm.kl_ctrl.kl_coef"]))


def recompute_batch(batch: Batch, settings: Settings, kl_state: KLControllerState | None = None) -> Result:
    """Recompute everything rldiag derives for the steps packed in ``batch``."""
    errors = StepErrors(batch.steps)
    n, sid = batch.n_steps, batch.step_ids
    metrics: dict[str, torch.Tensor] = {}
    tokens: dict[str, torch.Tensor] = {}
    mask0 = batch.response_mask
    scores = batch.token_level_scores
    rows_per_step = seg_count(sid, n)

    # 1. reward-side KL shaping on the original mask
    if settings["algorithm.use_kl_in_reward"]:
        old = _require(batch, "old_log_probs", "algorithm.use_kl_in_reward")
        ref = _require(batch, "ref_log_prob", "algorithm.use_kl_in_reward")
        kld = kl_estimate(settings["algorithm.kl_penalty"], old, ref) * mask0
        row_kl = (kld * mask0).sum(-1) / (mask0.sum(-1) + MEAN_EPS)
        current_kl = seg_mean(row_kl, sid, n)
        state = kl_state or initial_kl_state(settings)
        beta = state.advance(settings, current_kl, rows_per_step)
        rewards = scores - beta[sid].unsqueeze(-1) * kld
        metrics["actor/reward_kl_penalty"] = current_kl
        metrics["actor/reward_kl_penalty_coeff"] = beta
    else:
        rewards = scores

    # 2. rollout correction (rejection) would rewrite the mask here
    mask = mask0

    # 3. advantages
    adv, ret = estimate(settings.estimator, AdvInput(batch, rewards, mask, settings, errors))
    tokens.update(advantages=adv, returns=ret, token_level_rewards=rewards, response_mask=mask)

    # 4. metrics
    metrics.update(data_metrics(batch, rewards, adv, ret, mask))
    horizon = batch.max_response_length
    token_count = step_mask_count(batch.loss_mask if batch.loss_mask is not None else mask0, sid, n)
    actor_norm = AggNorm(
        step_ids=sid,
        n_steps=n,
        horizon=horizon,
        batch_num_tokens=token_count,
        global_batch_size=rows_per_step,
        loss_scale_factor=settings["actor_rollout_ref.actor.loss_scale_factor"],
    )
    agg_mode = settings.actor_agg_mode
    if batch.log_probs is not None and batch.old_log_probs is not None:
        out = policy_loss(
            settings["actor_rollout_ref.actor.policy_loss.loss_mode"],
            PolicyLossInput(
                old_log_prob=batch.old_log_probs,
                log_prob=batch.log_probs,
                advantages=adv,
                mask=mask,
                agg_mode=agg_mode,
                norm=actor_norm,
                settings=settings,
            ),
        )
        metrics["actor/pg_loss"] = out.pg_loss
        metrics.update(out.metrics)
        tokens.update(ratio=out.ratio, pg_losses=out.pg_losses)
    if batch.entropy is not None:
        metrics["actor/entropy_loss"] = aggregate(agg_mode, batch.entropy, mask, actor_norm)
    if settings["actor_rollout_ref.actor.use_kl_loss"] and batch.ref_log_prob is not None and batch.log_probs is not None:
        kld = kl_estimate(settings["actor_rollout_ref.actor.kl_loss_type"], batch.log_probs, batch.ref_log_prob)
        metrics["actor/kl_loss"] = aggregate(agg_mode, kld, mask, actor_norm)
        metrics["actor/kl_coef"] = torch.full((n,), float(settings["actor_rollout_ref.actor.kl_loss_coef"]))
    if batch.vpreds is not None and batch.values is not None:
        critic_norm = AggNorm(
            step_ids=sid, n_steps=n, horizon=horizon, loss_scale_factor=settings.critic_loss_scale_factor
        )
        metrics.update(
            value_loss(
                batch.vpreds, batch.values, ret, mask, float(settings["critic.cliprange_value"]),
                settings.critic_agg_mode, critic_norm,
            )
        )

    # rldiag's own: reference KL of the old and current policy side by side, group signal
    if batch.ref_log_prob is not None:
        if batch.old_log_probs is not None:
            tokens["ref_kl"] = kl_estimate(settings["algorithm.kl_penalty"], batch.old_log_probs, batch.ref_log_prob)
        for who, lp in (("old", batch.old_log_probs), ("current", batch.log_probs)):
            if lp is None:
                continue
            for est in ("k1", "k2", "k3"):
                metrics[f"rldiag/ref_kl/{who}/{est}"] = step_masked_mean(
                    kl_estimate(est, lp, batch.ref_log_prob), mask, sid, n
                )
    seq_scores = rewards.sum(-1)
    _, gstd, gcnt = seg_std(seq_scores, batch.group_ids, batch.n_groups)
    group_step = torch.zeros(batch.n_groups, dtype=torch.long, device=sid.device).index_copy_(0, batch.group_ids, sid)
    multi = gcnt > 1
    flat = multi & (gstd == 0)
    metrics["rldiag/groups/count"] = seg_count(group_step, n)
    metrics["rldiag/groups/no_signal_fraction"] = seg_sum(flat.float(), group_step, n) / seg_sum(multi.float(), group_step, n)
    metrics["rldiag/groups/singleton_fraction"] = seg_sum((gcnt == 1).float(), group_step, n) / seg_count(group_step, n)
    metrics["rldiag/advantages/positive_fraction"] = step_masked_mean((adv > 0).float(), mask, sid, n)
    return Result(steps=list(batch.steps), metrics=metrics, tokens=tokens, failed=errors.failed())
