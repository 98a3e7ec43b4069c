"""Every policy loss against its per-row reference loop (tests/engine/reference_losses.py) on
random packed steps, per step; packing several steps equals one at a time, in any step order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine.policy_loss import PolicyLossInput, policy_loss
from tests.conftest import settings
from tests.engine import reference_losses as ref
from tests.engine.gen_batches import loss_step, packed, padded, step_ids, step_norm, unpad

HS = hsettings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
P = "actor_rollout_ref.actor.policy_loss."


@st.composite
def case(draw):
    steps = draw(st.lists(loss_step(), min_size=1, max_size=3))
    lo, hi, c = draw(st.sampled_from([(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)]))
    params = dict(
        agg=draw(st.sampled_from(AGGS)),
        lo=lo, hi=hi, c=c,
        use_w=draw(st.booleans()),
        extra_tokens=draw(st.sampled_from([None, 0.0, 3.0])),  # None: verl's fallback sum(mask)
        given_rows=draw(st.booleans()),
        scale=draw(st.sampled_from([None, 7.0])),
        cov=draw(st.sampled_from([(0.0002, 1.0, 5.0), (0.3, -0.05, 5.0), (0.6, 0.02, 0.5), (1.0, -1.0, 1.0)])),
        kl_cov=draw(st.sampled_from([0.0002, 0.25, 0.9])),
        tau=draw(st.sampled_from([(1.0, 1.05), (2.0, 0.5)])),
    )
    return steps, params


def run_engine(loss, steps, p):
    """The loss on the packed steps; its token outputs back as padded ``(rows, width)``."""
    sid = step_ids(steps)
    s = settings(
        agg=p["agg"], clip_low=p["lo"], clip_high=p["hi"], clip_c=p["c"],
        **{P + "clip_cov_ratio": p["cov"][0], P + "clip_cov_lb": p["cov"][1], P + "clip_cov_ub": p["cov"][2],
           P + "kl_cov_ratio": p["kl_cov"], P + "dro_beta": 0.3,
           "actor_rollout_ref.actor.tau_pos": p["tau"][0], "actor_rollout_ref.actor.tau_neg": p["tau"][1],
           "actor_rollout_ref.actor.loss_scale_factor": p["scale"]},
    )
    inp = PolicyLossInput(
        old_log_prob=packed(steps, "old"), log_prob=packed(steps, "new"),
        advantages=packed(steps, "adv"), mask=packed(steps, "mask"), agg_mode=p["agg"],
        norm=step_norm(steps, sid, given_tokens=p["extra_tokens"], given_rows=p["given_rows"], scale=p["scale"]),
        settings=s, rollout_is_weights=packed(steps, "weights") if p["use_w"] else None,
    )
    out = policy_loss(loss, inp)
    out.pg_losses, out.ratio = padded(out.pg_losses, steps), padded(out.ratio, steps)
    return out


def ref_cfg(d, p):
    counts = float(sum(map(sum, d["mask"])))
    norm = ref.Norm(
        batch_num_tokens=None if p["extra_tokens"] is None else counts + p["extra_tokens"],
        global_batch_size=float(len(d["lengths"])) if p["given_rows"] else None,
        loss_scale_factor=p["scale"], horizon=max(d["lengths"]),
    )
    return ref.Cfg(
        clip_low=p["lo"], clip_high=p["hi"], clip_c=p["c"], tau_pos=p["tau"][0], tau_neg=p["tau"][1],
        clip_cov_ratio=p["cov"][0], clip_cov_lb=p["cov"][1], clip_cov_ub=p["cov"][2],
        kl_cov_ratio=p["kl_cov"], ppo_kl_coef=0.1, dro_beta=0.3, agg=p["agg"], norm=norm,
    )


def _flat_nonzero_constant(d):
    vals = {a for row, m_row in zip(d["adv"], d["mask"]) for a, m in zip(row, m_row) if m}
    return len(vals) == 1 and vals != {0.0}


def close(a, b, tol=2e-4):
    return a == pytest.approx(b, rel=tol, abs=tol)


@pytest.mark.parametrize("loss", sorted(ref.REFERENCES))
@HS
@given(case())
def test_loss_matches_per_row_reference(loss, c):
    steps, p = c
    if loss == "clip_cov":
        # equal non-zero advantages over a whole step make every covariance float-rounding noise
        # (in verl too): whether it clears clip_cov_lb is then not a property of the algorithm
        assume(not any(_flat_nonzero_constant(d) for d in steps))
    if loss == "kl_cov":
        assume(not any(ref.kl_cov_cut_is_ambiguous(d["new"], d["adv"], d["mask"], p["kl_cov"]) for d in steps))
    out = run_engine(loss, steps, p)
    row0 = 0
    for i, d in enumerate(steps):
        rows = slice(row0, row0 + len(d["lengths"]))
        row0 += len(d["lengths"])
        losses, pg_loss, metrics = ref.REFERENCES[loss](
            d["old"], d["new"], d["adv"], d["mask"], ref_cfg(d, p), d["weights"] if p["use_w"] else None
        )
        got = unpad(out.pg_losses[rows], d["lengths"])
        for g_row, w_row, m_row in zip(got, losses, d["mask"]):
            # verl aggregates masked tokens only; compare those (outside the mask the loss is unused)
            g_m, w_m = [g for g, m in zip(g_row, m_row) if m], [w for w, m in zip(w_row, m_row) if m]
            assert close(g_m, w_m), (loss, g_m, w_m)
        assert close(out.pg_loss[i].item(), pg_loss), (loss, out.pg_loss[i].item(), pg_loss)
        assert set(out.metrics) == set(metrics)
        for k, v in metrics.items():
            assert close(out.metrics[k][i].item(), v), (loss, k, out.metrics[k][i].item(), v)


@pytest.mark.parametrize("loss", sorted(ref.REFERENCES) + ["bypass_mode"])
@HS
@given(case())
def test_packing_steps_equals_one_at_a_time_in_any_order(loss, c):
    steps, p = c
    together = run_engine(loss, steps, p)
    backwards = run_engine(loss, steps[::-1], p)
    torch.testing.assert_close(together.pg_loss, backwards.pg_loss.flip(0), rtol=1e-5, atol=1e-6)
    row0 = 0
    for i, d in enumerate(steps):
        alone = run_engine(loss, [d], p)
        rows = slice(row0, row0 + len(d["lengths"]))
        row0 += len(d["lengths"])
        w = alone.pg_losses.shape[1]
        torch.testing.assert_close(together.pg_losses[rows, :w], alone.pg_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(together.pg_loss[i : i + 1], alone.pg_loss, rtol=1e-5, atol=1e-6)
        for k, v in alone.metrics.items():
            torch.testing.assert_close(together.metrics[k][i : i + 1], v, rtol=1e-5, atol=1e-6)
