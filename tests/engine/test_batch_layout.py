"""verl's batch layout: V1's padding rows and balancing, the legacy trainer's, shuffled ranks,
token-budget micro-batches, the settings that choose them (tests/verl/test_layout.py compares
the same with verl's own functions)."""

from __future__ import annotations

import pytest
import torch

from rldiag.config.settings import resolve_settings
from rldiag.engine.balance import dispatch_order, workload
from rldiag.engine.batch_layout import batch_layout, describe_layout
from rldiag.engine.dynamic_bsz import BudgetError, token_budget_micro_batches
from rldiag.engine.microbatch import dataloader_order, segmentations_for
from rldiag.engine.pipeline import recompute_batch
from rldiag.errors import ConfigError
from tests.conftest import make_batch, settings

DP, MB, MINI = "rldiag.dp_size", "rldiag.micro_batch_size", "rldiag.mini_batch_size"
A = "actor_rollout_ref.actor."


def _ranks(seg, rows):
    """Each rank's rows ``{rank: [rows]}`` (segments in order)."""
    out: dict[int, list[int]] = {}
    for j, s in enumerate(seg.seg_ids.tolist()[:rows]):
        out.setdefault(int(seg.seg_rank[s]), []).append(j)
    return out


def test_v1_balances_every_step_whatever_balance_batch_says():
    # workloads of 100, 90, 1, 2 tokens: partial solutions {2 | 1} and {100 | 90}; the wider one
    # ({100 | 90}, spread 10) takes the other's smallest and largest: {100, 1} and {90, 2}
    seq = torch.tensor([100, 90, 1, 2])
    assert dispatch_order(workload(seq).tolist(), 2) == [0, 2, 1, 3]
    sid = torch.zeros(4, dtype=torch.long)
    for balance in (True, False):
        v1, _ = segmentations_for(sid, 1, settings(**{DP: 2, "trainer.balance_batch": balance}), seq)
        assert _ranks(v1, 4) == {0: [0, 2], 1: [1, 3]}
    # the legacy trainer reads the flag
    legacy, _ = segmentations_for(sid, 1, settings(**{DP: 2, "trainer.use_v1": False, "trainer.balance_batch": False}), seq)
    assert _ranks(legacy, 4) == {0: [0, 1], 1: [2, 3]}


def test_the_legacy_trainer_puts_each_ranks_lightest_rows_at_both_ends():
    # rank 0 holds rows 0 (100 tokens) and 2 (1): sorted by workload [2, 0], even places then odd
    # ones reversed -> [2, 0]; rank 1 [3, 1]
    loads = workload(torch.tensor([100, 90, 1, 2])).tolist()
    assert dispatch_order(loads, 2, legacy=True) == [2, 0, 3, 1]
    loads6 = workload(torch.tensor([5, 50, 40, 30, 20, 10])).tolist()
    order = dispatch_order(loads6, 2, legacy=True)
    for rank in (order[:3], order[3:]):  # light, heavy, middle: the lightest first, the next lightest last
        by_load = sorted(rank, key=lambda i: loads6[i])
        assert rank == [by_load[0], by_load[2], by_load[1]]


def test_rows_in_dispatch_order_are_not_balanced_again():
    seq = torch.tensor([100, 90, 1, 2])
    sid = torch.zeros(4, dtype=torch.long)
    stored, _ = segmentations_for(sid, 1, settings(**{DP: 2, "rldiag.rows_balanced": True}), seq)
    assert _ranks(stored, 4) == {0: [0, 1], 1: [2, 3]}
    # unset: a run written by rldiag's verl capture holds the trainer's order
    captured = resolve_settings(config={"rldiag": {"capture": {"trainer": "v1"}}}, overrides={DP: 2})
    assert not batch_layout(captured).balance and batch_layout(settings(**{DP: 2})).balance


def test_v1_pads_to_a_multiple_of_dp_and_the_mini_batches():
    cfg = {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1},
                                 "rollout": {"n": 2}},
           "critic": {"ppo_mini_batch_size": 3}, "algorithm": {"adv_estimator": "gae"}}
    s = resolve_settings(config=cfg, overrides={DP: 2})
    lay = batch_layout(s)
    assert lay.pad_multiple(1) == 12  # lcm(dp 2, critic 3 x 2, actor 2 x 2)
    grpo = resolve_settings(config={**cfg, "algorithm": {"adv_estimator": "grpo"}}, overrides={DP: 2})
    assert batch_layout(grpo).pad_multiple(1) == 4  # no critic
    warm = resolve_settings(config={**cfg, "trainer": {"critic_warmup": 3}}, overrides={DP: 2})
    assert [batch_layout(warm).pad_multiple(s) for s in (2, 3)] == [6, 12]  # the actor joins at step 3
    legacy = resolve_settings(config=cfg, overrides={DP: 2, "trainer.use_v1": False})
    assert batch_layout(legacy).pad_multiple(1) == 1
    assert describe_layout(lay).startswith("V1, dp 2, padded to a multiple of 12, balanced by rldiag")


def test_padding_rows_fill_segments_and_count_as_rows():
    # 3 rows, dp 2 -> one padding row; micro-batches of one row: 4 segments, one of padding only
    sid = torch.zeros(3, dtype=torch.long)
    seg, _ = segmentations_for(sid, 1, settings(**{DP: 2, MB: 1}), torch.tensor([5, 6, 7]))
    assert seg.n_seg == 4 and seg.seg_pad.tolist().count(True) == 1
    assert seg.batch_size().tolist() == [4.0] * 4
    legacy, _ = segmentations_for(sid, 1, settings(**{DP: 2, MB: 1, "trainer.use_v1": False}), torch.tensor([5, 6, 7]))
    assert legacy.n_seg == 3 and legacy.batch_size().tolist() == [3.0] * 3


def test_padding_rows_dilute_the_mean_metrics_and_the_sequence_mean():
    # row 0: ratio e^0.5 with A > 0 -> clipped; rows 1, 2 unclipped. V1 with dp 2: a padding row
    # makes 4 rows: micro-batches of one row give clip fractions 1, 0, 0 and the padding row's 0
    b = make_batch(scores=[[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], mask=[[1, 0], [1, 1], [1, 1]], lengths=[1, 2, 2],
                   uids=["g", "g", "g"], old_log_probs=[[-1.5, 0], [-1.0, -1.0], [-1.0, -1.0]],
                   log_probs=[[-1.0, 0], [-1.0, -1.0], [-1.0, -1.0]])
    base = {DP: 2, MB: 1, "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"}
    v1 = recompute_batch(b, settings(estimator="grpo", **base)).metrics
    legacy = recompute_batch(b, settings(estimator="grpo", **base, **{"trainer.use_v1": False})).metrics
    assert v1["actor/pg_clipfrac"].item() == pytest.approx(1 / 4)
    assert legacy["actor/pg_clipfrac"].item() == pytest.approx(1 / 3)
    # seq-mean over global_batch_size rows: 4 with the padding row, 3 without
    assert v1["actor/pg_loss"].item() == pytest.approx(legacy["actor/pg_loss"].item() * 3 / 4, rel=1e-6)


def test_padding_rows_are_128_tokens_long_from_verl_0_9_1():
    assert batch_layout(settings(**{DP: 2, "rldiag.verl_version": "0.9.1"})).pad_seq_len == 128
    for older in ("0.9.0", "main"):
        assert batch_layout(settings(**{DP: 2, "rldiag.verl_version": older})).pad_seq_len == 2
    # their workload moves real rows between ranks: rows of 130, 129 and 1 tokens plus one padding row
    seq = torch.tensor([130, 129, 1])
    sid = torch.zeros(3, dtype=torch.long)
    got = {}
    for version, pad in (("0.9.1", 128), ("0.9.0", 2)):
        seg, _ = segmentations_for(sid, 1, settings(**{DP: 2, "rldiag.verl_version": version}), seq)
        order = dispatch_order(workload(torch.tensor([130, 129, 1, pad])).tolist(), 2)
        want = {0: sorted(j for j in order[:2] if j < 3), 1: sorted(j for j in order[2:] if j < 3)}
        assert _ranks(seg, 3) == want, version
        got[version] = want
    assert got["0.9.1"] != got["0.9.0"]


def test_shuffle_is_torchs_dataloader_with_a_generator_seeded_per_rank():
    # the DataLoader draws its base seed from the generator first, then the sampler's permutation
    g = torch.Generator()
    g.manual_seed(42 + 1)
    torch.empty((), dtype=torch.int64).random_(generator=g)
    assert dataloader_order(6, 43).tolist() == torch.randperm(6, generator=g).tolist()
    # one rank, 4 rows, mini-batches of 2: the shuffled order picks the mini-batches
    sid = torch.zeros(4, dtype=torch.long)
    seg, _ = segmentations_for(sid, 1, settings(**{MINI: 2, A + "shuffle": True, A + "data_loader_seed": 5}))
    perm = dataloader_order(4, 5).tolist()
    minis = seg.row_mini.tolist()
    assert {perm[0], perm[1]} == {j for j in range(4) if minis[j] == minis[perm[0]]}
    assert minis[perm[0]] != minis[perm[2]]


def test_token_budget_micro_batches():
    # 3 rows of 100 tokens, budget 160: ceil(300 / 160) = 2 micro-batches hold 100 and 200 tokens;
    # verl 0.9.1 adds one until each fits, earlier releases keep the first partition
    assert sorted(token_budget_micro_batches([[100, 100, 100]], 160, until_within=True)[0]) == [0, 1, 2]
    assert len(set(token_budget_micro_batches([[100, 100, 100]], 160, until_within=False)[0])) == 2
    # the ranks agree on the count: rank 0 needs 1 micro-batch, rank 1 two -> both cut two
    r0, r1 = token_budget_micro_batches([[10, 10], [100, 100]], 120, until_within=True)
    assert sorted(r0) == [0, 1] and sorted(r1) == [0, 1]
    with pytest.raises(BudgetError, match="exceeds the token budget 90"):
        token_budget_micro_batches([[10, 100]], 90, until_within=True)
    with pytest.raises(BudgetError, match="only 1 rows"):
        token_budget_micro_batches([[100], [100, 100, 100]], 150, until_within=True)


def test_dynamic_bsz_in_the_pipeline_and_a_step_verl_raises_on():
    b = make_batch(scores=[[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]], mask=[[1, 1], [1, 1], [1, 1]], uids=["g", "g", "g"],
                   old_log_probs=[[-1.0, -1.0]] * 3, log_probs=[[-0.5, -1.0], [-1.0, -1.0], [-1.0, -2.0]])
    on = {A + "use_dynamic_bsz": True, A + "ppo_max_token_len_per_gpu": 2}  # one row (2 tokens) per micro-batch
    r = recompute_batch(b, settings(estimator="grpo", **on))
    per_row = recompute_batch(b, settings(estimator="grpo", **{MB: 1}))
    assert not r.failed
    torch.testing.assert_close(r.metrics["actor/pg_clipfrac"], per_row.metrics["actor/pg_clipfrac"])
    tight = recompute_batch(b, settings(estimator="grpo", **{A + "use_dynamic_bsz": True, A + "ppo_max_token_len_per_gpu": 1}))
    assert list(tight.failed) == [1] and "exceeds the token budget 1" in tight.failed[1]


def test_the_critic_has_its_own_cut():
    cfg = {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
                                 "rollout": {"n": 1}},
           "critic": {"ppo_micro_batch_size_per_gpu": 1, "shuffle": True}}
    s = resolve_settings(config=cfg)
    lay = batch_layout(s)
    assert (lay.actor.micro, lay.critic.micro, lay.critic.mini, lay.critic.shuffle) == (2, 1, 4, True)
    actor, critic = segmentations_for(torch.zeros(4, dtype=torch.long), 1, s, torch.tensor([3, 3, 3, 3]))
    assert (actor.n_seg, critic.n_seg) == (2, 4)
    same = resolve_settings(config={"actor_rollout_ref": cfg["actor_rollout_ref"]})
    a2, c2 = segmentations_for(torch.zeros(4, dtype=torch.long), 1, same, torch.tensor([3, 3, 3, 3]))
    assert a2 is c2  # the critic's null keys take the actor's


@pytest.mark.parametrize("key, value", [
    (A + "ppo_max_token_len_per_gpu", 0), ("critic.ppo_max_token_len_per_gpu", -5), (A + "data_loader_seed", -1),
    ("trainer.critic_warmup", -1), ("critic.ppo_micro_batch_size_per_gpu", 0), ("critic.ppo_mini_batch_size", 0),
])
def test_layout_settings_out_of_range_are_refused(key, value):
    with pytest.raises(ConfigError, match="outside the valid range"):
        resolve_settings(overrides={key: value})


def test_recorded_places_put_the_padding_rows_in_the_gaps():
    # 3 rows stored at places 0, 2, 3 of a 4-row padded batch (dp 2): the padding row sat at place 1
    sid = torch.zeros(3, dtype=torch.long)
    s = settings(**{DP: 2, MB: 1, "rldiag.rows_balanced": True})
    seg, _ = segmentations_for(sid, 1, s, torch.tensor([5, 6, 7]), positions=torch.tensor([0, 2, 3]))
    assert _ranks(seg, 3) == {0: [0], 1: [1, 2]}
    assert seg.seg_pad.tolist() == [False, True, False, False]  # rank 0: row 0, then the padding row
    # without places: the padding rows at the end of the step
    seg, _ = segmentations_for(sid, 1, s, torch.tensor([5, 6, 7]))
    assert _ranks(seg, 3) == {0: [0, 1], 1: [2]} and seg.seg_pad.tolist() == [False, False, False, True]
    # a place beyond the padded batch (the parts of a separate_async step follow each other): the
    # step is as large as its places, 8 here, 4 per rank
    seg, _ = segmentations_for(sid, 1, s, torch.tensor([5, 6, 7]), positions=torch.tensor([0, 2, 7]))
    assert _ranks(seg, 3) == {0: [0, 1], 1: [2]} and seg.seg_pad.tolist().count(True) == 5 and not seg.failed
    assert seg.batch_size().tolist() == [8.0] * 8
