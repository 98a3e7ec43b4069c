"""Each fast form in rldiag.engine.kernels equals its plain form (``*_plain``): the same values,
NaN and inf included, on random packed rows with holes in the mask."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine import kernels
from rldiag.engine.layout import Rows
from rldiag.engine.policy_loss.clip import ppo_terms

HS = hsettings(max_examples=80, deadline=None)

_SPECIAL = st.sampled_from([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-45, -1e-45, 3.0e38, -3.0e38])


@st.composite
def packed(draw, special=True):
    lengths = draw(st.lists(st.integers(0, 9), min_size=1, max_size=6))
    rows = Rows.from_lengths(torch.tensor(lengths))
    n = rows.n_tokens
    finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)
    elem = st.one_of(finite, _SPECIAL) if special else finite
    x = torch.tensor(draw(st.lists(elem, min_size=n, max_size=n)), dtype=torch.float32)
    y = torch.tensor(draw(st.lists(elem, min_size=n, max_size=n)), dtype=torch.float32)
    mask = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)), dtype=torch.float32)
    return rows, x, y, mask


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@HS
@given(packed())
def test_masked_row_sums_equal_plain(case):
    rows, x, _, mask = case
    _same(kernels.masked_row_sums(x, mask, rows), kernels.masked_row_sums_plain(x, mask, rows))
    _same(kernels.masked_row_square_sums(x, mask, rows), kernels.masked_row_square_sums_plain(x, mask, rows))
    _same(kernels.masked_row_sums(x, mask.bool(), rows), kernels.masked_row_sums_plain(x, mask, rows))


@HS
@given(packed())
def test_masked_counts_equal_plain(case):
    rows, x, y, mask = case
    _same(kernels.count_positive_masked(x, mask, rows), kernels.count_positive_masked_plain(x, mask, rows))
    _same(kernels.count_greater_masked(x, y, mask, rows), kernels.count_greater_masked_plain(x, y, mask, rows))


@HS
@given(packed())
def test_masked_row_extrema_equal_plain_on_rows_with_tokens(case):
    rows, x, _, mask = case
    has = rows.count(mask) > 0  # rows without a masked token: callers drop them
    for fast, plain in zip(kernels.masked_row_extrema(x, mask, rows), kernels.masked_row_extrema_plain(x, mask, rows)):
        _same(fast[has], plain[has])
    _same(kernels.masked_row_max(x, mask, rows)[has], kernels.masked_row_max_plain(x, mask, rows)[has])


def dual_clip_plain(adv: torch.Tensor, clipped1: torch.Tensor, l3: torch.Tensor) -> torch.Tensor:
    """verl's dual clip as written (core_algos.compute_policy_loss_vanilla): a ``where`` on A's sign."""
    return torch.where(adv < 0, torch.minimum(clipped1, l3), clipped1)


@HS
@given(packed(special=False), st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.floats(1.01, 10.0))
def test_dual_clip_equals_plain_signed_zeros_included(case, lo, hi, c):
    rows, adv, lr, _ = case
    adv = torch.where(torch.rand(adv.shape) < 0.2, torch.zeros_like(adv) * torch.sign(adv), adv / 1e5)
    ratio = torch.exp(torch.clamp(lr / 1e5, -20, 20))
    l1, l2, clipped1, l3, losses = ppo_terms(adv, ratio, lo, hi, c)
    plain = dual_clip_plain(adv, clipped1, l3)
    _same(losses, plain)
    assert torch.equal(torch.signbit(losses), torch.signbit(plain))
