"""The agentic estimators of Claw-R1 (claw_r1/core_algos.py): step_gae, token_gae_cross_step, traj_grpo.
Worked examples, input errors, and property tests against per-trajectory reference loops."""

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
from tests.engine.packing import to_padded

H = 0.5 / (math.sqrt(0.5) + 1e-6)


def _agent_batch(scores, mask, values, traj, steps_in_traj, uids=None, run_steps=None):
    b = make_batch(scores=scores, mask=mask, values=values, uids=uids, steps=run_steps)
    b.extra["traj_uid"] = torch.tensor(traj)
    b.extra["step_index"] = torch.tensor(steps_in_traj)
    return b


def test_step_gae_recursion_over_steps_and_step_level_whitening():
    # trajectory 0: step 0 (reward 0, V 0.5), step 1 (reward 1, V 0.8); gamma = lambda = 1
    # A1 = 1 - 0.8 = 0.2, A0 = 0 + 0.8 - 0.5 + 0.2 = 0.5; returns 1.0 and 1.0
    b = _agent_batch(
        scores=[[0, 0, 1.0], [0, 7.0, 0]],  # row 1 (step 0) has a reward on a tool token: ignored
        mask=[[1, 1, 1], [1, 0, 1]],
        values=[[0.8, 9, 9], [0.5, 9, 9]],  # only the first token's value is the step value
        traj=[0, 0], steps_in_traj=[1, 0],
    )
    adv, ret, failed = run("step_gae", b)
    assert ret[0].tolist() == pytest.approx([1.0] * 3) and ret[1].tolist() == pytest.approx([1.0, 0.0, 1.0])
    w = (0.5 - 0.35) / (math.sqrt(0.045) + 1e-8)  # sample std of {0.5, 0.2}
    assert adv[1].tolist() == pytest.approx([w, 0.0, w], rel=1e-5)
    assert adv[0].tolist() == pytest.approx([-w] * 3, rel=1e-5)
    assert not failed


def test_step_gae_discount_and_gap():
    # step indices 0 and 2: index 1 is missing and counts as reward 0, value 0
    b = _agent_batch(scores=[[1.0], [0.0], [0.0]], mask=[[1]] * 3, values=[[0.0], [0.0], [0.3]],
                     traj=[0, 0, 1], steps_in_traj=[2, 0, 0])
    _, ret, _ = run("step_gae", b, settings_for("step_gae", gamma=0.5, lam=1.0))
    # A2 = 1; A1 = 0 + 0.5*0 - 0 + 0.5*1 = 0.5; A0 = 0.5*0.5 = 0.25; trajectory 1: A0 = -0.3
    assert ret[:, 0].tolist() == pytest.approx([1.0, 0.25, 0.0], abs=1e-7)


def test_step_gae_single_row_step_fails():
    b = _agent_batch(scores=[[1.0], [0.0], [1.0]], mask=[[1]] * 3, values=[[0.1]] * 3,
                     traj=[0, 1, 2], steps_in_traj=[0, 0, 0], run_steps=[1, 1, 2])
    _, _, failed = run("step_gae", b)
    assert list(failed) == [2] and "at least 2 rows" in failed[2]


def test_token_gae_crosses_steps_and_skips_tool_tokens():
    # trajectory: step 0 = [action, tool, action], step 1 = [action, reward 1]; rows out of order
    b = _agent_batch(
        scores=[[1.0, 0, 0], [0, 5.0, 0]],
        mask=[[1, 0, 0], [1, 0, 1]],
        values=[[0.4, 0, 0], [0.1, 9.0, 0.2]],
        traj=[3, 3], steps_in_traj=[1, 0],
    )
    adv, ret, failed = run("token_gae_cross_step", b)
    # action sequence (r, V): (0, .1) (0, .2) | (1, .4): A = .9, .8 | .6 ; tool reward 5 ignored
    assert ret[1].tolist() == pytest.approx([1.0, 0.0, 1.0], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([1.0, 0.0, 0.0], abs=1e-6)
    raw = torch.tensor([[0.6, 0, 0], [0.9, 0, 0.8]])
    m = to_padded(b.response_mask, b.rows)
    mean = (raw * m).sum() / 3
    var = (((raw - mean) ** 2) * m).sum() / 3 * 1.5
    torch.testing.assert_close(adv, (raw - mean) * torch.rsqrt(var + 1e-8), rtol=1e-5, atol=1e-6)
    assert not failed
    # one row per trajectory is plain (mask-skipping) GAE on the action tokens (gae carries its
    # running advantage into tool positions, token_gae_cross_step zeroes them before whitening)
    solo = _agent_batch(scores=[[0, 5.0, 1.0]], mask=[[1, 0, 1]], values=[[0.2, 9.0, 0.4]], traj=[0], steps_in_traj=[0])
    g, _, _ = run("gae", solo)
    t, _, _ = run("token_gae_cross_step", solo)
    m = to_padded(solo.response_mask, solo.rows)
    torch.testing.assert_close(t * m, g * m)


def test_traj_grpo_sums_steps_per_trajectory():
    # group u: trajectory 1 = rows 0, 1 (scores 0 + 1), trajectory 2 = row 2 (score 0)
    b = _agent_batch(scores=[[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]], mask=[[1, 1], [1, 1], [1, 0]],
                     values=[[0, 0]] * 3, traj=[1, 1, 2], steps_in_traj=[0, 1, 0], uids=["u"] * 3)
    adv, ret, _ = run("traj_grpo", b)
    assert adv.tolist() == [pytest.approx([H, H]), pytest.approx([H, H]), pytest.approx([-H, 0.0])]
    assert torch.equal(adv, ret)
    adv2, _, _ = run("traj_grpo", b, settings_for("traj_grpo", norm=False))
    assert adv2[:, 0].tolist() == pytest.approx([0.5, 0.5, -0.5])


def test_duplicate_agent_step_fails_the_step_and_missing_columns_are_named():
    b = _agent_batch(scores=[[1.0], [0.0]], mask=[[1]] * 2, values=[[0.1]] * 2, traj=[0, 0], steps_in_traj=[0, 0])
    for name in ("step_gae", "token_gae_cross_step"):
        _, _, failed = run(name, b)
        assert "share one (traj_uid, step_index)" in failed[1]
    b.extra.pop("step_index")
    with pytest.raises(MissingInputError, match="'step_index'"):
        run("step_gae", b)
    b.extra.pop("traj_uid")
    with pytest.raises(MissingInputError, match="'traj_uid'"):
        run("traj_grpo", b)


STEPS = st.lists(cases(), min_size=1, max_size=3)
GL = st.sampled_from([(1.0, 1.0), (0.9, 0.95)])


@HS
@given(STEPS, GL)
def test_step_gae_matches_reference(cs, gl):
    check_against("step_gae", cs, lambda c: ref.step_gae(c.rewards, c.mask, c.values, c.traj, c.step_idx, *gl),
                  settings_for("step_gae", gamma=gl[0], lam=gl[1]), rtol=1e-4, atol=1e-4)


@HS
@given(STEPS, GL)
def test_token_gae_cross_step_matches_reference(cs, gl):
    check_against("token_gae_cross_step", cs,
                  lambda c: ref.token_gae_cross_step(c.rewards, c.mask, c.values, c.traj, c.step_idx, *gl),
                  settings_for("token_gae_cross_step", gamma=gl[0], lam=gl[1]), rtol=1e-4, atol=1e-4)


@HS
@given(STEPS, st.booleans())
def test_traj_grpo_matches_reference(cs, norm):
    check_against("traj_grpo", cs, lambda c: ref.traj_grpo(c.rewards, c.mask, c.uids, c.traj, norm),
                  settings_for("traj_grpo", norm=norm))
