"""The V1 order of operations with rollout correction (verl v1/trainer_base.py _compute_advantage), bypass mode,
IS weights in the loss, token-mean denominators, and the critic's micro-batch-local loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine.batch import pack
from rldiag.engine.rollout_correction import parse_rs
from rldiag.errors import MissingInputError
from tests.conftest import make_batch, settings
from tests.engine import reference_core
from tests.engine import reference_losses as ref
from tests.engine.gen_batches import batch_of, flat, loss_step, unpad
from tests.engine.packing import full_rows, recompute_padded

RC = "algorithm.rollout_correction."


def test_kl_shaping_then_rejection_then_estimator():
    # token 1 is rejected (log r = 1.0 -> -log r = -1 < log 0.5); its KL-shaped reward stays and
    # still counts in the row's GRPO score; its advantage is 0 (post-rejection mask).
    b = make_batch(
        scores=[[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]],
        mask=[[1, 1, 1], [1, 1, 1]],
        uids=["g", "g"],
        old_log_probs=[[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]],
        ref_log_prob=[[-1.0, -3.0, -1.0], [-1.0, -1.0, -1.0]],
        rollout_log_probs=[[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]],
    )
    s = settings(estimator="grpo", **{
        "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 0.1,
        RC + "rollout_rs": "token_k1", RC + "rollout_rs_threshold": 2.0,
    })
    r = recompute_padded(b, s)
    assert r.tokens["response_mask"].tolist() == [[1, 0, 1], [1, 1, 1]]
    # kld = old - ref = [0, 2, 0]: shaped on the ORIGINAL mask -> reward -0.2 at the rejected token
    assert r.tokens["token_level_rewards"][0].tolist() == pytest.approx([0.0, -0.2, 1.0], abs=1e-7)
    # the KL penalty metric uses the original mask: row KL means [2/3, 0] -> 1/3
    assert r.metrics["actor/reward_kl_penalty"].item() == pytest.approx(1 / 3, rel=1e-5)
    # GRPO scores include the rejected token's reward: [0.8, 0] -> +-0.7071 / std
    a = 0.4 / (math.sqrt(0.32) + 1e-6)
    assert r.tokens["advantages"][0].tolist() == pytest.approx([a, 0.0, a], rel=1e-5)
    assert r.metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"].item() == pytest.approx(1 / 6, rel=1e-6)


def _loss_batch(**extra):
    return make_batch(
        scores=[[0.0, 0.0, 0.0, 1.0]], mask=[[1, 1, 1, 1]], uids=["solo"],
        old_log_probs=[[-1.0, -1.0, -1.0, -1.0]], log_probs=[[-1.0, -1.0, -1.0, -1.0]],
        rollout_log_probs=[[-1.2, -1.0, 0.0, -1.0]], **extra,
    )


def test_token_mean_counts_the_original_mask_after_rejection():
    # grpo singleton: advantage 1/(1+1e-6) on kept tokens; ratio 1 -> loss -A per kept token.
    # log r = old - rollout = [0.2, 0, -1, 0]: token 2 rejected by token_k1 at 2.
    s = settings(estimator="grpo", **{RC + "rollout_rs": "token_k1", RC + "rollout_rs_threshold": 2.0})
    r = recompute_padded(_loss_batch(), s)
    a = 1 / (1 + 1e-6)
    assert r.tokens["response_mask"][0].tolist() == [1, 1, 0, 1]
    assert r.metrics["actor/pg_loss"].item() == pytest.approx(-3 * a / 4, rel=1e-6)  # / 4, not / 3
    # a loss_mask column gives the denominator when present
    r = recompute_padded(_loss_batch(loss_mask=[[1, 1, 1, 1]]), s)
    assert r.metrics["actor/pg_loss"].item() == pytest.approx(-3 * a / 4, rel=1e-6)


def test_critic_token_mean_counts_the_original_mask_after_rejection():
    # values 0, vpreds 0.5 (inside the clip range): per kept token 0.5 * (0.5 - G)^2 over 4 tokens,
    # not 3, from verl 0.9.0 on; verl 0.8.0 divides by the kept tokens of the micro-batch
    s = {RC + "rollout_rs": "token_k1", RC + "rollout_rs_threshold": 2.0}
    for version, denom in (("0.9.1", 4), ("0.8.0", 3)):
        b = _loss_batch(values=[[0.0] * 4], vpreds=[[0.5] * 4])
        r = recompute_padded(b, settings(estimator="grpo", **s, **{"rldiag.verl_version": version, "critic.enable": True}))
        ret, kept = r.tokens["returns"][0].tolist(), r.tokens["response_mask"][0].tolist()
        assert kept == [1, 1, 0, 1]
        want = 0.5 * sum((0.5 - g) ** 2 for g, k in zip(ret, kept) if k) / denom
        assert r.metrics["critic/vf_loss"].item() == pytest.approx(want, rel=1e-6), version


def test_is_weights_reach_the_policy_loss_and_the_tokens():
    # token IS, TIS 2: w = [e^0.2, 1, e^-1, 1]; loss -A w (ratio 1, A = 1/(1+1e-6))
    s = settings(estimator="grpo", **{RC + "rollout_is": "token"})
    r = recompute_padded(_loss_batch(), s)
    w = [math.exp(0.2), 1.0, math.exp(-1.0), 1.0]
    assert r.tokens["rollout_is_weights"][0].tolist() == pytest.approx(w, rel=1e-6)
    a = 1 / (1 + 1e-6)
    assert r.tokens["pg_losses"][0].tolist() == pytest.approx([-a * x for x in w], rel=1e-6)
    assert r.metrics["actor/pg_loss"].item() == pytest.approx(-a * sum(w) / 4, rel=1e-6)
    assert r.metrics["rollout_corr/rollout_is_mean"].item() == pytest.approx(sum(w) / 4, rel=1e-6)


def test_offpolicy_diagnostics_without_is_or_rejection():
    r = recompute_padded(_loss_batch(), settings(estimator="grpo"))
    assert r.metrics["rollout_corr/kl"].item() == pytest.approx((-0.2 + 1.0) / 4, rel=1e-5)
    assert "rollout_is_weights" not in r.tokens
    assert not any(k.startswith(("rollout_corr/rollout_is", "rollout_corr/rollout_rs")) for k in r.metrics)
    none = recompute_padded(make_batch(scores=[[1.0]], mask=[[1]], old_log_probs=[[-1.0]], log_probs=[[-1.0]]),
                           settings(estimator="grpo"))
    assert not any(k.startswith("rollout_corr/") for k in none.metrics)


def test_bypass_mode_swaps_old_for_rollout_and_skips_correction():
    s = settings(estimator="grpo", **{
        RC + "bypass_mode": True, RC + "rollout_is": "token", RC + "rollout_rs": "token_k1",
        RC + "rollout_rs_threshold": 2.0,
    })
    r = recompute_padded(_loss_batch(), s)
    assert not any(k.startswith("rollout_corr/") for k in r.metrics)  # verl skips it in bypass mode
    assert r.tokens["response_mask"][0].tolist() == [1, 1, 1, 1]
    # ratio = pi_theta / pi_rollout = exp(-1 - [-1.2, -1, 0, -1]) = [e^0.2, 1, e^-1, 1]
    assert r.tokens["ratio"][0].tolist() == pytest.approx([math.exp(0.2), 1.0, math.exp(-1.0), 1.0], rel=1e-6)
    assert r.metrics["actor/ppo_kl"].item() == pytest.approx((-0.2 + 1.0) / 4, rel=1e-5)
    with pytest.raises(MissingInputError, match="rollout_log_probs"):
        recompute_padded(make_batch(scores=[[1.0]], mask=[[1]], old_log_probs=[[-1.0]], log_probs=[[-1.0]]), s)


def test_bypass_mode_feeds_kl_shaping_with_the_rollout_policy():
    b = make_batch(scores=[[0.0, 1.0]], mask=[[1, 1]], old_log_probs=[[-5.0, -5.0]], rollout_log_probs=[[-1.0, -2.0]],
                   ref_log_prob=[[-1.5, -1.5]])
    s = settings(estimator="grpo", **{"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 1.0,
                                      RC + "bypass_mode": True})
    r = recompute_padded(b, s)
    assert r.tokens["token_level_rewards"][0].tolist() == pytest.approx([-0.5, 1.5], rel=1e-6)


def test_empty_step_fails_only_itself_when_rollout_correction_runs():
    good = make_batch(scores=[[1.0]], mask=[[1]], old_log_probs=[[-1.0]], log_probs=[[-1.0]], rollout_log_probs=[[-1.0]])
    empty = make_batch(scores=[[1.0]], mask=[[0]], old_log_probs=[[-1.0]], log_probs=[[-1.0]],
                       rollout_log_probs=[[-1.0]], steps=[2])
    r = recompute_padded(pack([good, empty]), settings(estimator="grpo"))
    assert list(r.failed) == [2] and "at least one valid token" in r.failed[2]


def _critic_case(version):
    b = make_batch(scores=[[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], mask=[[1, 1, 1], [0, 0, 0]],
                   values=[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], vpreds=[[0.1, 0.2, 0.3], [5.0, 5.0, 5.0]])
    s = settings(estimator="gae", **{"critic.loss_agg_mode": "seq-mean-token-sum-norm",
                                     "critic.loss_scale_factor": 100.0,
                                     "actor_rollout_ref.actor.loss_scale_factor": 50.0,
                                     "rldiag.verl_version": version})
    r = recompute_padded(b, s)
    ret = r.tokens["returns"][0].tolist()  # gamma = lam = 1, V = 0: returns [1, 1, 1]
    assert ret == pytest.approx([1.0, 1.0, 1.0])
    assert r.metrics["critic/vpred_mean"].item() == pytest.approx(0.2, rel=1e-6)
    assert r.metrics["critic/vf_clipfrac"].item() == 0.0
    return r.metrics["critic/vf_loss"].item()


ERRS = [(0.1 - 1) ** 2, (0.2 - 1) ** 2, (0.3 - 1) ** 2]  # vpreds inside the clip range 0.5


def test_critic_loss_is_normalised_over_the_global_batch_with_its_own_loss_scale_factor():
    # verl commit 2eb020aa9: seq-mean over the step's 2 rows (the global batch size), divided by
    # critic.loss_scale_factor (100), not the actor's (50)
    assert _critic_case("0.9.0") == pytest.approx(0.5 * sum(ERRS) / 2 / 100, rel=1e-6)


def test_critic_loss_of_verl_0_8_is_micro_batch_local_and_ignores_loss_scale_factor():
    # verl 0.8.0's value_loss passes no global batch info: seq-mean-token-sum-norm divides by the
    # padded width (3), not by critic/actor loss_scale_factor; seq-mean divides by rows with tokens (1).
    assert _critic_case("0.8.0") == pytest.approx(0.5 * sum(ERRS) / 1 / 3, rel=1e-6)


@st.composite
def pipeline_case(draw):
    steps = draw(st.lists(loss_step(min_rows=2), min_size=1, max_size=3))
    rs = draw(st.sampled_from([None, ("token_k1", "0.9_1.1"), ("seq_mean_k3", "0.005"), ("token_k2,seq_max_k3", "0.01,0.02")]))
    return steps, draw(st.sampled_from([None, "token", "sequence"])), rs


@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipeline_case())
def test_pipeline_with_correction_matches_references(c):
    """grpo (singleton groups) on the rewritten mask, vanilla loss with IS weights and the original
    token count, per step, against the reference loops."""
    steps, level, rs = c
    for d in steps:
        d["scores"] = [[0.0] * (L - 1) + [float(i % 3)] for i, L in enumerate(d["lengths"])]
    b = batch_of(steps)
    b.token_level_scores = flat([x for d in steps for x in d["scores"]])
    s = settings(estimator="grpo", **{RC + "rollout_is": level, RC + "rollout_rs": rs and rs[0],
                                      RC + "rollout_rs_threshold": rs and rs[1]})
    r = recompute_padded(b, s)
    row0 = 0
    for i, d in enumerate(steps):
        rows = slice(row0, row0 + len(d["lengths"]))
        row0 += len(d["lengths"])
        rc = ref.RC(rollout_is=level, rs={} if rs is None else parse_rs(*rs))
        w, new_mask, _ = ref.rollout_correction_ref(d["old"], d["rollout"], d["mask"], rc)
        assert unpad(r.tokens["response_mask"][rows], d["lengths"]) == [[float(x) for x in m] for m in new_mask]
        adv = reference_core.grpo_ref(d["scores"], new_mask, list(range(len(d["lengths"]))))
        got_adv = unpad(r.tokens["advantages"][rows], d["lengths"])
        for g, e in zip(got_adv, adv):
            assert g == pytest.approx(e, rel=1e-5, abs=1e-6)
        n_orig = float(sum(map(sum, d["mask"])))
        cfg = ref.Cfg(norm=ref.Norm(batch_num_tokens=n_orig, global_batch_size=float(len(d["lengths"]))))
        _, pg_loss, metrics = ref.vanilla_ref(d["old"], d["new"], adv, new_mask, cfg, w)
        assert r.metrics["actor/pg_loss"][i].item() == pytest.approx(pg_loss, rel=1e-4, abs=1e-5)
        for k, v in metrics.items():
            assert r.metrics[k][i].item() == pytest.approx(v, rel=1e-4, abs=1e-5)


def test_a_capture_after_rejection_starts_from_loss_mask():
    """Captured after verl's rejection rewrote response_mask, with the rollout's mask kept as
    loss_mask: the recompute starts from loss_mask, so it rejects the same tokens once (not
    again on the already-rejected mask) and every metric equals the pre-rejection capture's."""
    s = settings(estimator="grpo", **{RC + "rollout_rs": "token_k1", RC + "rollout_rs_threshold": 2.0,
                                      "algorithm.use_kl_in_reward": True})
    common = dict(scores=[[0.0, 0.0, 1.0], [0.0, 0.0, 0.5]], uids=["g", "g"],
                  old_log_probs=[[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]],
                  ref_log_prob=[[-1.0, -3.0, -1.0], [-1.0, -1.2, -1.0]],
                  rollout_log_probs=[[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    before = recompute_padded(make_batch(mask=[[1, 1, 1], [1, 1, 1]], **common), s)
    rejected = before.tokens["response_mask"]
    assert rejected.tolist() == [[1, 0, 1], [1, 1, 1]]  # log r = 1 at row 0, token 1
    after = recompute_padded(make_batch(mask=rejected.tolist(), loss_mask=[[1, 1, 1], [1, 1, 1]], **common), s)
    assert torch.equal(after.tokens["response_mask"], rejected)
    for name in ("advantages", "token_level_rewards"):
        assert torch.equal(after.tokens[name], before.tokens[name]), name
    assert set(after.metrics) == set(before.metrics)
    for name, value in before.metrics.items():
        assert torch.allclose(after.metrics[name], value, equal_nan=True), name


def test_rollout_probs_metrics_and_actor_entropy_where_verl_logs_them():
    import math as m

    from rldiag.engine.metrics import rollout_probs_metrics

    # p_old = e^-1 on both tokens, p_rollout = [e^-1.2, e^-1]: |diff| = [e^-1 - e^-1.2, 0]
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    roll = torch.tensor([[-1.2, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    (old, roll, mask), rows = full_rows(old, roll, mask)
    out = rollout_probs_metrics(old, roll, mask, rows, torch.tensor([0, 1]), 2)
    d = m.exp(-1) - m.exp(-1.2)
    assert out["training/rollout_probs_diff_max"][0].item() == pytest.approx(d, rel=1e-6)
    assert out["training/rollout_probs_diff_mean"][0].item() == pytest.approx(d / 2, rel=1e-6)
    assert out["training/rollout_probs_diff_std"][0].item() == pytest.approx(d / m.sqrt(2), rel=1e-5)
    assert out["training/rollout_probs_diff_valid"].tolist() == [1.0, 0.0]  # step 1 has no token
    assert m.isnan(out["training/rollout_actor_probs_pearson_corr"][1].item())
    # bypass mode skips verl's old-log-prob pass, and with it actor/entropy and training/rollout_*
    b = _loss_batch(entropy=[[1.0, 2.0, 3.0, 4.0]])
    assert recompute_padded(b, settings(estimator="grpo")).metrics["actor/entropy"].item() == pytest.approx(2.5)
    r = recompute_padded(b, settings(estimator="grpo", **{RC + "bypass_mode": True}))
    assert "actor/entropy" not in r.metrics and "training/rollout_probs_diff_mean" not in r.metrics
