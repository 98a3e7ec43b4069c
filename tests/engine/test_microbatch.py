"""Micro-batch emulation: rows dealt to DP ranks and micro-batches in batch order; verl's MEAN
metrics averaged with equal weight over micro-batches, pg_loss (global normalisation) summed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine.microbatch import segment_rows
from rldiag.engine.pipeline import recompute_batch
from rldiag.errors import ConfigError
from rldiag.scenario.plan import check_settings
from tests.conftest import make_batch, settings
from tests.engine import reference_losses as ref
from tests.engine.gen_batches import batch_of, flat, loss_step, padded, unpad

MB = "rldiag.micro_batch_size"
DP = "rldiag.dp_size"


def test_rows_are_dealt_to_ranks_then_micro_batches_in_order():
    # step 0: 10 rows, dp 2 -> rank 0 rows 0-4, rank 1 rows 5-9; micro-batches of 2: [0,1][2,3][4] ...
    # step 1: 3 rows -> ranks take 2 and 1 rows
    sid = torch.tensor([0] * 10 + [1] * 3)
    seg = segment_rows(sid, 2, 2, 2)
    assert seg.seg_ids.tolist() == [0, 0, 1, 1, 2, 3, 3, 4, 4, 5, 6, 6, 7]
    assert seg.seg_step.tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert seg.n_seg == 8
    whole = segment_rows(sid, 2, None, 1)
    assert whole.seg_ids.tolist() == sid.tolist() and whole.n_seg == 2
    ranks_only = segment_rows(sid, 2, None, 3)  # 10 rows over 3 ranks: 4, 4, 2
    assert ranks_only.seg_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 2 + [3, 4, 5]
    # rows of a step need not be contiguous: positions follow batch order within the step
    mixed = segment_rows(torch.tensor([0, 1, 0, 1, 0]), 2, 2, 1)
    assert mixed.seg_ids.tolist() == [0, 2, 0, 2, 1]


def test_clip_fraction_is_the_mean_over_micro_batches_pg_loss_stays_global():
    # row 0: one token, ratio e^0.5 > 1.2 with A=+1 -> clipped; row 1: 3 unclipped tokens (ratio 1)
    # whole step: pg_clipfrac 1/4; micro-batches of 1 row: (1/1 + 0/3) / 2 = 0.5
    # grpo over the two rows: A = +0.707 (row 0), -0.707 (row 1); returns = advantages
    b = make_batch(scores=[[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], mask=[[1, 0, 0], [1, 1, 1]], lengths=[1, 3], uids=["g", "g"],
                   old_log_probs=[[-1.5, 0, 0], [-1.0, -1.0, -1.0]], log_probs=[[-1.0, 0, 0], [-1.0, -1.0, -1.0]],
                   values=[[0.0] * 3] * 2, vpreds=[[0.9, 0, 0], [0.0, 0.0, 0.0]])
    # a critic alongside GRPO (critic.enable=true): its metrics are logged too
    whole = recompute_batch(b, settings(estimator="grpo", **{"critic.enable": True}))
    micro = recompute_batch(b, settings(estimator="grpo", **{MB: 1, "critic.enable": True}))
    assert whole.metrics["actor/pg_clipfrac"].item() == pytest.approx(0.25, rel=1e-6)
    assert micro.metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5, rel=1e-6)
    assert micro.metrics["actor/ppo_kl"].item() == pytest.approx(-0.5 / 2, rel=1e-5)  # (-0.5 + 0) / 2
    assert whole.metrics["actor/ppo_kl"].item() == pytest.approx(-0.5 / 4, rel=1e-5)
    torch.testing.assert_close(micro.metrics["actor/pg_loss"], whole.metrics["actor/pg_loss"])
    # critic: vpred 0.9 vs value 0 clips to 0.5: (0.5-0.707)^2 > (0.9-0.707)^2 -> clipped; row 1 not
    assert micro.metrics["critic/vf_clipfrac"].item() == pytest.approx(0.5, rel=1e-6)
    assert whole.metrics["critic/vf_clipfrac"].item() == pytest.approx(0.25, rel=1e-6)
    assert micro.metrics["critic/vpred_mean"].item() == pytest.approx(0.45, rel=1e-6)


def test_settings_validation():
    for bad in ({MB: 0}, {DP: 0}):
        with pytest.raises(ConfigError, match="rldiag"):
            check_settings(settings(**bad))
    check_settings(settings(**{MB: 4, DP: 2}))


def _verl_split(n_rows, mbs, dp):
    """Row index lists per (rank, micro) in verl's order."""
    L = math.ceil(n_rows / dp)
    out = []
    for r in range(dp):
        rows = list(range(r * L, min((r + 1) * L, n_rows)))
        step = mbs or max(len(rows), 1)
        out.extend(rows[i : i + step] for i in range(0, len(rows), step))
    return [x for x in out if x]


@st.composite
def micro_case(draw):
    steps = draw(st.lists(loss_step(min_rows=2, max_rows=9), min_size=1, max_size=2))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    for d in steps:
        d["values"] = [list(rng.normal(0.3, 0.4, L)) for L in d["lengths"]]
        d["vpreds"] = [list(np.array(v) + rng.normal(0, 0.6, len(v))) for v in d["values"]]
        d["scores"] = [[0.0] * (L - 1) + [float(rng.integers(0, 2))] for L in d["lengths"]]
    return (
        steps,
        draw(st.sampled_from([None, 1, 2, 3])),
        draw(st.sampled_from([1, 2])),
        draw(st.sampled_from(["vanilla", "gspo", "geo_mean", "cispo", "kl_cov"])),
        draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])),
    )


@hsettings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(micro_case(), st.sampled_from(["0.8.0", "0.10.0.dev"]))
def test_micro_batch_metrics_match_per_micro_batch_reference(c, version):
    steps, mbs, dp, loss, agg = c
    critic_global = version != "0.8.0"  # verl commit 2eb020aa9
    b = batch_of(steps, values=None)
    b.values = flat([x for d in steps for x in d["values"]])
    b.vpreds = flat([x for d in steps for x in d["vpreds"]])
    b.token_level_scores = flat([x for d in steps for x in d["scores"]])
    s = settings(estimator="gae", agg=agg, **{
        MB: mbs, DP: dp, "actor_rollout_ref.actor.policy_loss.loss_mode": loss,
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio": 0.3, "rldiag.verl_version": version,
        # the reference deals rows in batch order (balancing: tests/engine/test_balance.py), with no
        # V1 padding rows (tests/engine/test_batch_layout.py)
        "rldiag.rows_balanced": True,
    })
    if version != "0.8.0":
        assume(all(len(d["lengths"]) % dp == 0 for d in steps))
    r = recompute_batch(b, s)
    r.tokens = {k: padded(v, steps) for k, v in r.tokens.items()}  # (rows, width) for the row-wise checks
    row0 = 0
    for i, d in enumerate(steps):
        n = len(d["lengths"])
        rows = slice(row0, row0 + n)
        row0 += n
        adv = unpad(r.tokens["advantages"][rows], d["lengths"])
        ret = unpad(r.tokens["returns"][rows], d["lengths"])
        n_tok = float(sum(map(sum, d["mask"])))
        metric_lists, pg_sum, critic = {}, 0.0, {"critic/vf_loss": [], "critic/vf_clipfrac": [], "critic/vpred_mean": []}
        for part in _verl_split(n, mbs, dp):
            sub = {k: [d[k][j] for j in part] for k in ("old", "new", "mask", "values", "vpreds")}
            if loss == "kl_cov":  # a top-k cut between equal covariances is rounding noise
                assume(not ref.kl_cov_cut_is_ambiguous(sub["new"], [adv[j] for j in part], sub["mask"], 0.3))
            # the padded width: the micro-batch's longest row (V1), the step's (legacy trainer, 0.8.0)
            horizon = max(d["lengths"][j] for j in (part if version != "0.8.0" else range(n)))
            cfg = ref.Cfg(agg=agg, kl_cov_ratio=0.3,
                          norm=ref.Norm(batch_num_tokens=n_tok, global_batch_size=float(n), horizon=horizon))
            _, pg, met = ref.REFERENCES[loss](sub["old"], sub["new"], [adv[j] for j in part], sub["mask"], cfg)
            pg_sum += pg / dp if loss == "geo_mean" else pg  # geo_mean: per-micro mean, SUM, mean over ranks
            for k, v in met.items():
                metric_lists.setdefault(k, []).append(v)
            # critic: 0.5 * agg(max(l1, l2)), normalised like the actor (a SUM over micro-batches),
            # in verl 0.8.0 within the micro-batch (a MEAN)
            l_mat, clip_mat = [], []
            for vp_row, v_row, g_row in zip(sub["vpreds"], sub["values"], [ret[j] for j in part]):
                lr, cr = [], []
                for vp, v, g in zip(vp_row, v_row, g_row):
                    l1 = (vp - g) ** 2
                    l2 = (ref.clamp(vp, v - 0.5, v + 0.5) - g) ** 2
                    lr.append(max(l1, l2))
                    cr.append(1.0 if l2 > l1 else 0.0)
                l_mat.append(lr)
                clip_mat.append(cr)
            critic_norm = cfg.norm if critic_global else ref.Norm(horizon=horizon)
            critic["critic/vf_loss"].append(0.5 * ref.agg_ref(l_mat, sub["mask"], agg, critic_norm))
            critic["critic/vf_clipfrac"].append(ref.masked_mean(clip_mat, sub["mask"]))
            critic["critic/vpred_mean"].append(ref.masked_mean(sub["vpreds"], sub["mask"]))
        assert r.metrics["actor/pg_loss"][i].item() == pytest.approx(pg_sum, rel=2e-4, abs=2e-5)
        if critic_global:
            vf = critic.pop("critic/vf_loss")
            assert r.metrics["critic/vf_loss"][i].item() == pytest.approx(sum(vf), rel=2e-4, abs=2e-5, nan_ok=True)
        for k, vals in {**metric_lists, **critic}.items():
            # a micro-batch without a single actor token gives the critic 0/0 = NaN, in verl too
            assert r.metrics[k][i].item() == pytest.approx(sum(vals) / len(vals), rel=2e-4, abs=2e-5, nan_ok=True), k


def test_micro_batch_covering_the_step_equals_the_default():
    b = make_batch(scores=[[0, 1.0], [0, 0.0], [1.0, 0]], mask=[[1, 1], [1, 0], [1, 1]], uids=["a", "a", "b"],
                   old_log_probs=[[-1.0, -2.0], [-0.5, -1.0], [-1.0, -1.0]],
                   log_probs=[[-0.7, -2.5], [-0.9, -1.0], [-1.0, -0.2]])
    base = recompute_batch(b, settings(estimator="grpo"))
    big = recompute_batch(b, settings(estimator="grpo", **{MB: 64}))
    for k, v in base.metrics.items():
        torch.testing.assert_close(big.metrics[k], v, equal_nan=True)


def test_seq_mean_token_sum_norm_divides_by_the_micro_batch_width_in_v1_and_the_max_length_in_legacy():
    # rows of width 1 and 3 (2 tokens around a tool token), micro-batches of one row,
    # data.max_response_length 8; ratio 1, A = +-0.707 (grpo); loss per row = -A * tokens;
    # seq-mean over the step's 2 rows
    b = make_batch(scores=[[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], mask=[[1, 0, 0], [1, 0, 1]], lengths=[1, 3], uids=["g", "g"],
                   old_log_probs=[[-1.0, 0, 0], [-1.0] * 3], log_probs=[[-1.0, 0, 0], [-1.0] * 3])
    b.max_response_length = torch.tensor([8])  # what the loader puts there from data.max_response_length
    base = {MB: 1, "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm", "data.max_response_length": 8}
    a = 1 / math.sqrt(2) / (1 + 1e-6 * math.sqrt(2))  # (1 - 0.5) / (std 0.7071 + 1e-6)
    v1 = recompute_batch(b, settings(estimator="grpo", **base)).metrics["actor/pg_loss"].item()
    assert v1 == pytest.approx(-a * 1 / 2 / 1 + a * 2 / 2 / 3, rel=1e-5)  # widths 1 and 3
    legacy = recompute_batch(b, settings(estimator="grpo", **base, **{"trainer.use_v1": False})).metrics["actor/pg_loss"].item()
    assert legacy == pytest.approx((-a * 1 + a * 2) / 2 / 8, rel=1e-5)
    old_settings = settings(estimator="grpo", **base, **{"rldiag.verl_version": "0.8.0"})
    old = recompute_batch(b, old_settings).metrics["actor/pg_loss"].item()
    assert old == pytest.approx(legacy, rel=1e-6)  # verl 0.8.0 has only the legacy trainer
