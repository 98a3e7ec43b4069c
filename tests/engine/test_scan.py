"""The engine's recursions (GAE, REINFORCE++'s reward-to-go) give verl's one-position-at-a-time
loops' numbers on padded rows, through the packed layout."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine.advantage import base as advantage
from rldiag.engine.scan import segmented_reverse_linear_scan
from tests.engine.packing import to_packed, to_padded
from tests.engine.reference_core import gae_loop, reverse_linear_scan_loop, reward_to_go_carry_loop, reward_to_go_loop


@hsettings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 70), st.integers(0, 10_000))
def test_scan_equals_loop(rows, T, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(rows, T, generator=g) * (torch.rand(rows, T, generator=g) > 0.2)
    b = torch.randn(rows, T, generator=g)
    af, layout = to_packed(a, [T] * rows)
    bf, _ = to_packed(b, [T] * rows)
    got = segmented_reverse_linear_scan(af * (~layout.last()).float(), bf)
    torch.testing.assert_close(to_padded(got, layout, T), reverse_linear_scan_loop(a, b), rtol=1e-5, atol=1e-5)


@hsettings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 70), st.integers(0, 10_000),
       st.sampled_from([(1.0, 1.0), (1.0, 0.95), (0.99, 0.0), (0.5, 0.7), (0.3, 0.01)]))
def test_gae_and_reward_to_go_equal_the_loops(rows, T, seed, gl):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(rows, T, generator=g)
    v = torch.randn(rows, T, generator=g)
    m = (torch.rand(rows, T, generator=g) > 0.3).float()
    gamma, lam = gl
    (rf, layout), (vf, _), (mf, _) = (to_packed(t, [T] * rows) for t in (r, v, m))
    torch.testing.assert_close(to_padded(advantage.gae_scan(rf, vf, mf, gamma, lam, layout), layout, T),
                               gae_loop(r, v, m, gamma, lam), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(to_padded(advantage.reward_to_go_resetting(rf, mf, gamma, layout), layout, T),
                               reward_to_go_loop(r, m, gamma), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(to_padded(advantage.reward_to_go_carrying(rf, mf, gamma, layout), layout, T),
                               reward_to_go_carry_loop(r, m, gamma), rtol=1e-4, atol=1e-4)
