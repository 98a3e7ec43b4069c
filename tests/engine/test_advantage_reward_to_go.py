"""Reward-to-go estimators: reinforce_plus_plus (carrying through mask 0; verl 0.8.0 resetting), reinforce_plus_plus_baseline,
remax; gae against the shared references too. Worked examples, then property tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rldiag.errors import MissingInputError
from tests.conftest import make_batch
from tests.engine import reference_estimators as ref
from tests.engine.advantage_cases import HS, cases, check_against, run, settings_for


def _white(xs):
    t = torch.tensor(xs, dtype=torch.float64)
    return ((t - t.mean()) / torch.sqrt(t.var(unbiased=True) + 1e-8)).tolist()


def test_reinforce_pp_tool_gap_example_carries_through_the_tool_span():
    # assistant / tool observation / final assistant, reward only at the end (verl commit 8a1bf6d5b)
    b = make_batch(scores=[[0, 0, 1.0], [0, 0, 0.0]], mask=[[1, 0, 1], [1, 1, 1]], uids=["a", "b"])
    adv, ret, failed = run("reinforce_plus_plus", b)
    assert ret[0].tolist() == [1.0, 0.0, 1.0]  # the reward reaches the first turn; 0 at the tool token
    assert ret[1].tolist() == [0.0, 0.0, 0.0]
    w = _white([1.0, 1.0, 0.0, 0.0, 0.0])  # whitened over the 5 mask-1 tokens
    assert adv[0].tolist() == pytest.approx([w[0], 0.0, w[1]], abs=1e-6)
    assert adv[1].tolist() == pytest.approx(w[2:], abs=1e-6)
    assert not failed


def test_reinforce_pp_tool_gap_example_resets_under_verl_0_8():
    b = make_batch(scores=[[0, 0, 1.0], [0, 0, 0.0]], mask=[[1, 0, 1], [1, 1, 1]], uids=["a", "b"])
    adv, ret, failed = run("reinforce_plus_plus", b, settings_for("reinforce_plus_plus", **{"rldiag.verl_version": "0.8.0"}))
    assert ret[0].tolist() == [0.0, 1.0, 1.0]  # the tool token keeps its future, cuts it off before
    w = _white([0.0, 1.0, 0.0, 0.0, 0.0])
    assert adv[0].tolist() == pytest.approx([w[0], 0.0, w[1]], abs=1e-6)
    assert not failed


def test_reinforce_pp_carry_discounts_past_the_span():
    # gamma applies once per mask-1 token: the tool tokens are skipped, not counted
    b = make_batch(scores=[[0, 0, 0, 1.0], [0, 0, 0, 0.0]], mask=[[1, 0, 0, 1], [1, 1, 1, 1]])
    _, ret, _ = run("reinforce_plus_plus", b, settings_for("reinforce_plus_plus", gamma=0.5))
    assert ret[0].tolist() == pytest.approx([0.5, 0.0, 0.0, 1.0])


def test_reinforce_pp_discounts_with_gamma():
    b = make_batch(scores=[[1.0, 0, 2.0], [0, 0, 0.0]], mask=[[1, 1, 1], [1, 1, 1]])
    _, ret, _ = run("reinforce_plus_plus", b, settings_for("reinforce_plus_plus", gamma=0.5))
    assert ret[0].tolist() == pytest.approx([1.5, 1.0, 2.0])


def test_reinforce_pp_single_token_step_fails():
    b = make_batch(scores=[[1.0, 0], [1.0, 1.0], [0.0, 2.0]], mask=[[1, 0], [1, 1], [1, 1]], steps=[1, 2, 2])
    _, _, failed = run("reinforce_plus_plus", b)
    assert list(failed) == [1] and "single token" in failed[1]


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    # group g = [1, 0] -> [0.5, -0.5]; singleton s keeps its score 2; tokens: 2 + 2 + 1 masked
    b = make_batch(scores=[[0, 1.0], [0, 0.0], [0, 2.0]], mask=[[1, 1], [1, 1], [0, 1]], uids=["g", "g", "s"])
    adv, ret, _ = run("reinforce_plus_plus_baseline", b)
    w = _white([0.5, 0.5, -0.5, -0.5, 2.0])
    assert adv[0].tolist() == pytest.approx(w[0:2], abs=1e-6)
    assert adv[1].tolist() == pytest.approx(w[2:4], abs=1e-6)
    assert adv[2].tolist() == pytest.approx([0.0, w[4]], abs=1e-6)
    assert torch.equal(adv, ret)


def test_remax_subtracts_greedy_reward_on_action_tokens():
    b = make_batch(scores=[[0, 0, 1.0]], mask=[[1, 0, 1]], reward_baselines=[0.4])
    adv, ret, _ = run("remax", b)
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0])  # no reset, undiscounted
    assert adv[0].tolist() == pytest.approx([0.6, 1.0, 0.6])  # the tool token keeps its return


def test_remax_needs_reward_baselines():
    b = make_batch(scores=[[0, 1.0]], mask=[[1, 1]])
    with pytest.raises(MissingInputError, match="'reward_baselines'"):
        run("remax", b)


def test_gae_matches_seed_worked_example_through_the_registry():
    b = make_batch(scores=[[0, 0, 1.0]], mask=[[1, 1, 1]], values=[[0.2, 0.3, 0.4]])
    adv, ret, _ = run("gae", b, settings_for("gae", lam=0.95))
    assert ret[0].tolist() == pytest.approx([0.9365, 0.97, 1.0], abs=1e-6)
    assert adv[0].tolist() == pytest.approx(_white([0.7365, 0.67, 0.6]), abs=1e-5)
    # float32 rounding of values ~0.7 (eps 6e-8) is scaled by 1/std ~ 15 when whitening: the mean
    # of the whitened values is 0 to about 1e-6, whatever order the recursion is evaluated in
    assert math.isclose(float(adv[0].mean()), 0.0, abs_tol=3e-6)


# ---- properties -------------------------------------------------------------------------------

STEPS = st.lists(cases(), min_size=1, max_size=3)


@HS
@given(STEPS, st.sampled_from([1.0, 0.9, 0.5]), st.sampled_from(["0.8.0", "0.9.1", "0.10.0.dev"]))
def test_reinforce_pp_matches_reference(cs, gamma, version):
    carry = version != "0.8.0"
    check_against("reinforce_plus_plus", cs, lambda c: ref.reinforce_plus_plus(c.rewards, c.mask, gamma, carry),
                  settings_for("reinforce_plus_plus", gamma=gamma, **{"rldiag.verl_version": version}), rtol=1e-4)


@HS
@given(STEPS)
def test_reinforce_pp_baseline_matches_reference(cs):
    check_against("reinforce_plus_plus_baseline", cs,
                  lambda c: ref.reinforce_plus_plus_baseline(c.rewards, c.mask, c.uids), rtol=1e-4)


@HS
@given(STEPS)
def test_remax_matches_reference(cs):
    check_against("remax", cs, lambda c: ref.remax(c.rewards, c.mask, c.baselines))


def _gae_ref(c, gamma, lam):
    from tests.engine.reference_core import gae_ref

    L = c.mask.shape[1]
    if c.mask.sum() < 2:
        raise ValueError("whitening needs two tokens")
    adv, ret = gae_ref(c.rewards.tolist(), c.values.tolist(), c.mask.tolist(), gamma, lam)
    return torch.tensor(adv, dtype=torch.float32)[:, :L], torch.tensor(ret, dtype=torch.float32)[:, :L]


@HS
@given(STEPS, st.sampled_from([(1.0, 1.0), (0.99, 0.95)]))
def test_gae_matches_reference_on_the_same_cases(cs, gl):
    # the shared reference is float64; where a step's whitening variance is small, float32 rounding
    # is amplified at mask-0 positions (in verl too), hence rtol 1e-3
    check_against("gae", cs, lambda c: _gae_ref(c, *gl), settings_for("gae", gamma=gl[0], lam=gl[1]), rtol=1e-3, atol=1e-4)
