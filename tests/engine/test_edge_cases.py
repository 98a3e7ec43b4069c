"""verl's edge cases: singleton and all-equal groups, tool gaps, fully masked rows,
one-token batches (a failed step, the others go on)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_batch, settings
from tests.engine.packing import recompute_padded


def test_all_equal_group_gives_zero_advantage_and_no_nan():
    b = make_batch(scores=[[1.0], [1.0], [1.0]], mask=[[1]] * 3, uids=["g"] * 3)
    for est in ("grpo", "rloo"):
        adv = recompute_padded(b, settings(estimator=est)).tokens["advantages"]
        assert torch.isfinite(adv).all()
        assert adv.abs().max().item() == 0.0


def test_fully_masked_row_gets_zero_grpo_advantage_but_its_score_counts():
    # the masked row's reward still enters the group mean (compute_grpo_outcome_advantage sums scores unmasked)
    b = make_batch(scores=[[1.0, 0], [0.0, 0], [0, 0.0]], mask=[[1, 1], [1, 1], [0, 0]], uids=["g"] * 3)
    r = recompute_padded(b, settings(estimator="rloo"))
    adv = r.tokens["advantages"]
    assert adv[2].abs().max().item() == 0.0
    assert adv[0, 0].item() == pytest.approx(1.0 - 0.0)  # baseline = mean(0, 0)


def test_one_token_step_fails_under_gae_and_other_steps_go_on():
    b = make_batch(
        scores=[[1.0, 0], [0.0, 1.0], [1.0, 0.0]],
        mask=[[1, 0], [1, 1], [1, 1]],
        steps=[7, 8, 8],
        lengths=[1, 2, 2],
        values=[[0.5, 0], [0.1, 0.2], [0.3, 0.1]],
    )
    r = recompute_padded(b, settings(estimator="gae"))
    assert list(r.failed) == [7]
    assert "single token" in r.failed[7]
    adv = r.tokens["advantages"][1:]
    assert torch.isfinite(adv).all()
    assert float(adv[r.tokens["response_mask"][1:].bool()].mean()) == pytest.approx(0.0, abs=1e-6)


def test_step_without_any_actor_token_fails_under_gae():
    b = make_batch(scores=[[1.0, 0.0]], mask=[[0, 0]], values=[[0.1, 0.2]])
    r = recompute_padded(b, settings(estimator="gae"))
    assert 1 in r.failed and "no token" in r.failed[1]


def test_one_token_step_is_fine_for_grpo():
    b = make_batch(scores=[[1.0]], mask=[[1]], uids=["g"])
    r = recompute_padded(b, settings(estimator="grpo"))
    assert not r.failed


def test_aborted_rows_are_excluded_from_score_and_length_stats():
    b = make_batch(scores=[[1.0, 0.0], [0.0, 0.0]], mask=[[1, 1], [0, 0]], lengths=[2, 0], uids=["a", "b"])
    m = recompute_padded(b, settings(estimator="grpo")).metrics
    assert m["response/aborted_ratio"].item() == pytest.approx(0.5)
    assert m["critic/score/mean"].item() == pytest.approx(1.0)
    assert m["response_length/mean"].item() == pytest.approx(1.0)
    assert m["response_length_non_aborted/mean"].item() == pytest.approx(2.0)
    assert m["response_length/clip_ratio"].item() == pytest.approx(0.5)


def test_explained_variance_matches_definition():
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    val = torch.tensor([[1.5, 1.5, 3.5, 3.0]])
    from rldiag.engine.critic import explained_variance
    from tests.engine.packing import to_packed

    (rf, rows), (vf, _), (mf, _) = (to_packed(t, [4]) for t in (ret, val, torch.ones(1, 4)))
    ev = explained_variance(rf, vf, mf, rows, torch.zeros(1, dtype=torch.long), 1).item()
    expect = 1 - torch.var(ret - val).item() / (torch.var(ret).item() + 1e-5)
    assert ev == pytest.approx(expect, rel=1e-6)


def test_unknown_estimator_lists_valid_keys():
    from rldiag.errors import UnknownKeyError

    b = make_batch(scores=[[1.0]], mask=[[1]])
    with pytest.raises(UnknownKeyError) as exc:
        recompute_padded(b, settings(estimator="no_such"))
    assert "grpo" in str(exc.value) and "rloo" in str(exc.value)


def test_centre_offset_of_a_constant_advantage_is_infinite_in_every_row_order():
    # the masked row's score moves the group mean; the two live rows then share one nonzero
    # advantage, whose float32 std is rounding noise (1e7 or inf, by row order, before the fix)
    import itertools

    scores = [[0.0, 0.0, 2.006856770707084], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    masks = [[0, 0, 0], [1, 1, 1], [1, 1, 0]]
    lengths = [3, 3, 2]
    for order in itertools.permutations(range(3)):
        b = make_batch(scores=[scores[i] for i in order], mask=[masks[i] for i in order], uids=["g"] * 3,
                       lengths=[lengths[i] for i in order])
        off = recompute_padded(b, settings(estimator="grpo")).metrics["rldiag/advantages/centre_offset"]
        assert off.item() == float("-inf"), order


def test_centre_offset_is_mean_over_std():
    # the masked row's score moves the group mean: the live rows' advantages do not centre on 0
    b = make_batch(scores=[[3.0], [1.0], [0.0]], mask=[[0], [1], [1]], uids=["g"] * 3)
    r = recompute_padded(b, settings(estimator="grpo"))
    adv = r.tokens["advantages"][1:, 0].double()
    want = adv.mean() / adv.std(unbiased=False)
    assert want.item() == pytest.approx(-5 / 3, rel=1e-3)
    assert r.metrics["rldiag/advantages/centre_offset"].item() == pytest.approx(want.item(), rel=1e-5)
