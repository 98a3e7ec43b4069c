"""The toy on-policy RL trainer: one step in verl V1's order, and the training loop.

One step (``PPOTrainer._step_once``'s order): sample prompts, roll out ``n`` responses each on
the bfloat16 rollout engine (tool turns included), score them, recompute ``old_log_probs`` with
the float32 actor, ``ref_log_prob`` with the frozen reference, ``values`` with the critic;
reward-side KL shaping (optional); advantages (GAE or GRPO); critic update; actor update;
metrics. With ``max_lag``, each prompt group is rolled out on the engine of 0..max_lag updates
ago (an asynchronous trainer's staleness), its ``max_global_steps`` / ``min_global_steps`` (the
capture's ``policy_version``) saying which. The step's batch is handed to :class:`rldiag.capture.RunWriter` as a verl
``DataProto``-like object, exactly as a verl trainer would hand its own.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from rldiag.capture import CaptureStats, RunWriter
from rldiag.capture.health import HealthHook, build_hook
from rldiag.capture.health import log as health_log
from rldiag.toy.algos import gae_advantages, grpo_advantages, kl_penalty, masked_mean
from rldiag.toy.config import ToyConfig
from rldiag.toy.metrics import data_metrics
from rldiag.toy.model import TinyTransformer, response_logprobs, response_values
from rldiag.toy.rollout import Rollout, generate, merge_rollouts, rollout_engine
from rldiag.toy.task import DIGITS, VOCAB, Prompts, ToyTokenizer, sample_prompts, score_responses, with_tool_failures
from rldiag.toy.update import StepTensors, update_actor, update_critic


@dataclass
class StepResult:
    """One trained step: the batch (DataProto-like: ``.batch`` tensors, ``.non_tensor_batch``)
    and the metrics the trainer logs for it."""

    step: int
    batch: SimpleNamespace
    metrics: dict[str, float]


@dataclass
class RunSummary:
    step_seconds: list[float] = field(default_factory=list)  # wall time per step, capture included
    capture: CaptureStats | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)
    health_seconds: list[float] = field(default_factory=list)  # the doctor's time per step, training thread
    stopped_after: int | None = None  # the step after which the doctor stopped training


class ToyTrainer:
    """Policy, frozen reference, optional critic, optimizers and random streams of one run."""

    def __init__(self, cfg: ToyConfig):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        max_len = cfg.max_prompt_length + cfg.max_response_length
        dims = dict(vocab=VOCAB, d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers, max_len=max_len)
        self.policy = TinyTransformer(**dims, head="lm")
        self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.actor_opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.actor_lr, weight_decay=0.01)
        self.critic = TinyTransformer(**dims, head="value") if cfg.critic else None
        self.critic_opt = (torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic_lr, weight_decay=0.01)
                           if self.critic is not None else None)
        self.rng = np.random.default_rng(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.total_training_steps = cfg.steps  # the loop runs while step <= this (verl V1's condition)
        # the rollout engine's own random streams: its outlier kernel's faults, the rows' lags
        self.kernel_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
        self.lag_rng = np.random.default_rng(cfg.seed + 2_000_003)
        self.engines: deque[torch.nn.Module] = deque(maxlen=cfg.max_lag + 1)  # newest last

    def _rollout(self, prompts: Prompts, width: int) -> tuple[Rollout, np.ndarray | None]:
        """This step's rollout on the engine synced with the current weights, or with
        ``max_lag``: each prompt group on the weights of ``lag`` updates ago (drawn uniformly
        from 0..max_lag, at most the updates made so far), as an asynchronous trainer's
        rollouts are; returns the rows' lags ``(B,)`` (None without ``max_lag``)."""
        cfg = self.cfg
        self.engines.append(rollout_engine(self.policy))
        if not cfg.max_lag:
            return generate(self.engines[-1], prompts, width, self.gen, cfg.temperature, cfg.tool,
                            cfg.engine, self.kernel_gen), None
        group_lag = self.lag_rng.integers(0, len(self.engines), size=cfg.prompts_per_step)
        lag = np.repeat(group_lag, cfg.n)
        parts = []
        for k in np.unique(lag).tolist():
            rows = torch.from_numpy(np.flatnonzero(lag == k))
            parts.append((rows, generate(self.engines[-1 - k], prompts.select(rows), width, self.gen,
                                         cfg.temperature, cfg.tool, cfg.engine, self.kernel_gen)))
        return merge_rollouts(parts, len(lag)), lag

    def train_step(self, step: int) -> StepResult:
        cfg = self.cfg
        width = cfg.max_response_length
        prompts = sample_prompts(self.rng, cfg.prompts_per_step, cfg.min_digits, cfg.max_digits).repeat(cfg.n)
        prompts = with_tool_failures(prompts, self.rng, cfg.tool_failure)
        uids = np.array([f"s{step}-p{i}" for i in range(cfg.prompts_per_step) for _ in range(cfg.n)], dtype=object)
        ro, lag = self._rollout(prompts, width)
        score, exact = score_responses(ro.responses, ro.response_mask, ro.lengths, prompts, cfg.partial_credit)
        true_score = score
        if cfg.length_bonus:  # the reward pays for length too; the task's correctness (true_score) does not
            counted = ro.response_mask.bool() & (ro.responses < DIGITS) if cfg.bonus_digits_only else ro.response_mask.bool()
            score = score + cfg.length_bonus * counted.sum(-1).float() / width
        rows = torch.arange(score.shape[0])
        scores = torch.zeros((score.shape[0], width), dtype=torch.float32)
        scores[rows, (ro.lengths - 1).clamp_min(0)] = torch.where(ro.lengths > 0, score, 0.0)
        mask = ro.response_mask.float()

        with torch.no_grad():
            self.policy.eval()
            old_log_probs, _ = response_logprobs(self.policy(ro.input_ids, ro.attention_mask), ro.responses,
                                                 cfg.temperature)
            ref_log_prob, _ = response_logprobs(self.ref(ro.input_ids, ro.attention_mask), ro.responses,
                                                cfg.temperature)
            values = None
            if self.critic is not None:
                self.critic.eval()
                values = response_values(self.critic(ro.input_ids, ro.attention_mask), width)

        metrics: dict[str, float] = {}
        if cfg.use_kl_in_reward:
            kld = kl_penalty(old_log_probs, ref_log_prob, cfg.kl_penalty) * mask
            rewards = scores - cfg.kl_coef * kld
            metrics["actor/reward_kl_penalty"] = masked_mean(kld, mask, dim=-1).mean().item()
            metrics["actor/reward_kl_penalty_coeff"] = cfg.kl_coef
        else:
            rewards = scores
        if cfg.adv_estimator == "gae":
            assert values is not None, "gae trains a critic (ToyConfig.critic)"
            advantages, returns = gae_advantages(rewards, values, mask, cfg.gamma, cfg.lam)
        else:
            advantages, returns = grpo_advantages(rewards, mask, list(uids), cfg.norm_adv_by_std_in_grpo)

        data = StepTensors(ro.input_ids, ro.attention_mask, ro.responses, ro.response_mask, old_log_probs,
                           advantages, ref_log_prob, values, returns)
        tokens: dict[str, torch.Tensor] = {}
        if self.critic is not None and self.critic_opt is not None:  # both or neither
            out = update_critic(self.critic, self.critic_opt, data, cfg)
            tokens.update(out.tokens)
            metrics.update(out.metrics)
        out = update_actor(self.policy, self.actor_opt, data, cfg)
        tokens.update(out.tokens)
        metrics.update(out.metrics)
        metrics.update(data_metrics(scores, rewards, advantages, returns, mask, ro.attention_mask, values))
        metrics["task/exact_match"] = exact.float().mean().item()
        if cfg.length_bonus:
            metrics["rldiag/label/true_score"] = true_score.mean().item()
        metrics["task/tool_call_ratio"] = ro.tool_calls.float().mean().item()
        metrics["task/rollout_vs_old_abs_diff"] = masked_mean((ro.rollout_log_probs - old_log_probs).abs(), mask).item()

        batch = {
            "prompts": prompts.ids,
            "responses": ro.responses,
            "input_ids": ro.input_ids,
            "attention_mask": ro.attention_mask,
            "response_mask": ro.response_mask,
            "rm_scores": scores,
            "token_level_scores": scores,
            "token_level_rewards": rewards,
            "old_log_probs": old_log_probs,
            "ref_log_prob": ref_log_prob,
            "rollout_log_probs": ro.rollout_log_probs,
            "advantages": advantages,
            "returns": returns,
            **tokens,
        }
        if values is not None:
            batch["values"] = values
        non_tensor = {"uid": uids, "score": score.numpy().astype(np.float64)}
        if lag is not None:  # verl's agent loop: the number of updates the generating weights had seen
            non_tensor["max_global_steps"] = (step - 1 - lag).astype(np.int64)
            non_tensor["min_global_steps"] = non_tensor["max_global_steps"]
        return StepResult(step, SimpleNamespace(batch=batch, non_tensor_batch=non_tensor), metrics)

    def run(
        self,
        out_dir: str | Path | None,
        *,
        pace_s: float = 0.0,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
        queue_size: int = 8,
        doctor: bool = False,
        stop_at: int | None = None,
        rules_files: Sequence[str | Path] = (),
        writer_options: dict | None = None,
        health_options: dict | None = None,
    ) -> RunSummary:
        """Train ``cfg.steps`` steps, capturing each into ``out_dir`` (nothing is written when
        ``out_dir`` is None), with the text of every response and prompt token
        (``response_tokens``, ``prompt_tokens``: made on the capture's writer thread, outside
        training and its random streams). ``pace_s``: make each step last at least this long
        (live demos). ``doctor``: run the doctor's rules after each step as the verl capture
        does with ``RLDIAG_DOCTOR=1`` (:mod:`rldiag.capture.health`; needs ``out_dir``): the
        ``rldiag/health/*`` keys join the logged metrics; ``stop_at`` (1 warning, 2 critical):
        a finding that severe stops training after its step, by lowering
        ``self.total_training_steps`` as the verl capture lowers the trainer's; ``rules_files``:
        rules merged over the built-in ones (a file that cannot be read is warned and left out).

        The capture never stops nor holds up training (``RunWriter(on_error="warn")``, as the
        verl capture's): a fault is warned once and counted in the step's metrics
        (``rldiag/capture/dropped_steps``, ``rldiag/capture/errors``, from the first fault on);
        ``SIGTERM`` lets pending writes finish first. ``writer_options``: more ``RunWriter``
        keywords (``on_error``, ``max_queue_bytes``, ``max_wait_s``, ``wait_share``);
        ``health_options``: the doctor hook's (``wait_s``, ``slow_s``)."""
        options = {"on_error": "warn", "handle_sigterm": True, **(writer_options or {})}
        writer = (RunWriter(out_dir, config=self.cfg.verl_config(), queue_size=queue_size, tokenizer=ToyTokenizer(),
                            **options) if out_dir else None)
        hook: HealthHook | None = None
        if doctor and writer is not None:
            assert out_dir is not None  # a writer has a directory
            try:
                hook = build_hook(out_dir, writer.run_on_writer, stop_at=stop_at, rules_files=rules_files,
                                  **(health_options or {}))
            except Exception as exc:  # noqa: BLE001 - no doctor, but training and capture go on
                if writer.on_error == "raise":
                    raise
                health_log.warning("rldiag doctor: not started, training goes on without it: %s: %s",
                                   type(exc).__name__, exc)
        summary = RunSummary()
        step = 1
        try:
            while step <= self.total_training_steps:
                t0 = time.perf_counter()
                result = self.train_step(step)
                if writer is not None:
                    writer.write_batch(step, result.batch)
                    if hook is not None:
                        th = time.perf_counter()
                        result.metrics.update(hook.on_log(step, result.metrics))
                        if not writer.dropped(step):  # a dropped batch has nothing to recompute
                            hook.after_step(step)
                        summary.health_seconds.append(time.perf_counter() - th)
                        if hook.stop and summary.stopped_after is None:
                            health_log.warning(hook.stop_message(step))
                            summary.stopped_after = self.total_training_steps = step
                    result.metrics.update(writer.fault_metrics())
                    writer.log_metrics(step, result.metrics)
                    writer.sync()  # the end-of-step barrier, as the verl capture's (bounded: "warn")
                summary.step_seconds.append(time.perf_counter() - t0)
                summary.last_metrics = result.metrics
                if on_step is not None:
                    on_step(step, result.metrics)
                if pace_s > 0:
                    time.sleep(max(0.0, pace_s - (time.perf_counter() - t0)))
                step += 1
        finally:
            if hook is not None:
                hook.close()
            if writer is not None:
                writer.close()
                summary.capture = writer.stats
        return summary
