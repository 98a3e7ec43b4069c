"""The compiled gradient-weight pass (rldiag.engine.grad_weight_native, native/grad_weight.c)
against its torch twin in rldiag.engine.health.gradient_weight_shares: the same float32 ranking
to the bit, the same shares to float64's rounding, on steps with what the read must get right:
masks and clip indicators as float32 and bool, clip probabilities, no clip, tokens off the mask
holding NaN or infinities, empty steps, lengths around the kernel's eight lanes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import rldiag.engine.grad_weight_native as native
from rldiag.engine.health import gradient_weight_shares

pytestmark = pytest.mark.skipif(not native.built(),
                                reason="the compiled kernel was not built (no C compiler at install); .ci/run requires it")

HS = hsettings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def step(seed: int, n: int, bool_mask: bool, clip: str):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(n, generator=g)
    weights = torch.rand(n, generator=g) * (torch.rand(n, generator=g) < 0.97)
    mask = torch.rand(n, generator=g) < 0.85
    off = torch.nonzero(~mask).flatten()
    if off.numel() >= 2:
        adv[off[0]], adv[off[1]] = float("nan"), float("inf")  # off the mask: nowhere in the top share
        weights[off[0]] = weights[off[1]] = 0.0
    clipped = None
    if clip == "bool":
        clipped = torch.rand(n, generator=g) < 0.1
    elif clip == "float":
        clipped = (torch.rand(n, generator=g) < 0.1).float() * torch.rand(n, generator=g)  # clip probabilities
    return adv, weights, mask if bool_mask else mask.float(), clipped


def both(adv, weights, mask, bounds, clipped):
    import _pytest.monkeypatch

    got = gradient_weight_shares(adv, weights, mask, bounds, 0.01, clipped)
    mp = _pytest.monkeypatch.MonkeyPatch()
    try:
        mp.setattr(native, "_LIB", None)
        want = gradient_weight_shares(adv, weights, mask, bounds, 0.01, clipped)
    finally:
        mp.undo()
    return got, want


@HS
@given(st.integers(0, 10_000), st.lists(st.integers(0, 700), min_size=1, max_size=4), st.booleans(),
       st.sampled_from(["none", "bool", "float"]))
def test_shares_equal_the_torch_twin(seed, lengths, bool_mask, clip):
    n = sum(lengths)
    adv, weights, mask, clipped = step(seed, n, bool_mask, clip)
    bounds = [0]
    for k in lengths:
        bounds.append(bounds[-1] + k)
    (top, share), (top_t, share_t) = both(adv, weights, mask, bounds, clipped)
    torch.testing.assert_close(top, top_t, rtol=1e-6, atol=0, equal_nan=True)
    if clip == "none":
        assert share is None and share_t is None
    else:
        assert share is not None and share_t is not None
        torch.testing.assert_close(share, share_t, rtol=1e-6, atol=0, equal_nan=True)


def test_the_ranking_is_torchs_to_the_bit():
    adv, weights, mask, clipped = step(3, 1003, False, "float")
    one = native.step_pass(adv, weights, mask, clipped)
    on = mask > 0
    g = adv.abs() * weights
    assert one.actor == int(on.sum())
    # the clipped share's sums read every token, as the twin's: the NaN advantage off the mask is in them
    assert math.isnan(one.den) and math.isnan(one.num)
    fin = torch.isfinite(g)
    part = native.step_pass(adv[fin], weights[fin], mask[fin], clipped[fin])
    assert part.den == pytest.approx(float(g[fin].double().sum()), rel=1e-12)
    assert part.num == pytest.approx(float((g[fin].double() * (clipped[fin] * on[fin].float()).double()).sum()),
                                     rel=1e-12)
    unclipped = g * (1.0 - clipped)
    want = torch.where(on, unclipped, torch.tensor(-1.0))
    assert torch.equal(one.ranked, want)
    assert one.total == pytest.approx(float(torch.where(on, unclipped, 0.0).double().sum()), rel=1e-12)


def test_an_inf_weight_off_the_mask_makes_only_the_clipped_share_nan():
    adv, weights, mask, clipped = step(5, 200, False, "bool")
    off = torch.nonzero(mask == 0).flatten()
    weights[off[2]] = float("inf")
    adv[off[2]] = 1.0
    (top, share), (top_t, share_t) = both(adv, weights, mask, [0, 200], clipped)
    assert torch.equal(top, top_t) and math.isfinite(top.item())
    assert share is not None and math.isnan(share.item()) and share_t is not None and math.isnan(share_t.item())


def test_the_twin_runs_where_the_kernel_does_not_apply():
    adv, weights, mask, _ = step(1, 50, False, "none")
    assert not native.usable(adv.double(), weights.double(), mask, None)
    assert not native.usable(adv, weights, mask.to(torch.int8), None)
    assert native.usable(adv, weights, mask, None) and native.usable(adv, weights, mask.bool(), mask.bool())
    top = gradient_weight_shares(adv.double(), weights.double(), mask, [0, 50], 0.01)[0]
    assert top.item() == pytest.approx(gradient_weight_shares(adv, weights, mask, [0, 50], 0.01)[0].item(), rel=1e-6)
