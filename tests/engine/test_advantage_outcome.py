"""Outcome estimators (one scalar per row): grpo (and V1 session folding), grpo_vectorized,
grpo_passk, gdpo, rloo_vectorized, opo, gpg. Worked examples, then property tests against the
per-group reference loops on random multi-step batches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rldiag.errors import ConfigError, MissingInputError
from tests.conftest import make_batch
from tests.engine import reference_estimators as ref
from tests.engine.advantage_cases import HS, cases, check_against, run, settings_for

A = 0.5 / (0.5 + 1e-6)  # GRPO of {1, 0, 0.5}: (1 - 0.5) / (0.5 + 1e-6)
H = 0.5 / (math.sqrt(0.5) + 1e-6)  # a group of two scores {1, 0}: (1 - 0.5) / (0.7071 + 1e-6)


def _seed_group(extra_rows=(), extra_uids=()):
    return make_batch(
        scores=[[1.0], [0.0], [0.5], *extra_rows], mask=[[1]] * (3 + len(extra_rows)), uids=["A"] * 3 + list(extra_uids)
    )


def _adv(name, b, **kw):
    adv, ret, failed = run(name, b, settings_for(name, **kw))
    return adv, ret, failed


# ---- worked examples --------------------------------------------------------------------------


def test_grpo_vectorized_seed_example_and_ignores_the_std_flag():
    b = _seed_group([[3.0]], ["solo"])
    for norm in (True, False):  # verl's V1 dispatcher never passes the flag to grpo_vectorized
        adv, ret, failed = _adv("grpo_vectorized", b, norm=norm)
        assert adv[:, 0].tolist() == pytest.approx([A, -A, 0.0, 3.0 / (1 + 1e-6)], rel=1e-6, abs=1e-7)
        assert torch.equal(adv, ret) and not failed
    dr, _, _ = _adv("grpo", b, norm=False)  # the exact key does honour it (Dr. GRPO)
    assert dr[:3, 0].tolist() == pytest.approx([0.5, -0.5, 0.0])


@pytest.mark.parametrize("centre,spread", [(0.9, 1e-3), (0.5, 1e-4), (100.0, 0.5)])
def test_grpo_vectorized_keeps_the_advantage_of_close_scores(centre, spread):
    # reward-model scores: a small spread around a non-zero mean. A one-pass float32 variance
    # (sum x^2 - (sum x)^2 / n) cancels here; centring first gives the float64 answer to float32
    # precision.
    g, n = 64, 8
    gen = torch.Generator().manual_seed(7)
    scores = (centre + spread * torch.randn(g * n, generator=gen, dtype=torch.float64)).to(torch.float32)
    b = make_batch(scores=scores.view(-1, 1).tolist(), mask=[[1]] * (g * n), uids=[i // n for i in range(g * n)])
    adv, _, failed = _adv("grpo_vectorized", b)
    x = scores.to(torch.float64).view(g, n)
    exact = ((x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-6)).flatten()
    assert not failed
    assert torch.allclose(adv[:, 0].to(torch.float64), exact, rtol=2e-3, atol=2e-3)


def _sessions(mask1=(1, 1)):
    # uid A: session s1 = rows 0 (output 0, score 0) and 1 (output 1, score 1); session s2 = row 2
    # (output 0, score 0). uid B: row 3 alone.
    b = make_batch(
        scores=[[0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 2.0]],
        mask=[[1, 1], list(mask1), [1, 1], [1, 0]],
        uids=["A", "A", "A", "B"],
    )
    b.extra["session_id"] = torch.tensor([0, 0, 1, 2])
    b.extra["output_index"] = torch.tensor([0, 1, 0, 5])
    return b


def test_grpo_folds_each_session_to_its_final_output():
    adv, ret, _ = _adv("grpo", _sessions())
    # finals of A: row 1 (score 1) and row 2 (score 0) -> +-H; row 0 shares row 1's advantage
    assert adv[:, 0].tolist() == pytest.approx([H, H, -H, 2.0 / (1 + 1e-6)], abs=1e-6)
    assert adv[3].tolist() == pytest.approx([2.0 / (1 + 1e-6), 0.0], abs=1e-6)  # broadcast times own mask
    assert torch.equal(adv, ret)
    # without the session columns every row is its own sample: mean 1/3, std 0.57735
    plain, _, _ = _adv("grpo", make_batch(scores=[[0, 0.0], [0, 1.0], [0, 0.0]], mask=[[1, 1]] * 3, uids=["A"] * 3))
    assert plain[1, 0].item() == pytest.approx((1 - 1 / 3) / (math.sqrt(1 / 3) + 1e-6), rel=1e-6)


def test_grpo_fold_reads_final_output_at_its_first_action_token():
    # the final output is fully masked: verl reads its advantage at position 0 (= 0), so the
    # whole session gets 0 although row 0 has action tokens
    adv, _, _ = _adv("grpo", _sessions(mask1=(0, 0)))
    assert adv[0].tolist() == [0.0, 0.0]
    assert adv[1].tolist() == [0.0, 0.0]
    assert adv[2, 0].item() == pytest.approx(-H, abs=1e-6)


def test_other_estimators_see_every_output_row():
    a1, _, _ = _adv("rloo", _sessions())
    b = _sessions()
    b.extra.clear()
    a2, _, _ = _adv("rloo", b)
    assert torch.equal(a1, a2)


def test_grpo_passk_credits_only_the_best_row():
    b = _seed_group([[2.0], [2.0]], ["T", "T"])
    adv, ret, failed = _adv("grpo_passk", b)
    assert adv[:, 0].tolist() == pytest.approx([A, 0.0, 0.0, 0.0, 0.0], abs=1e-7)  # a tie at the top gives 0
    assert not failed and torch.equal(adv, ret)
    adv2, _, _ = _adv("grpo_passk", b, norm=False)  # grpo_passk reads the flag from the config
    assert adv2[:, 0].tolist() == pytest.approx([0.5, 0, 0, 0, 0])


def test_grpo_passk_singleton_group_fails_only_its_step():
    b = make_batch(
        scores=[[1.0], [0.0], [4.0]], mask=[[1]] * 3, uids=["A", "A", "solo"], steps=[1, 1, 2],
    )
    adv, _, failed = _adv("grpo_passk", b)
    assert list(failed) == [2] and "at least 2 samples" in failed[2]
    assert adv[:2, 0].tolist() == pytest.approx([1.0 / (math.sqrt(0.5) + 1e-6), 0.0], rel=1e-6)


def _gdpo_batch():
    b = make_batch(scores=[[0.0]] * 4, mask=[[1]] * 4, uids=["a", "a", "b", "b"])
    b.extra["acc"] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    b.extra["fmt"] = torch.tensor([0.0, 1.0, 0.0, 1.0])
    return b


def test_gdpo_normalises_each_component_then_whitens():
    # per component GRPO in groups of two: +-H; sums (w = 1, 1): [0, 0, -2H, 2H] -> whitened
    adv, ret, failed = _adv("gdpo", _gdpo_batch(), **{"algorithm.gdpo_reward_weights": None})
    s = math.sqrt(8 / 3)
    assert adv[:, 0].tolist() == pytest.approx([0, 0, -2 / s, 2 / s], abs=1e-5)
    # weights (1, 0.5): [0.5H, -0.5H, -1.5H, 1.5H] -> Bessel variance 5H^2/3
    adv, ret, _ = _adv("gdpo", _gdpo_batch())
    s = math.sqrt(5 / 3)
    assert adv[:, 0].tolist() == pytest.approx([0.5 / s, -0.5 / s, -1.5 / s, 1.5 / s], abs=1e-5)
    # the std flag is never passed to gdpo in verl: the same numbers without it
    adv_nostd, _, _ = _adv("gdpo", _gdpo_batch(), norm=False)
    assert torch.equal(adv, adv_nostd) and torch.equal(adv, ret) and not failed


def test_gdpo_errors_name_the_setting_or_column():
    with pytest.raises(ConfigError, match="gdpo_reward_keys"):
        _adv("gdpo", _gdpo_batch(), **{"algorithm.gdpo_reward_keys": None})
    with pytest.raises(MissingInputError, match="'correctness'"):
        _adv("gdpo", _gdpo_batch(), **{"algorithm.gdpo_reward_keys": "acc,correctness", "algorithm.gdpo_reward_weights": None})
    with pytest.raises(ConfigError, match="IndexError"):
        _adv("gdpo", _gdpo_batch(), **{"algorithm.gdpo_reward_weights": "1.0"})


def test_rloo_vectorized_zeroes_singletons():
    b = _seed_group([[3.0]], ["solo"])
    adv, _, _ = _adv("rloo_vectorized", b)
    assert adv[:, 0].tolist() == pytest.approx([0.75, -0.75, 0.0, 0.0], abs=1e-6)
    plain, _, _ = _adv("rloo", b)
    assert plain[3, 0].item() == 3.0


def test_opo_length_weighted_baseline_counts_action_tokens_only():
    # row 0: score 1 over 2 action tokens (a tool token between); row 1: score 0 over 4 tokens
    b = make_batch(scores=[[0, 0, 1.0, 0], [0, 0, 0, 0.0]], mask=[[1, 0, 1, 0], [1, 1, 1, 1]], uids=["g", "g"],
                   lengths=[3, 4])
    adv, _, _ = _adv("opo", b)
    base = (2 * 1.0 + 4 * 0.0) / 6
    assert adv[0].tolist() == pytest.approx([1 - base, 0, 1 - base, 0], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([-base] * 4, abs=1e-6)


def test_gpg_scales_by_inverse_share_of_nonzero_scores():
    b = make_batch(scores=[[1.0], [0.0], [0.0], [0.0], [2.0]], mask=[[1]] * 5, uids=["A", "A", "B", "B", "S"],
                   steps=[1, 1, 1, 1, 2])
    adv, _, _ = _adv("gpg", b)
    # step 1: alpha = 4 rows / 1 nonzero = 4; A: 4 * (+-0.5); B: 0. step 2: alpha 1, singleton mean 0
    assert adv[:, 0].tolist() == pytest.approx([2.0, -2.0, 0.0, 0.0, 2.0])


# ---- properties against the reference loops ---------------------------------------------------

STEPS = st.lists(cases(), min_size=1, max_size=3)


@HS
@given(STEPS, st.booleans())
def test_grpo_matches_reference(cs, norm):
    check_against("grpo", cs, lambda c: ref.grpo(c.rewards, c.mask, c.uids, norm),
                  settings_for("grpo", norm=norm), drop_extra=("session_id", "output_index"))


@HS
@given(STEPS, st.booleans())
def test_grpo_session_folding_matches_reference(cs, norm):
    check_against("grpo", cs, lambda c: ref.grpo_folded(c.rewards, c.mask, c.uids, c.sessions, c.out_idx, norm),
                  settings_for("grpo", norm=norm))


@HS
@given(STEPS)
def test_grpo_vectorized_matches_reference(cs):
    check_against("grpo_vectorized", cs, lambda c: ref.grpo_vectorized(c.rewards, c.mask, c.uids))


@HS
@given(STEPS, st.booleans())
def test_grpo_passk_matches_reference(cs, norm):
    check_against("grpo_passk", cs, lambda c: ref.grpo_passk(c.rewards, c.mask, c.uids, norm),
                  settings_for("grpo_passk", norm=norm))


@HS
@given(STEPS)
def test_gdpo_matches_reference(cs):
    check_against("gdpo", cs, lambda c: ref.gdpo(c.rewards, c.mask, c.uids, [c.comps["acc"], c.comps["fmt"]],
                                                 [1.0, 0.5], c.lengths), atol=2e-5)


@HS
@given(STEPS)
def test_rloo_and_rloo_vectorized_match_reference(cs):
    check_against("rloo", cs, lambda c: ref.rloo(c.rewards, c.mask, c.uids))
    check_against("rloo_vectorized", cs, lambda c: ref.rloo_vectorized(c.rewards, c.mask, c.uids))


@HS
@given(STEPS)
def test_opo_matches_reference(cs):
    check_against("opo", cs, lambda c: ref.opo(c.rewards, c.mask, c.uids))


@HS
@given(STEPS)
def test_gpg_matches_reference(cs):
    check_against("gpg", cs, lambda c: ref.gpg(c.rewards, c.mask, c.uids))
