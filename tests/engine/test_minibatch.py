"""rldiag.mini_batch_size: losses normalised per mini-batch, then averaged over mini-batches
(verl's reduce_metrics over optimizer steps)."""

from __future__ import annotations

import pytest
import torch

from rldiag.engine.microbatch import segment_rows
from rldiag.errors import ConfigError
from tests.conftest import make_batch, settings
from tests.engine.packing import recompute_padded


def _batch():
    # 4 rows, one step; rows 0-1 = mini-batch 0, rows 2-3 = mini-batch 1; different token counts
    return make_batch(
        scores=[[0, 0, 1.0], [0, 0, 0], [0, 1.0, 0], [0, 0, 0]],
        mask=[[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]],
        uids=["a", "a", "b", "b"],
        old_log_probs=[[-1.0] * 3] * 4,
        log_probs=[[-0.9, -1.3, -1.0], [-1.2, -1.0, -1.0], [-0.5, -1.1, -1.0], [-1.0, -0.8, -1.4]],
        entropy=[[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0], [7.0, 8.0, 9.0]],
    )


def test_entropy_loss_is_the_mean_of_per_mini_batch_token_means():
    b = _batch()
    whole = recompute_padded(b, settings(estimator="grpo")).metrics["actor/entropy_loss"].item()
    mini = recompute_padded(b, settings(estimator="grpo", **{"rldiag.mini_batch_size": 2})).metrics
    assert whole == pytest.approx((1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9) / 9)
    # mini-batch 0: tokens 1,2,3,4 -> 2.5; mini-batch 1: 5,6,7,8,9 -> 7.0
    assert mini["actor/entropy_loss"].item() == pytest.approx((2.5 + 7.0) / 2)


def test_pg_loss_with_mini_batches_matches_a_hand_computation():
    b = _batch()
    s = settings(estimator="grpo", **{"rldiag.mini_batch_size": 2})
    r = recompute_padded(b, s)
    pg = r.tokens["pg_losses"]
    m = r.tokens["response_mask"]
    per_mini = [(pg[i:i + 2] * m[i:i + 2]).sum() / m[i:i + 2].sum() for i in (0, 2)]
    assert r.metrics["actor/pg_loss"].item() == pytest.approx(float(sum(per_mini) / 2), rel=1e-6)


def test_segments_nest_mini_rank_micro():
    sid = torch.zeros(10, dtype=torch.long)
    seg = segment_rows(sid, 1, micro_batch_size=2, dp_size=2, mini_batch_size=6)
    # verl's order: rank 0 takes rows 0-4, rank 1 rows 5-9; each cuts mini-batches of 6 / 2 = 3
    # rows: mini 0 = rows 0-2 (rank 0) and 5-7 (rank 1), micro [0,1],[2] | [5,6],[7];
    # mini 1 = rows 3-4 and 8-9, one micro-batch each
    assert seg.seg_ids.tolist() == [0, 0, 1, 4, 4, 2, 2, 3, 5, 5]
    assert seg.seg_mini.tolist() == [0, 0, 0, 0, 1, 1]
    assert seg.mini_step.tolist() == [0, 0]
    assert seg.row_mini.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    with pytest.raises(ConfigError, match="multiple of rldiag.dp_size"):
        segment_rows(sid, 1, micro_batch_size=2, dp_size=4, mini_batch_size=6)


def test_whole_step_mini_batch_changes_nothing():
    b = _batch()
    a = recompute_padded(b, settings(estimator="grpo")).metrics
    c = recompute_padded(b, settings(estimator="grpo", **{"rldiag.mini_batch_size": 4})).metrics
    for k in ("actor/pg_loss", "actor/entropy_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert c[k].item() == pytest.approx(a[k].item(), rel=1e-6), k


def test_auto_reads_verls_batch_keys():
    from rldiag.config.settings import resolve_settings
    from rldiag.engine.microbatch import resolve_auto
    from rldiag.errors import ConfigError

    cfg = {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
                                 "rollout": {"n": 8}}}
    s = resolve_settings(config=cfg, overrides={"rldiag.mini_batch_size": "auto", "rldiag.micro_batch_size": "auto"})
    assert resolve_auto(s, "rldiag.mini_batch_size") == 32  # verl multiplies by rollout.n
    assert resolve_auto(s, "rldiag.micro_batch_size") == 2
    bare = resolve_settings(overrides={"rldiag.mini_batch_size": "auto"})
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        resolve_auto(bare, "rldiag.mini_batch_size")
