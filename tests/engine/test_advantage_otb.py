"""optimal_token_baseline and tir_optimal_token_baseline: worked examples (with pi = 0.5 and
sum_pi_squared = 0.5 every token's w = 1 - 2*0.5 + 0.5 = 0.5), the zero-tail rule, IS weights,
the missing-column message, and property tests against per-group reference loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rldiag.engine.advantage import ESTIMATORS, AdvInput
from rldiag.engine.step_failures import StepErrors
from rldiag.errors import MissingInputError
from tests.conftest import make_batch
from tests.engine import reference_estimators as ref
from tests.engine.advantage_cases import HS, cases, check_against, run, settings_for
from tests.engine.packing import to_packed, to_padded

LOG_HALF = math.log(0.5)


def _eq(got: torch.Tensor, want) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), rtol=0, atol=1e-6)


def _otb_batch(scores, mask, lengths=None):
    b = make_batch(scores=scores, mask=mask, uids=["g"] * len(mask), lengths=lengths,
                   old_log_probs=[[LOG_HALF] * len(mask[0])] * len(mask))
    b.extra["sum_pi_squared"] = torch.full_like(b.response_mask, 0.5)
    b.token_extra = ("sum_pi_squared",)
    return b


def test_otb_equal_lengths():
    # W row0 = W row1 = [0.5, 1.0]; G row0 = [1, 1], row1 = [0, 0] -> B = [0.5, 0.5]
    b = _otb_batch([[0, 1.0], [0, 0.0]], [[1, 1], [1, 1]])
    adv, ret, _ = run("optimal_token_baseline", b)
    assert ret.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    _eq(adv, [[0.5, 0.5], [-0.5, -0.5]])


def test_otb_zero_tail_of_the_strictly_longest_row():
    # row 0 has 3 tokens, row 1 two: B_2 = 1 would cancel row 0's last return, but the baseline of
    # the strictly longest row is 0 from position 2 (the second longest length) on
    b = _otb_batch([[0, 0, 1.0], [0, 0, 0.0]], [[1, 1, 1], [1, 1, 0]], lengths=[3, 2])
    adv, _, _ = run("optimal_token_baseline", b)
    assert adv[0].tolist() == pytest.approx([0.5, 0.5, 1.0], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([-0.5, -0.5, 0.0], abs=1e-6)


def test_tir_packs_action_tokens_but_plain_otb_uses_raw_positions():
    # row 0 = action, tool, action; row 1 = two actions. Action ranks line up under TIR only.
    b = _otb_batch([[0, 0, 1.0], [0, 0, 0.0]], [[1, 0, 1], [1, 1, 0]], lengths=[3, 2])
    tir, ret, _ = run("tir_optimal_token_baseline", b)
    assert ret[0].tolist() == [1.0, 1.0, 1.0]
    _eq(tir, [[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]])
    raw, _, _ = run("optimal_token_baseline", b)
    # position 1: only row 1 acts (G = 0) -> B_1 = 0; position 2: only row 0 -> B_2 = G = 1
    _eq(raw, [[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]])


def test_otb_singleton_group_has_no_baseline():
    b = _otb_batch([[0, 2.0]], [[1, 1]])
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        adv, ret, _ = run(name, b)
        assert adv.tolist() == [[2.0, 2.0]] and torch.equal(adv, ret)


def test_otb_rollout_is_weights_scale_w_by_their_square():
    b = _otb_batch([[0, 1.0], [0, 0.0]], [[1, 1], [1, 1]])
    isw = to_packed(torch.tensor([[2.0, 2.0], [1.0, 1.0]]), b.lengths)[0]
    inp = AdvInput(b, b.token_level_scores, b.response_mask, settings_for("optimal_token_baseline"),
                   StepErrors(b.steps), rollout_is_weights=isw)
    adv, _ = ESTIMATORS.get("optimal_token_baseline")(inp)
    adv = to_padded(adv, b.rows)
    # W row0 = [2, 4], row1 = [0.5, 1] -> B = [2/2.5, 4/5] = 0.8
    _eq(adv, [[0.2, 0.2], [-0.8, -0.8]])


def test_otb_names_the_missing_column():
    b = _otb_batch([[0, 1.0]], [[1, 1]])
    b.extra.clear()
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        with pytest.raises(MissingInputError, match="'sum_pi_squared'.*calculate_sum_pi_squared"):
            run(name, b)
    b2 = make_batch(scores=[[0, 1.0]], mask=[[1, 1]])
    b2.extra["sum_pi_squared"] = torch.ones(2)
    with pytest.raises(MissingInputError, match="'old_log_probs'"):
        run("optimal_token_baseline", b2)
    assert ESTIMATORS.meta("tir_optimal_token_baseline").needs == ("old_log_probs", "sum_pi_squared")


STEPS = st.lists(cases(max_rows=6), min_size=1, max_size=3)


@HS
@given(STEPS)
def test_otb_matches_reference(cs):
    check_against("optimal_token_baseline", cs,
                  lambda c: ref.optimal_token_baseline(c.rewards, c.mask, c.uids, c.old_lp, c.spp), rtol=1e-4, atol=1e-4)


@HS
@given(STEPS)
def test_tir_otb_matches_reference(cs):
    check_against("tir_optimal_token_baseline", cs,
                  lambda c: ref.tir_optimal_token_baseline(c.rewards, c.mask, c.uids, c.old_lp, c.spp),
                  rtol=1e-4, atol=1e-4)
