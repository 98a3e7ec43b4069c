"""One hand-checkable example per policy loss (numbers worked out in the comments)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rldiag.engine.aggregation import AggNorm
from rldiag.engine.policy_loss import POLICY_LOSSES, PolicyLossInput, policy_loss
from rldiag.errors import ConfigError, UnknownKeyError
from tests.conftest import settings
from tests.engine.packing import full_rows, to_padded

LOG = math.log


def run(loss, old, new, adv, mask=None, agg="token-mean", w=None, n_tokens=None, **kw):
    old_t, new_t, adv_t = (torch.tensor(x, dtype=torch.float32) for x in (old, new, adv))
    mask_t = torch.ones_like(old_t) if mask is None else torch.tensor(mask, dtype=torch.float32)
    n_rows, width = old_t.shape
    w_t = None if w is None else torch.tensor(w, dtype=torch.float32)
    (old_t, new_t, adv_t, mask_t, w_t), layout = full_rows(old_t, new_t, adv_t, mask_t, w_t)
    norm = AggNorm(
        seg_ids=torch.zeros(n_rows, dtype=torch.long), n_seg=1, horizon=torch.tensor([width]), rows=layout,
        batch_num_tokens=None if n_tokens is None else torch.tensor([float(n_tokens)]),
    )
    s = settings(agg=agg, **kw)
    inp = PolicyLossInput(
        old_log_prob=old_t, log_prob=new_t, advantages=adv_t, mask=mask_t, agg_mode=agg, norm=norm, settings=s,
        rollout_is_weights=w_t,
    )
    out = policy_loss(loss, inp)
    out.pg_losses, out.ratio = to_padded(out.pg_losses, layout), to_padded(out.ratio, layout)
    return out, {k: v.item() for k, v in out.metrics.items()}


def test_every_loss_mode_is_registered():
    assert POLICY_LOSSES.names() == sorted(
        ["vanilla", "gspo", "cispo", "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "sapo", "gpg",
         "dro", "bypass_mode", "up"]
    )
    with pytest.raises(UnknownKeyError, match="valid: bypass_mode, cispo"):
        POLICY_LOSSES.get("ppo")


def test_vanilla_is_weights_multiply_the_clipped_loss():
    # compute_policy_loss_vanilla: ratio e^0.2 = 1.221, A = +1 -> clipped loss -1.2; IS weight 0.5 -> -0.6
    out, m = run("vanilla", [[-1.2]], [[-1.0]], [[1.0]], w=[[0.5]])
    assert out.pg_loss.item() == pytest.approx(-0.6, rel=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(1.0, abs=1e-7)  # metrics ignore the weights
    assert m["actor/ppo_kl"] == pytest.approx(-0.2, rel=1e-5)


def test_up_drops_the_clip_for_positive_advantages():
    # A = +1, ratio 1.221: vanilla clips to -1.2, UP uses the self-anchored ratio 1 -> -1.
    # A = -1 keeps PPO: loss 1.221, not clipped. pg_clipfrac counts only A <= 0 tokens -> 0.
    out, m = run("up", [[-1.2, -1.2]], [[-1.0, -1.0]], [[1.0, -1.0]], agg="token-sum")
    assert out.pg_losses[0].tolist() == pytest.approx([-1.0, math.exp(0.2)], rel=1e-6)
    assert out.pg_loss.item() == pytest.approx(-1.0 + math.exp(0.2), rel=1e-6)
    assert m["actor/pg_clipfrac"] == 0.0
    v, vm = run("vanilla", [[-1.2, -1.2]], [[-1.0, -1.0]], [[1.0, -1.0]])
    assert vm["actor/pg_clipfrac"] == pytest.approx(0.5, abs=1e-7)


def test_gspo_sequence_ratio_and_forced_seq_mean_token_mean():
    # row 0: log r [0.1, 0.3] -> mean 0.2 -> s = 1.2214 > 1.2: A=+1 clipped -> -1.2 on both tokens
    # row 1: log r [-0.5] -> s = 0.6065; A=+1: l1 = -0.6065 > l2 = -0.8 -> -0.6065 (not clipped)
    # seq-mean-token-mean even though loss_agg_mode is token-mean: (-1.2 - 0.6065) / 2
    out, m = run("gspo", [[0.0, 0.0], [0.0, 0.0]], [[0.1, 0.3], [-0.5, 9.0]], [[1.0, 1.0], [1.0, 1.0]],
                 mask=[[1, 1], [1, 0]])
    assert out.pg_loss.item() == pytest.approx((-1.2 - math.exp(-0.5)) / 2, rel=1e-6)
    assert out.ratio[0].tolist() == pytest.approx([math.exp(0.2)] * 2, rel=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 3, rel=1e-6)
    assert m["actor/ppo_kl"] == pytest.approx(-(0.1 + 0.3 - 0.5) / 3, rel=1e-5)
    assert m["actor/pg_clipfrac_lower"] == 0.0


def test_gspo_follows_loss_agg_mode_in_verl_0_9_1_only():
    # the rows of the example above under token-sum: 2 * -1.2 - 0.6065 (0.9.1); the other
    # releases keep seq-mean-token-mean
    args = ([[0.0, 0.0], [0.0, 0.0]], [[0.1, 0.3], [-0.5, 9.0]], [[1.0, 1.0], [1.0, 1.0]])
    for version, want in (("0.9.1", 2 * -1.2 - math.exp(-0.5)), ("0.9.0", (-1.2 - math.exp(-0.5)) / 2),
                          ("0.8.0", (-1.2 - math.exp(-0.5)) / 2), ("main", (-1.2 - math.exp(-0.5)) / 2)):
        out, _ = run("gspo", *args, mask=[[1, 1], [1, 0]], agg="token-sum", **{"rldiag.verl_version": version})
        assert out.pg_loss.item() == pytest.approx(want, rel=1e-6), version


def test_gspo_sequence_log_ratio_capped_at_10():
    out, _ = run("gspo", [[0.0]], [[15.0]], [[-1.0]])
    assert out.ratio.item() == pytest.approx(math.exp(10.0), rel=1e-5)


def test_sapo_gate_at_ratio_one():
    # r = 1: gate sigmoid(0) * 4 / tau = 2 / tau. A=+1 (tau_pos 1) -> -2; A=-1 (tau_neg 1.05) -> 2/1.05
    out, m = run("sapo", [[-1.0], [-1.0]], [[-1.0], [-1.0]], [[1.0], [-1.0]])
    assert out.pg_losses[:, 0].tolist() == pytest.approx([-2.0, 2 / 1.05], rel=1e-6)
    assert out.pg_loss.item() == pytest.approx((-2.0 + 2 / 1.05) / 2, abs=1e-6)
    assert m == {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}
    warm, _ = run("sapo", [[-1.0]], [[-1.0]], [[1.0]], **{"actor_rollout_ref.actor.tau_pos": 2.0})
    assert warm.pg_loss.item() == pytest.approx(-1.0, rel=1e-6)


def test_cispo_clips_the_weight_not_the_token():
    # verl's own example: r = [2, 0.5] clipped to [1.2, 0.9] (low 0.1, high 0.2):
    # (-1.2 * 1 * log 2 + 0.9 * (-1) * ... ) -> (-1.2 log 2 + 0.9 log 0.5) / 2; third token masked
    out, m = run("cispo", [[0.0, 0.0, 0.0]], [[LOG(2.0), LOG(0.5), 0.25]], [[1.0, -1.0, 5.0]], mask=[[1, 1, 0]],
                 clip_low=0.1, clip_high=0.2)
    assert out.pg_loss.item() == pytest.approx((-1.2 * LOG(2.0) + 0.9 * LOG(0.5)) / 2, abs=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(1.0, abs=1e-7)
    assert m["actor/pg_clipfrac_lower"] == 0.0


def test_dppo_tv_probability_bound():
    # p_old 0.5 -> 0.8 (diff 0.3 > 0.2, A>0): outside, loss 0; 0.5 -> 0.6: inside, r = 1.2:
    # -1 * 1.2 * log 0.6 = 0.61299. token-mean over 2; pg_clipfrac 1/2
    out, m = run("dppo_tv", [[LOG(0.5), LOG(0.5)]], [[LOG(0.8), LOG(0.6)]], [[1.0, 1.0]])
    assert out.pg_losses[0].tolist() == pytest.approx([0.0, -1.2 * LOG(0.6)], rel=1e-5)
    assert out.pg_loss.item() == pytest.approx(-1.2 * LOG(0.6) / 2, rel=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5, abs=1e-7)
    # A<0, p 0.05 -> 0.2: diff 0.15 >= -0.2 inside; r = 4 truncated at clip_ratio_c 3:
    # -(-1) * 3 * log 0.2; pg_clipfrac_lower counts r > c inside the bound
    out, m = run("dppo_tv", [[LOG(0.05)]], [[LOG(0.2)]], [[-1.0]])
    assert out.pg_loss.item() == pytest.approx(3.0 * LOG(0.2), rel=1e-5)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1.0, abs=1e-7)
    # A<0, 0.5 -> 0.2: diff -0.3 < -0.2 outside
    out, m = run("dppo_tv", [[LOG(0.5)]], [[LOG(0.2)]], [[-1.0]])
    assert out.pg_loss.item() == 0.0 and m["actor/pg_clipfrac"] == pytest.approx(1.0, abs=1e-7)


def test_dppo_kl_bernoulli_bound():
    def bkl(po, p):
        return po * (LOG(po) - LOG(p)) + (1 - po) * LOG((1 - po + 1e-8) / (1 - p + 1e-8))

    assert bkl(0.5, 0.8) == pytest.approx(0.22314, abs=1e-5) and bkl(0.5, 0.6) == pytest.approx(0.020411, abs=1e-5)
    # A>0: 0.5 -> 0.8 (KL 0.223 > 0.2, rose): outside; 0.5 -> 0.6 inside; 0.5 -> 0.05 fell: inside
    out, m = run("dppo_kl", [[LOG(0.5)] * 3], [[LOG(0.8), LOG(0.6), LOG(0.05)]], [[1.0, 1.0, 1.0]], agg="token-sum")
    expect = [0.0, -1.2 * LOG(0.6), -0.1 * LOG(0.05)]
    assert out.pg_losses[0].tolist() == pytest.approx(expect, rel=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 3, rel=1e-6)


def test_geo_mean_clips_token_log_ratios_then_takes_the_geometric_mean():
    # row 0 (A=+1): log r [0.1, 0.5] -> [0.1, 0.2] -> r = e^0.15, loss -e^0.15
    # row 1 (A=-1): log r [-0.5] -> -0.2 -> r = e^-0.2, loss +e^-0.2
    # pg_loss = plain mean over rows (loss_agg_mode ignored)
    out, m = run("geo_mean", [[0.0, 0.0], [0.0, 0.0]], [[0.1, 0.5], [-0.5, 3.0]], [[1.0, 1.0], [-1.0, -1.0]],
                 mask=[[1, 1], [1, 0]], agg="token-sum")
    assert out.pg_loss.item() == pytest.approx((-math.exp(0.15) + math.exp(-0.2)) / 2, rel=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 3, rel=1e-6)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3, rel=1e-6)
    # IS weights enter as the row's geometric mean: weights [4, 1] -> 2
    w, _ = run("geo_mean", [[0.0, 0.0]], [[0.1, 0.5]], [[1.0, 1.0]], w=[[4.0, 1.0]])
    assert w.pg_loss.item() == pytest.approx(-2 * math.exp(0.15), rel=1e-5)


def test_gpg_and_dro():
    # gpg: -log pi * A: [-(-0.5) * 2, -(-2) * 1] = [1, 2] -> token-mean 1.5, no metrics
    out, m = run("gpg", [[0.0, 0.0]], [[-0.5, -2.0]], [[2.0, 1.0]])
    assert out.pg_loss.item() == pytest.approx(1.5, rel=1e-6) and m == {}
    # dro, beta 0.1: -(log pi A - 0.05 (log pi - log pi_old)^2) = -(-1 - 0.05 * 0.25) = 1.0125
    # actor/ppo_kl = masked mean of -(log pi - log pi_old) = -0.5
    out, m = run("dro", [[-1.5]], [[-1.0]], [[1.0]], **{"actor_rollout_ref.actor.policy_loss.dro_beta": 0.1})
    assert out.pg_loss.item() == pytest.approx(1.0125, rel=1e-6) and m == {"actor/ppo_kl": pytest.approx(-0.5)}
    with pytest.raises(ConfigError, match="dro_beta"):
        run("dro", [[-1.5]], [[-1.0]], [[1.0]])


def test_clip_cov_expected_loss_equals_average_over_verl_random_choices():
    # adv [3,-1,0,0] (mean 0.5), log pi [-1,-3,-2,-2] (mean -2): cov [2.5, 1.5, 0, 0];
    # ratio 1 so nothing is clipped; candidates in (1, 5): tokens 0 and 1; k = max(int(0.0002*4),1) = 1
    old = new = [[-1.0, -3.0, -2.0, -2.0]]
    adv = [[3.0, -1.0, 0.0, 0.0]]
    out, m = run("clip_cov", old, new, adv)
    base = [-3.0, 1.0, 0.0, 0.0]
    outcomes = []
    for cut in (0, 1):  # verl picks one of the two candidates at random
        losses = [b if i != cut else 0.0 for i, b in enumerate(base)]
        outcomes.append(sum(losses) / 4)
    assert out.pg_loss.item() == pytest.approx(sum(outcomes) / 2, abs=1e-6)  # -0.25
    assert out.pg_loss.item() == pytest.approx(-0.25, abs=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.25, rel=1e-6) and set(m) == {"actor/pg_clipfrac", "actor/ppo_kl"}
    assert out.sums["rldiag/clip_cov/candidates"].item() == 2 and out.sums["rldiag/clip_cov/clipped"].item() == 1
    # ratio 0.5 -> k = 2 >= candidates: both cut, exactly as verl
    all_cut, m2 = run("clip_cov", old, new, adv, **{"actor_rollout_ref.actor.policy_loss.clip_cov_ratio": 0.5})
    assert all_cut.pg_losses[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert m2["actor/pg_clipfrac"] == pytest.approx(0.5, rel=1e-6)


def test_clip_cov_expectation_by_enumeration_three_candidates_two_cut():
    # adv [3,2,1,0] (mean 1.5), log pi [-1,-1.5,-2,-3] (mean -1.875), ratio 1 (nothing clipped):
    # cov = [1.5*0.875, 0.5*0.375, -0.5*-0.125, -1.5*-1.125] = [1.3125, 0.1875, 0.0625, 1.6875]
    # clip_cov_ratio 0.5 of 4 tokens -> k = 2
    adv = [[3.0, 2.0, 1.0, 0.0]]
    new = [[-1.0, -1.5, -2.0, -3.0]]
    kw = {"actor_rollout_ref.actor.policy_loss.clip_cov_ratio": 0.5, "actor_rollout_ref.actor.policy_loss.clip_cov_lb": 0.5}
    out, m = run("clip_cov", new, new, adv, **kw)
    # lb 0.5: candidates tokens 0 and 3 only, k = 2 -> both cut, deterministic as in verl
    assert out.sums["rldiag/clip_cov/candidates"].item() == 2
    assert out.pg_losses[0].tolist() == [0.0, -2.0, -1.0, 0.0]
    kw["actor_rollout_ref.actor.policy_loss.clip_cov_lb"] = 0.1  # candidates 0, 1, 3; k = 2 of 3
    out, m = run("clip_cov", new, new, adv, **kw)
    base = [-3.0, -2.0, -1.0, 0.0]
    avg = sum(
        sum(b if i not in cut else 0.0 for i, b in enumerate(base)) / 4 for cut in itertools.combinations((0, 1, 3), 2)
    ) / 3
    assert out.pg_loss.item() == pytest.approx(avg, abs=1e-6)
    # each candidate keeps its loss with probability 1/3: (-3/3 - 2/3 - 1 + 0) / 4 = -2/3
    assert out.pg_loss.item() == pytest.approx(-2 / 3, abs=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 4, rel=1e-6)


def test_kl_cov_adds_abs_kl_on_the_top_covariance_token():
    # cov (plain means) [2.5, 1.5, 0, 0]; k = max(1, int(4 * 0.0002)) = 1 -> token 0 gets
    # + ppo_kl_coef (0.1) * |log r| = 0.01. actor/ppo_kl = mean |log r| = 0.25
    lr = [0.1, 0.2, 0.3, 0.4]
    new = [[-1.0, -3.0, -2.0, -2.0]]
    old = [[n - x for n, x in zip(new[0], lr)]]
    out, m = run("kl_cov", old, new, [[3.0, -1.0, 0.0, 0.0]])
    expect = [-3 * math.exp(0.1) + 0.01, math.exp(0.2), 0.0, 0.0]
    assert out.pg_losses[0].tolist() == pytest.approx(expect, rel=1e-6, abs=1e-7)
    assert m == pytest.approx({"actor/ppo_kl": 0.25}, rel=1e-6)
    # ties at the cut go to the earlier token: all advantages equal -> every cov is 0
    tie, _ = run("kl_cov", old, new, [[1.0, 1.0, 1.0, 1.0]])
    assert tie.pg_losses[0].tolist() == pytest.approx(
        [-math.exp(0.1) + 0.01, -math.exp(0.2), -math.exp(0.3), -math.exp(0.4)], rel=1e-6)


BYPASS = "actor_rollout_ref.actor.policy_loss.rollout_correction"


def test_bypass_mode_ppo_clip_with_rejection():
    # old (= rollout) [-1.2, -1.0], current [-1.0, 0.0]: log r [0.2, 1.0]; token_k1 = -log r;
    # threshold 2 -> ratio bounds [0.5, 2] -> keep -log r in [-0.693, 0.693]: token 1 rejected.
    # PPO on token 0 (A=+1, r 1.221 -> -1.2), token-mean over the ORIGINAL 2 tokens -> -0.6
    kw = {f"{BYPASS}.rollout_rs": "token_k1", f"{BYPASS}.rollout_rs_threshold": 2.0}
    out, m = run("bypass_mode", [[-1.2, -1.0]], [[-1.0, 0.0]], [[1.0, 1.0]], n_tokens=2, **kw)
    assert out.pg_loss.item() == pytest.approx(-0.6, rel=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(1.0, abs=1e-7)  # over the surviving token
    assert m["actor/rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(0.5, abs=1e-7)
    assert m["actor/rollout_corr/kl"] == pytest.approx((-0.2 - 1.0) / 2, rel=1e-5)
    assert "actor/rollout_corr/rollout_is_mean" not in m


def test_bypass_mode_reinforce_with_token_is():
    # REINFORCE: -A log pi w, w = min(e^{log r}, 2) = [e^0.2, 2]; A = [1, 0]:
    # [1.0 * e^0.2, 0] -> token-mean 0.6107; actor/ppo_kl = mean(log pi_rollout - log pi) = -0.6
    kw = {f"{BYPASS}.loss_type": "reinforce", f"{BYPASS}.rollout_is": "token"}
    out, m = run("bypass_mode", [[-1.2, -1.0]], [[-1.0, 0.0]], [[1.0, 0.0]], **kw)
    assert out.pg_loss.item() == pytest.approx(math.exp(0.2) / 2, rel=1e-6)
    assert m["actor/ppo_kl"] == pytest.approx(-0.6, rel=1e-5)
    assert m["actor/rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert set(k for k in m if not k.startswith("actor/rollout_corr/")) == {"actor/ppo_kl"}
    with pytest.raises(UnknownKeyError, match="ppo_clip, reinforce"):
        run("bypass_mode", [[-1.2]], [[-1.0]], [[1.0]], **{f"{BYPASS}.loss_type": "pg"})


def test_bypass_mode_without_correction_is_vanilla_against_the_given_old():
    a, am = run("bypass_mode", [[-1.2, -0.7]], [[-1.0, -0.9]], [[1.0, -2.0]])
    b, bm = run("vanilla", [[-1.2, -0.7]], [[-1.0, -0.9]], [[1.0, -2.0]])
    assert a.pg_loss.item() == pytest.approx(b.pg_loss.item(), rel=1e-7)
    assert {k: v for k, v in am.items() if not k.startswith("actor/rollout_corr/")} == bm
    assert am["actor/rollout_corr/training_ppl"] == pytest.approx(math.exp((1.0 + 0.9) / 2), rel=1e-5)


def test_dual_clip_c_must_exceed_one_for_clipped_losses():
    for loss in ("vanilla", "up"):
        with pytest.raises(ConfigError, match="clip_ratio_c"):
            run(loss, [[0.0]], [[0.0]], [[1.0]], clip_c=1.0)
    out, _ = run("dppo_tv", [[0.0]], [[0.0]], [[1.0]], clip_c=1.0)  # DPPO has no such check
    assert out.pg_loss.item() == pytest.approx(0.0)
