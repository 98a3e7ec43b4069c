"""Small worked examples, computed by hand, reproduced exactly: GAE, GRPO, RLOO, the PPO loss and
its dual clip, the aggregation modes, the clipped value loss and KL reward shaping (the verl
functions each follows are named in the tests)."""

from __future__ import annotations

import math

import pytest
import torch

from rldiag.engine.aggregation import AggNorm, aggregate
from rldiag.engine.critic import value_loss
from rldiag.engine.policy_loss import PolicyLossInput, policy_loss
from tests.conftest import make_batch, settings
from tests.engine.packing import full_rows, recompute_padded


def test_gae_worked_example_raw_advantages_and_returns():
    # verl compute_gae_advantage_return: r=[0,0,1], V=[0.2,0.3,0.4], gamma 1, lambda 0.95
    from rldiag.engine.advantage import gae_scan
    from rldiag.engine.layout import Rows

    raw = gae_scan(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.2, 0.3, 0.4]), torch.ones(3), 1.0, 0.95,
                    Rows.from_lengths(torch.tensor([3])))
    assert raw.tolist() == pytest.approx([0.7365, 0.67, 0.6], abs=1e-6)
    b = make_batch(scores=[[0, 0, 1.0]], mask=[[1, 1, 1]], values=[[0.2, 0.3, 0.4]])
    r = recompute_padded(b, settings(estimator="gae", lam=0.95))
    assert r.tokens["returns"][0].tolist() == pytest.approx([0.9365, 0.97, 1.0], abs=1e-6)
    # whitened over the 3 tokens: mean 0, Bessel variance 1 (up to the 1e-8 inside the sqrt)
    adv = r.tokens["advantages"][0]
    # float32 values ~0.7 scaled by 1/std ~ 15: the whitened mean is 0 to about 1e-6
    assert float(adv.mean()) == pytest.approx(0.0, abs=3e-6)
    assert float(adv.var(unbiased=True)) == pytest.approx(1.0, abs=1e-5)
    raw_t = torch.tensor([0.7365, 0.67, 0.6])
    expect = (raw_t - raw_t.mean()) / torch.sqrt(raw_t.var(unbiased=True) + 1e-8)
    assert adv.tolist() == pytest.approx(expect.tolist(), abs=1e-5)


def test_gae_skips_tool_tokens():
    # GAE skips mask-0 positions: position 1 is a tool observation; position 0 still sees position 2
    from rldiag.engine.advantage import gae_scan
    from rldiag.engine.layout import Rows

    raw = gae_scan(
        torch.tensor([0.0, 5.0, 1.0]), torch.tensor([0.2, 9.0, 0.4]), torch.tensor([1.0, 0.0, 1.0]), 1.0, 1.0,
        Rows.from_lengths(torch.tensor([3])),
    ).unsqueeze(0)
    # A2 = 1 - 0.4 = 0.6; A0 = 0 + 0.4 - 0.2 + 0.6 = 0.8 (tool reward 5 and value 9 ignored)
    assert raw[0, 2].item() == pytest.approx(0.6)
    assert raw[0, 0].item() == pytest.approx(0.8)
    assert raw[0, 1].item() == pytest.approx(0.6)  # carried, not updated


def test_grpo_example_and_masked_broadcast():
    # verl compute_grpo_outcome_advantage: R = [1, 0, 0.5] -> ~[0.999998, -0.999998, 0]; row 0 mask [1,1,0,0,1]
    b = make_batch(
        scores=[[0, 0, 0, 0, 1.0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0.5]],
        mask=[[1, 1, 0, 0, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]],
        uids=["A", "A", "A"],
    )
    r = recompute_padded(b, settings(estimator="grpo"))
    adv = r.tokens["advantages"]
    a = 0.5 / (0.5 + 1e-6)
    assert adv[0].tolist() == pytest.approx([a, a, 0, 0, a], abs=1e-7)
    assert adv[1].tolist() == pytest.approx([-a] * 5, abs=1e-7)
    assert adv[2].tolist() == pytest.approx([0.0] * 5, abs=1e-7)
    assert a == pytest.approx(0.999998, abs=1e-6)
    assert torch.equal(r.tokens["returns"], adv)


def test_grpo_two_groups_and_dr_grpo():
    # two GRPO groups: A [1, 0, 0.5], B all zero -> B gets no signal
    b = make_batch(
        scores=[[1.0], [0.0], [0.5], [0.0], [0.0], [0.0]], mask=[[1]] * 6, uids=["A"] * 3 + ["B"] * 3
    )
    r = recompute_padded(b, settings(estimator="grpo"))
    assert r.tokens["advantages"][3:].abs().max().item() == 0.0
    assert r.metrics["rldiag/groups/no_signal_fraction"].item() == pytest.approx(0.5)
    r2 = recompute_padded(b, settings(estimator="grpo", norm_by_std=False))
    assert r2.tokens["advantages"][:3, 0].tolist() == pytest.approx([0.5, -0.5, 0.0])


def test_grpo_singleton_group_keeps_score():
    # compute_grpo_outcome_advantage: a group of one uses mean 0, std 1 -> score / (1 + 1e-6)
    b = make_batch(scores=[[0.0, 2.0]], mask=[[1, 1]], uids=["solo"])
    r = recompute_padded(b, settings(estimator="grpo"))
    assert r.tokens["advantages"][0].tolist() == pytest.approx([2.0 / (1 + 1e-6)] * 2)


def test_rloo_example_and_singleton():
    # verl compute_rloo_outcome_advantage: R = [1, 0, 0.5] -> [0.75, -0.75, 0]; singleton keeps raw score
    b = make_batch(scores=[[1.0], [0.0], [0.5], [3.0]], mask=[[1]] * 4, uids=["A", "A", "A", "S"])
    r = recompute_padded(b, settings(estimator="rloo"))
    assert r.tokens["advantages"][:, 0].tolist() == pytest.approx([0.75, -0.75, 0.0, 3.0], abs=1e-6)


def _vanilla(old, new, adv, mask=None, **kw):
    old_t, new_t, adv_t = (torch.tensor([x], dtype=torch.float32) for x in (old, new, adv))
    mask_t = torch.ones_like(old_t) if mask is None else torch.tensor([mask], dtype=torch.float32)
    width = old_t.shape[1]
    (old_t, new_t, adv_t, mask_t), layout = full_rows(old_t, new_t, adv_t, mask_t)
    norm = AggNorm(seg_ids=torch.zeros(1, dtype=torch.long), n_seg=1, horizon=torch.tensor([width]), rows=layout)
    return policy_loss(
        "vanilla",
        PolicyLossInput(old_log_prob=old_t, log_prob=new_t, advantages=adv_t, mask=mask_t,
                        agg_mode="token-mean", norm=norm, settings=settings(**kw)),
    )


def test_ratio_example_positive_and_negative_advantage():
    # verl compute_policy_loss_vanilla: old -1.2, new -1.0 -> ratio e^0.2 = 1.2214
    pos = _vanilla([-1.2], [-1.0], [1.0])
    assert pos.ratio.item() == pytest.approx(math.exp(0.2), rel=1e-6)
    assert pos.ratio.item() == pytest.approx(1.221, abs=5e-4)
    assert pos.pg_loss.item() == pytest.approx(-1.2, rel=1e-6)  # clipped at 1 + 0.2
    assert pos.metrics["actor/pg_clipfrac"].item() == pytest.approx(1.0, abs=1e-7)
    neg = _vanilla([-1.2], [-1.0], [-1.0])
    assert neg.pg_loss.item() == pytest.approx(math.exp(0.2), rel=1e-6)  # not clipped: 1.221
    assert neg.metrics["actor/pg_clipfrac"].item() == 0.0
    assert pos.metrics["actor/ppo_kl"].item() == pytest.approx(-0.2, rel=1e-5)


def test_dual_clip_example():
    # dual clip (compute_policy_loss_vanilla, arXiv:1912.09729): A = -2, ratio 5 -> loss 10 capped at 3 * 2 = 6
    out = _vanilla([0.0], [math.log(5.0)], [-2.0])
    assert out.pg_loss.item() == pytest.approx(6.0, rel=1e-6)
    assert out.metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(1.0, abs=1e-7)
    loose = _vanilla([0.0], [math.log(5.0)], [-2.0], clip_c=10.0)
    assert loose.pg_loss.item() == pytest.approx(10.0, rel=1e-5)
    assert loose.metrics["actor/pg_clipfrac_lower"].item() == 0.0


def test_asymmetric_clip_uses_high_bound():
    out = _vanilla([0.0], [math.log(1.5)], [1.0], clip_low=0.2, clip_high=0.28)
    assert out.pg_loss.item() == pytest.approx(-1.28, rel=1e-6)


def test_log_ratio_clamp_at_20():
    out = _vanilla([0.0], [50.0], [1.0])
    assert out.ratio.item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert out.metrics["actor/ppo_kl"].item() == pytest.approx(-20.0, rel=1e-6)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 1.8),
        ("token-sum", 18.0),
        ("seq-mean-token-sum", 9.0),
        ("seq-mean-token-sum-norm", 1.125),
        ("seq-mean-token-mean", 3.0),
    ],
)
def test_aggregation_example(mode, expected):
    # verl agg_loss, the four modes: A has 8 tokens of loss 1, B 2 tokens of loss 5; horizon 8
    (loss, mask), layout = full_rows(torch.tensor([[1.0] * 8, [5.0, 5.0] + [0.0] * 6]),
                                     torch.tensor([[1.0] * 8, [1.0, 1.0] + [0.0] * 6]))
    norm = AggNorm(seg_ids=torch.zeros(2, dtype=torch.long), n_seg=1, horizon=torch.tensor([8]), rows=layout)
    assert aggregate(mode, loss, mask, norm).item() == pytest.approx(expected, rel=1e-6)


def test_seq_mean_excludes_fully_masked_rows_in_fallback_denominator():
    (loss, mask), layout = full_rows(torch.tensor([[2.0, 2.0], [7.0, 7.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    norm = AggNorm(seg_ids=torch.zeros(2, dtype=torch.long), n_seg=1, horizon=torch.tensor([2]), rows=layout)
    assert aggregate("seq-mean-token-mean", loss, mask, norm).item() == pytest.approx(2.0)
    with_b = AggNorm(seg_ids=norm.seg_ids, n_seg=1, horizon=norm.horizon, rows=layout,
                     global_batch_size=torch.tensor([2.0]))
    assert aggregate("seq-mean-token-mean", loss, mask, with_b).item() == pytest.approx(1.0)


def test_value_loss_example():
    # verl compute_value_loss: old 0.4, new 0.9, return 1.0, cliprange 0.2 -> 0.5 * max(0.01, 0.16) = 0.08
    t = lambda x: torch.tensor([x])  # noqa: E731
    layout = full_rows(torch.zeros(1, 1))[1]
    norm = AggNorm(seg_ids=torch.zeros(1, dtype=torch.long), n_seg=1, horizon=torch.tensor([1]), rows=layout)
    out = value_loss(t(0.9), t(0.4), t(1.0), t(1.0), 0.2, "token-mean", norm)
    assert out["critic/vf_loss"].item() == pytest.approx(0.08, rel=1e-6)
    assert out["critic/vf_clipfrac"].item() == pytest.approx(1.0, abs=1e-7)
    assert out["critic/vpred_mean"].item() == pytest.approx(0.9, rel=1e-6)


def test_kl_reward_shaping_example():
    # verl apply_kl_penalty (ray_trainer.py): scores [0,0,1], kld [0.1,0.2,0.3], beta 0.01 -> [-0.001,-0.002,0.997]
    b = make_batch(
        scores=[[0, 0, 1.0]], mask=[[1, 1, 1]],
        old_log_probs=[[0.1, 0.2, 0.3]], ref_log_prob=[[0.0, 0.0, 0.0]],
    )
    s = settings(estimator="grpo", **{"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 0.01})
    r = recompute_padded(b, s)
    assert r.tokens["token_level_rewards"][0].tolist() == pytest.approx([-0.001, -0.002, 0.997], abs=1e-7)
    assert r.metrics["actor/reward_kl_penalty"].item() == pytest.approx(0.2, rel=1e-6)
    assert r.metrics["actor/reward_kl_penalty_coeff"].item() == pytest.approx(0.01)
    assert r.metrics["critic/rewards/mean"].item() == pytest.approx(0.994, rel=1e-6)
    assert r.metrics["critic/score/mean"].item() == pytest.approx(1.0)


def test_kl_shaping_ignores_tool_tokens():
    b = make_batch(
        scores=[[0, 0, 1.0]], mask=[[1, 0, 1]],
        old_log_probs=[[0.1, 5.0, 0.3]], ref_log_prob=[[0.0, 0.0, 0.0]],
    )
    s = settings(estimator="grpo", **{"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 0.01})
    r = recompute_padded(b, s)
    assert r.tokens["token_level_rewards"][0].tolist() == pytest.approx([-0.001, 0.0, 0.997], abs=1e-7)
    assert r.metrics["actor/reward_kl_penalty"].item() == pytest.approx(0.2, rel=1e-5)
