"""The associative-scan forms (used on GPUs) give the loop forms' numbers."""

from __future__ import annotations

import torch
from hypothesis import given, settings as hsettings, strategies as st

from rldiag.engine import advantage
from rldiag.engine.scan import gae_blocked, gae_loop, gae_scan, reverse_linear_scan, reverse_linear_scan_loop, reward_to_go_carry_scan, reward_to_go_scan


@hsettings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 70), st.integers(0, 10_000))
def test_scan_equals_loop(rows, T, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(rows, T, generator=g) * (torch.rand(rows, T, generator=g) > 0.2)
    b = torch.randn(rows, T, generator=g)
    torch.testing.assert_close(reverse_linear_scan(a, b), reverse_linear_scan_loop(a, b), rtol=1e-5, atol=1e-5)


@hsettings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 70), st.integers(0, 10_000), st.sampled_from([(1.0, 1.0), (1.0, 0.95), (0.99, 0.0), (0.5, 0.7), (0.3, 0.01)]))
def test_gae_and_reward_to_go_scans_equal_the_loops(rows, T, seed, gl):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(rows, T, generator=g)
    v = torch.randn(rows, T, generator=g)
    m = (torch.rand(rows, T, generator=g) > 0.3).float()
    gamma, lam = gl
    ref = gae_loop(r, v, m, gamma, lam)
    torch.testing.assert_close(gae_scan(r, v, m, gamma, lam), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gae_blocked(r, v, m, gamma, lam, block=16), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(advantage._gae_scan(r, v, m, gamma, lam), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(reward_to_go_scan(r, m, gamma), advantage._reward_to_go_resetting(r, m, gamma), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(reward_to_go_carry_scan(r, m, gamma), advantage._reward_to_go_carrying(r, m, gamma), rtol=1e-4, atol=1e-4)
