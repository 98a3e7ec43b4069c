"""Actor and critic updates over PPO mini-batches, with verl's metric averaging.

Rows are taken in batch order (no shuffle), ``mini_rows`` at a time; each mini-batch is one
micro-batch and one optimizer step. A metric is the equal-weight mean over micro-batches
(verl's ``reduce_metrics``); the token-mean loss of a micro-batch divides by the mini-batch's
token count (verl's global ``batch_num_tokens``, here with one data-parallel rank).

The per-token ``log_probs`` / ``entropy`` / ``vpreds`` returned are those of the forward that
updated on each token (the last epoch's, when ``ppo_epochs > 1``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from rldiag.toy.algos import clipped_value_loss, kl_penalty, masked_mean, token_mean, vanilla_policy_loss
from rldiag.toy.config import ToyConfig
from rldiag.toy.model import response_logprobs, response_values


@dataclass
class StepTensors:
    """What the updates read, ``B`` rows: ``(B, P + R)`` input_ids / attention_mask, the rest ``(B, R)``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    ref_log_prob: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


@dataclass
class UpdateOut:
    tokens: dict[str, torch.Tensor]  # name -> (B, R)
    metrics: dict[str, float]


def _mini_batches(rows: int, size: int, epochs: int):
    for _ in range(epochs):
        for start in range(0, rows, size):
            yield slice(start, min(start + size, rows))


def _step(module: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, grad_clip: float) -> float:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), grad_clip)
    if torch.isfinite(norm):
        opt.step()
    return float(norm)


def update_actor(policy: nn.Module, opt: torch.optim.Optimizer, data: StepTensors, cfg: ToyConfig) -> UpdateOut:
    """PPO actor update: clipped surrogate - entropy bonus (+ KL loss). Tokens: log_probs, entropy."""
    log_probs = torch.zeros_like(data.old_log_probs)
    entropy = torch.zeros_like(data.old_log_probs)
    per_mb: dict[str, list[float]] = defaultdict(list)
    clip_high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
    policy.train()
    for sl in _mini_batches(data.responses.shape[0], cfg.mini_batch_rows, cfg.ppo_epochs):
        mask = data.response_mask[sl].float()
        n_tokens = mask.sum()
        logits = policy(data.input_ids[sl], data.attention_mask[sl])
        lp, ent = response_logprobs(logits, data.responses[sl], cfg.temperature)
        pg_loss, pg_metrics = vanilla_policy_loss(
            data.old_log_probs[sl], lp, data.advantages[sl], mask, cfg.clip_ratio, clip_high, cfg.clip_ratio_c, n_tokens
        )
        entropy_loss = token_mean(ent, mask, n_tokens)
        loss = pg_loss - cfg.entropy_coeff * entropy_loss
        if cfg.use_kl_loss:
            assert data.ref_log_prob is not None, "the KL loss needs the reference log-probs"
            kl_loss = token_mean(kl_penalty(lp, data.ref_log_prob[sl], cfg.kl_loss_type), mask, n_tokens)
            loss = loss + cfg.kl_loss_coef * kl_loss
            per_mb["actor/kl_loss"].append(kl_loss.item())
            per_mb["actor/kl_coef"].append(cfg.kl_loss_coef)
        per_mb["actor/grad_norm"].append(_step(policy, opt, loss, cfg.grad_clip))
        per_mb["actor/pg_loss"].append(pg_loss.item())
        per_mb["actor/entropy_loss"].append(entropy_loss.item())
        for k, v in pg_metrics.items():
            per_mb[f"actor/{k}"].append(v.item())
        log_probs[sl] = lp.detach()
        entropy[sl] = ent.detach()
    metrics = {k: sum(v) / len(v) for k, v in per_mb.items()}
    metrics["actor/lr"] = opt.param_groups[0]["lr"]
    return UpdateOut(tokens={"log_probs": log_probs, "entropy": entropy}, metrics=metrics)


def update_critic(critic: nn.Module, opt: torch.optim.Optimizer, data: StepTensors, cfg: ToyConfig) -> UpdateOut:
    """Clipped value regression on the returns. Tokens: vpreds."""
    width = data.responses.shape[1]
    values, returns = data.values, data.returns
    assert values is not None and returns is not None, "the critic update needs values and returns"
    vpreds_all = torch.zeros_like(values)
    per_mb: dict[str, list[float]] = defaultdict(list)
    critic.train()
    for sl in _mini_batches(data.responses.shape[0], cfg.mini_batch_rows, cfg.ppo_epochs):
        mask = data.response_mask[sl].float()
        vpreds = response_values(critic(data.input_ids[sl], data.attention_mask[sl]), width)
        vf_loss, vf_clipfrac = clipped_value_loss(vpreds, values[sl], returns[sl], mask, cfg.cliprange_value)
        per_mb["critic/grad_norm"].append(_step(critic, opt, vf_loss, cfg.grad_clip))
        per_mb["critic/vf_loss"].append(vf_loss.item())
        per_mb["critic/vf_clipfrac"].append(vf_clipfrac.item())
        per_mb["critic/vpred_mean"].append(masked_mean(vpreds.detach(), mask).item())
        vpreds_all[sl] = vpreds.detach()
    metrics = {k: sum(v) / len(v) for k, v in per_mb.items()}
    metrics["critic/lr"] = opt.param_groups[0]["lr"]
    return UpdateOut(tokens={"vpreds": vpreds_all}, metrics=metrics)
