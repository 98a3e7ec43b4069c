"""The compiled KL row sums (rldiag.engine.kl_native, native/kl_sums.c) against float64 truth and
against their torch twin (rldiag.engine.kl.kl_row_sums without the library): k1 and k2 from the
same float32 differences and squares; k3 without torch's float32 rounding of ``exp`` (more
accurate than the twin, and within the twin's own error of it); masks of both dtypes, tokens off
the mask that are NaN or infinite, rows of every length around the kernel's 8 lanes and its
blocks, empty rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import rldiag.engine.kl_native as native
from rldiag.engine.kl import k3_from_diff, kl_row_sums
from rldiag.engine.layout import Rows

pytestmark = pytest.mark.skipif(not native.built(),
                                reason="the compiled kernel was not built (no C compiler at install); .ci/run requires it")

HS = hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def k3_truth(d: torch.Tensor) -> torch.Tensor:
    """verl's low_var_kl of the float32 differences ``d``, in float64 without cancellation
    (``expm1(x) - x``)."""
    x = (-d.double()).clamp(-20.0, 20.0)
    return (torch.special.expm1(x) - x).clamp(-10.0, 10.0)


def twin(a, b, mask, rows, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(native, "_LIB", None)
        return kl_row_sums(a, b, mask, rows, keep_diff=False)[0]


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 0.05, 0.3, 1.0, 5.0, 40.0])
def test_each_tokens_k1_k2_exact_and_k3_within_float32_rounding_of_the_truth(scale):
    g = torch.Generator().manual_seed(int(scale * 1e6) % 10_007)
    n = 50_000
    a, b = -torch.rand(n, generator=g) * scale, -torch.rand(n, generator=g) * scale
    a[:4] = torch.tensor([0.0, -30.0, -0.3466, -0.3467])  # k clamped high; both sides of |x| = ln 2 / 2
    b[:4] = torch.tensor([-30.0, 0.0, 0.0, 0.0])
    out = native.row_sums(a, b, torch.ones(n), torch.arange(n + 1))  # one token a row
    d = a - b
    assert np.array_equal(out[:, 0], d.double().numpy())  # the float32 difference, as torch's
    assert np.array_equal(out[:, 1], (d * d).double().numpy())  # the float32 square, as torch's
    truth = k3_truth(d)
    k3 = torch.from_numpy(out[:, 2])
    assert float(k3[0]) == 10.0 and float(k3[1]) == pytest.approx(float(k3_truth(d[1:2])), rel=1e-6)
    err = (k3 - truth).abs()
    assert bool((err <= 4e-6 * truth + 1e-30).all()), float((err / truth.clamp_min(1e-300)).max())
    # torch's own float32 formula is off by exp's rounding, about 6e-8 of exp(x): the kernel is
    # at least as close to the truth on every token
    torch_err = (k3_from_diff(d).double() - truth).abs()
    assert bool((err <= torch_err + 2e-7 * truth.clamp_min(1.0)).all())
    if scale <= 1e-3:  # tiny KL: torch's rounding dwarfs k3 itself, the kernel keeps its digits
        assert float(err[4:].max()) < 1e-12 < float(torch_err[4:].max())


def test_non_finite_differences_on_and_off_the_mask():
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([-1.0, inf, -2.0, -0.5, nan, -0.1, -1.0, -3.0, 0.0, -inf])
    b = torch.tensor([-1.5, -1.0, -1.0, -0.4, -0.3, -0.2, -inf, -1.0, -inf, -1.0])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    rows = Rows.from_lengths(torch.tensor([3, 3, 2, 2]))
    out = native.row_sums(a, b, mask, rows.offsets)
    # rows 0 and 1: the NaN and the infinities off the mask go nowhere
    assert np.isfinite(out[:2]).all()
    d = (a - b).double()
    assert out[0, 0] == pytest.approx(float(d[0] + d[2]))
    assert out[1, 0] == pytest.approx(float(d[3] + d[5]))
    # row 2: a +inf difference on the mask: k1 and k2 infinite, k3 of x = -20 (clamped) 19, then 10
    assert out[2, 0] == inf and out[2, 1] == inf
    assert out[2, 2] == pytest.approx(10.0 + float(k3_truth(d[7:8])), rel=1e-6)
    # row 3: -inf on the mask: k1 -inf, k3 clamped at 10
    assert out[3, 0] == -inf and out[3, 2] == pytest.approx(10.0)
    nan_row = native.row_sums(torch.tensor([nan, -1.0]), torch.tensor([-1.0, -1.0]), torch.ones(2), torch.tensor([0, 2]))
    assert np.isnan(nan_row).all()  # a NaN on the mask: the row's sums are NaN, as torch's


@HS
@given(st.integers(0, 10_000), st.lists(st.integers(0, 300), min_size=1, max_size=12),
       st.sampled_from([0.02, 0.5, 3.0]), st.booleans())
def test_row_sums_match_the_torch_twin(seed, lengths, scale, bool_mask):
    import _pytest.monkeypatch

    g = torch.Generator().manual_seed(seed)
    rows = Rows.from_lengths(torch.tensor(lengths))
    n = rows.n_tokens
    a, b = -torch.rand(n, generator=g) * scale, -torch.rand(n, generator=g) * scale
    mask = torch.rand(n, generator=g) < 0.8
    if n:
        a[torch.randint(0, n, (3,), generator=g)] = float("nan")  # off the mask below
        mask &= torch.isfinite(a)
    mask = mask if bool_mask else mask.float()
    got, _ = kl_row_sums(a, b, mask, rows, keep_diff=False)
    mp = _pytest.monkeypatch.MonkeyPatch()
    try:
        want = twin(a, b, mask, rows, mp)
    finally:
        mp.undo()
    on = mask.bool()
    d = torch.where(on, a - b, 0.0)
    count = rows.sum(on.float()).double()
    for name in ("k1", "k2", "k3"):
        assert got[name].dtype == torch.float32 and got[name].shape == (len(lengths),)
        mag = rows.sum(d.abs().float()).double() + rows.sum((d * d).float()).double()
        # float32 sums in either order; k3 apart by torch's exp rounding (about 1.2e-7 a token)
        tol = 1e-6 * (1.0 + mag) + 2.4e-7 * count + 1e-5 * want[name].double().abs()
        gap = (got[name].double() - want[name].double()).abs()
        assert bool((gap <= tol).all()), (name, gap, tol)


def test_the_twin_runs_where_the_kernel_does_not_apply(monkeypatch):
    rows = Rows.from_lengths(torch.tensor([3, 2]))
    a, b = -torch.rand(5, dtype=torch.float64), -torch.rand(5, dtype=torch.float64)
    assert native.row_sums(a, b, torch.ones(5), rows.offsets) is None  # float64 log-probs: the twin's
    sums, d = kl_row_sums(a, b, torch.ones(5), rows)
    assert sums["k1"].dtype == torch.float64 and torch.equal(d, a - b)
    monkeypatch.setattr(native, "_LIB", None)
    assert not native.built()
    assert native.row_sums(a.float(), b.float(), torch.ones(5), rows.offsets) is None


def test_keep_diff_gives_the_token_differences_only_when_asked():
    rows = Rows.from_lengths(torch.tensor([4]))
    a, b = torch.tensor([-1.0, -2.0, -0.5, -0.25]), torch.tensor([-1.5, -1.0, -0.5, -1.0])
    _, d = kl_row_sums(a, b, torch.ones(4), rows)
    assert torch.equal(d, a - b)
    assert kl_row_sums(a, b, torch.ones(4), rows, keep_diff=False)[1] is None
