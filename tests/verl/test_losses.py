"""Every policy loss and aggregation mode, the KL estimators (reward shaping and KL loss) and the
entropy loss of verl 0.9.1, called as verl's actor calls them on a whole step (one mini-batch,
one micro-batch, dp 1: global token count and batch size = the step's), against the actor/*
metrics of ``rldiag recompute``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.verl.harness import assert_close, in_rows, long_tail_table, padded, run_rldiag, write_run

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ACTOR = "actor_rollout_ref.actor."
POLICY_LOSS_MODES = sorted(core_algos.POLICY_LOSS_REGISTRY)


CLIP_COV_RATIO = 0.5


def actor_config(loss_mode: str, agg: str, **more) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1, loss_agg_mode=agg,
        clip_ratio_low=0.2, clip_ratio_high=0.28,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.05, clip_cov_ratio=CLIP_COV_RATIO), **more,
    )


def whole_step_info(mask: torch.Tensor) -> dict:
    """What verl's actor puts into ``config.global_batch_info`` for one mini-batch on one rank."""
    return dict(dp_size=1, batch_num_tokens=mask.sum(), global_batch_size=mask.shape[0], loss_scale_factor=None)


def _run(tmp_path, overrides, seed, steps=(1, 2)):
    rng = np.random.default_rng(seed)
    tables = [long_tail_table(rng, s) for s in steps]
    run = write_run(tmp_path / "run", tables, {"algorithm": {"adv_estimator": "grpo"}})
    metrics, tokens = run_rldiag(run, overrides)
    return tables, metrics, tokens


def test_every_verl_policy_loss_is_registered_in_rldiag():
    from rldiag.engine.policy_loss import POLICY_LOSSES

    assert set(POLICY_LOSS_MODES) <= set(POLICY_LOSSES.names())


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_mode", POLICY_LOSS_MODES)
def test_policy_loss_matches_verl(tmp_path, loss_mode, agg):
    overrides = {
        ACTOR + "policy_loss.loss_mode": loss_mode, ACTOR + "loss_agg_mode": agg,
        ACTOR + "clip_ratio_low": 0.2, ACTOR + "clip_ratio_high": 0.28, ACTOR + "policy_loss.dro_beta": 0.05,
        # clip_cov cuts k random candidates (torch.randperm): k above the candidate count cuts all
        ACTOR + "policy_loss.clip_cov_ratio": CLIP_COV_RATIO,
        # bypass_mode's correction block: what verl's PolicyLossConfig holds by default
        ACTOR + "policy_loss.rollout_correction.rollout_is": "sequence",
    }
    tables, metrics, tokens = _run(tmp_path, overrides, seed=AGG_MODES.index(agg) * 100 + POLICY_LOSS_MODES.index(loss_mode))
    for table in tables:
        step = int(table["step"][0].as_py())
        mask = padded(table, "response_mask")
        cfg = actor_config(loss_mode, agg)
        cfg.global_batch_info.update(whole_step_info(mask))
        loss, pg_metrics = core_algos.get_policy_loss_fn(loss_mode)(
            old_log_prob=padded(table, "old_log_probs"), log_prob=padded(table, "log_probs"),
            advantages=padded(tokens[step], "advantages"), response_mask=mask.bool(), loss_agg_mode=agg,
            config=cfg, rollout_is_weights=None,
        )
        got = metrics[step]
        assert_close(got["actor/pg_loss"], loss, f"{loss_mode}/{agg} actor/pg_loss, step {step}")
        for name, want in pg_metrics.items():
            name = name if name.startswith("actor/") else "actor/" + name  # the actor prefixes its metrics
            assert name in got, f"{loss_mode}: rldiag does not report {name}"
            assert_close(got[name], want, f"{loss_mode}/{agg} {name}, step {step}")


@pytest.mark.parametrize("kl_type", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k3+", "low_var_kl+", "k1+"])
def test_kl_estimators_in_reward_and_in_the_actor_loss(tmp_path, kl_type):
    overrides = {
        "algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": kl_type, "algorithm.kl_ctrl.kl_coef": 0.05,
        ACTOR + "use_kl_loss": True, ACTOR + "kl_loss_type": kl_type, ACTOR + "kl_loss_coef": 0.01,
    }
    tables, metrics, tokens = _run(tmp_path, overrides, seed=7 + len(kl_type))
    for table in tables:
        step = int(table["step"][0].as_py())
        mask = padded(table, "response_mask")
        old, cur, ref = (padded(table, c) for c in ("old_log_probs", "log_probs", "ref_log_prob"))
        # the trainer's apply_kl_penalty: rewards = scores - beta * kl_penalty(old, ref) * mask
        kld = core_algos.kl_penalty(old, ref, kl_type) * mask
        rewards = padded(table, "token_level_scores") - 0.05 * kld
        assert_close(padded(tokens[step], "token_level_rewards"), rewards, f"{kl_type} rewards", in_rows(table))
        info = whole_step_info(mask)
        kl_loss = core_algos.agg_loss(core_algos.kl_penalty(cur, ref, kl_type), mask.bool(), "token-mean", **info)
        assert_close(metrics[step]["actor/kl_loss"], kl_loss, f"{kl_type} actor/kl_loss")


@pytest.mark.parametrize("agg", AGG_MODES)
def test_entropy_loss_aggregation(tmp_path, agg):
    tables, metrics, _ = _run(tmp_path, {ACTOR + "loss_agg_mode": agg}, seed=31 + AGG_MODES.index(agg))
    for table in tables:
        step = int(table["step"][0].as_py())
        mask = padded(table, "response_mask")
        want = core_algos.agg_loss(padded(table, "entropy"), mask.bool(), agg, **whole_step_info(mask))
        assert_close(metrics[step]["actor/entropy_loss"], want, f"{agg} actor/entropy_loss")
