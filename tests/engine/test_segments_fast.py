"""The per-row masked reductions of Rows (rldiag.engine.layout) and the per-step ones of
rldiag.engine.segments against plain references: NaN / inf outside the mask never leaks in,
extrema ignore whatever lies outside the mask, and nothing is remembered between calls (no
module-global memo: an in-place change of a mask is always seen).

The tests keep their padded ``(rows, T)`` inputs; the wrappers below hand the engine their packed
form (every row full width, tests.engine.packing) and return its per-row / per-step results."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine import kernels, layout, segments
from tests.engine.packing import to_packed


def _packed(*tensors):
    """Flat forms of full-width padded tensors, and their layout."""
    T = tensors[0].shape[1]
    flat = [to_packed(t, [T] * t.shape[0]) for t in tensors]
    return [f for f, _ in flat], flat[0][1]


def masked_square_sum(v, m):
    (vf, mf), rows = _packed(v, m)
    return rows.masked_square_sum(vf, mf)


def masked_sum(v, m):
    (vf, mf), rows = _packed(v, m)
    return rows.masked_sum(vf, mf)


def masked_count(cond, m):
    (cf, mf), rows = _packed(cond, m)
    return rows.masked_count(cf, mf)


def mask_count(m):
    (mf,), rows = _packed(m)
    return rows.mask_count(mf)


def step_mask_count(m, sid, n):
    (mf,), rows = _packed(m)
    return segments.step_mask_count(mf, rows, sid, n)


def step_masked_mean(v, m, sid, n):
    (vf, mf), rows = _packed(v, m)
    return segments.step_masked_mean(vf, mf, rows, sid, n)


def step_masked_extrema(v, m, sid, n):
    (vf, mf), rows = _packed(v, m)
    return segments.step_masked_extrema(vf, mf, rows, sid, n)


def _masked_row_extrema(v, m):
    (vf, mf), rows = _packed(v, m)
    return rows.masked_extrema(vf, mf)


HS = hsettings(max_examples=40, deadline=None)


def _data(rows: int, T: int, seed: int, p_mask: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(rows, T, generator=g) * 3.0
    m = (torch.rand(rows, T, generator=g) < p_mask).float()
    return v, m


def _ref_square_sum(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    v64 = v.to(torch.float64)
    return torch.where(m.bool(), v64 * v64, torch.zeros((), dtype=torch.float64)).sum(-1)


def _ref_extrema(v: torch.Tensor, m: torch.Tensor, step_ids: torch.Tensor, n_steps: int):
    means, maxs, mins = [], [], []
    for s in range(n_steps):
        rows = step_ids == s
        sel = torch.masked_select(v[rows], m[rows].bool())
        if sel.numel():
            means.append(sel.mean())
            maxs.append(sel.max())
            mins.append(sel.min())
        else:
            nan = torch.tensor(float("nan"))
            means.append(nan)
            maxs.append(nan)
            mins.append(nan)
    return torch.stack(means), torch.stack(maxs), torch.stack(mins)


# ---- masked_square_sum -----------------------------------------------------------------------


@HS
@given(st.integers(1, 6), st.integers(1, 50), st.integers(0, 10_000), st.sampled_from([0.0, 0.3, 0.7, 1.0]))
def test_masked_square_sum_rows_matches_reference(rows, T, seed, p):
    v, m = _data(rows, T, seed, p)
    got = masked_square_sum(v, m)
    assert got.shape == (rows,) and got.dtype == v.dtype
    torch.testing.assert_close(got.to(torch.float64), _ref_square_sum(v, m), rtol=1e-5, atol=1e-5)
    # a bool mask gives the same
    torch.testing.assert_close(masked_square_sum(v, m.bool()).to(torch.float64), _ref_square_sum(v, m),
                               rtol=1e-5, atol=1e-5)


@HS
@given(
    st.integers(1, 6), st.integers(2, 50), st.integers(0, 10_000),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
)
def test_masked_square_sum_rows_nonfinite_outside_mask_does_not_leak(rows, T, seed, bad):
    v, m = _data(rows, T, seed)
    m[:, 0] = 0.0  # at least one hole per row
    m[:, 1] = 1.0
    v = v.clone()
    v[:, 0] = bad
    want = _ref_square_sum(v, m)
    got = masked_square_sum(v, m)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.to(torch.float64), want, rtol=1e-5, atol=1e-5)
    # and masked_sum follows the same rule
    got_sum = masked_sum(v, m)
    assert torch.isfinite(got_sum).all()
    want_sum = torch.where(m.bool(), v.double(), torch.zeros((), dtype=torch.float64)).sum(-1)
    torch.testing.assert_close(got_sum.double(), want_sum, rtol=1e-5, atol=1e-5)


@HS
@given(st.integers(2, 6), st.integers(2, 50), st.integers(0, 10_000))
def test_masked_square_sum_rows_nan_inside_mask_gives_nan_for_that_row_only(rows, T, seed):
    v, m = _data(rows, T, seed)
    m[:, 0] = 1.0
    m[:, 1] = 0.0
    v = v.clone()
    v[:, 1] = float("nan")  # outside: must not leak anywhere
    v[0, 0] = float("nan")  # inside row 0
    got = masked_square_sum(v, m)
    assert torch.isnan(got[0])
    assert torch.isfinite(got[1:]).all()
    torch.testing.assert_close(got[1:].double(), _ref_square_sum(v, m)[1:], rtol=1e-5, atol=1e-5)
    s = masked_sum(v, m)
    assert torch.isnan(s[0]) and torch.isfinite(s[1:]).all()


def test_masked_square_sum_rows_inf_inside_mask_is_inf():
    v = torch.tensor([[1.0, float("inf"), 2.0], [1.0, 2.0, float("nan")]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    got = masked_square_sum(v, m)
    assert got[0] == float("inf")
    assert got[1] == 5.0


def test_masked_square_sum_rows_noncontiguous_and_float64():
    v, m = _data(4, 9, 1)
    vt, mt = v.T.contiguous().T, m.T.contiguous().T  # same values, other strides
    torch.testing.assert_close(masked_square_sum(vt, mt).double(), _ref_square_sum(v, m), rtol=1e-5, atol=1e-5)
    got = masked_square_sum(v.double(), m)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _ref_square_sum(v, m), rtol=1e-12, atol=1e-12)


# ---- masked_count ----------------------------------------------------------------------------


@HS
@given(st.integers(1, 6), st.integers(1, 50), st.integers(0, 10_000))
def test_masked_count_rows_matches_reference(rows, T, seed):
    v, m = _data(rows, T, seed)
    cond = v > 0.5
    want = (cond & (m > 0)).sum(-1).to(torch.float32)
    got = masked_count(cond, m)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(masked_count(cond, m.bool()), want)
    # a fractional / non-0/1 float mask counts every positive weight
    w = m * 0.5
    assert torch.equal(masked_count(cond, w), want)


def test_masked_count_rows_after_in_place_mask_change():
    m = torch.ones(2, 4)
    cond = torch.ones(2, 4, dtype=torch.bool)
    assert masked_count(cond, m).tolist() == [4.0, 4.0]
    m[1, :3] = 0.0
    assert masked_count(cond, m).tolist() == [4.0, 1.0]


# ---- mask_count / step_mask_count and the memo -----------------------------------------------


def test_row_mask_count_not_stale_after_in_place_change():
    m = torch.ones(3, 5)
    first = mask_count(m)
    assert first.tolist() == [5.0, 5.0, 5.0]
    m[0, 0] = 0.0
    assert mask_count(m).tolist() == [4.0, 5.0, 5.0]
    m.mul_(0)
    assert mask_count(m).tolist() == [0.0, 0.0, 0.0]
    m[2].fill_(1.0)
    assert mask_count(m).tolist() == [0.0, 0.0, 5.0]


def test_row_mask_count_not_stale_through_a_view():
    base = torch.ones(3, 5)
    m = base[:, :]
    assert mask_count(m).tolist() == [5.0, 5.0, 5.0]
    base[1, 2:] = 0.0  # the view shares the version counter
    assert mask_count(m).tolist() == [5.0, 2.0, 5.0]


def test_row_mask_count_two_masks_same_values_are_separate():
    a = torch.ones(2, 3)
    b = torch.ones(2, 3)
    assert mask_count(a).tolist() == [3.0, 3.0]
    assert mask_count(b).tolist() == [3.0, 3.0]
    b[0] = 0.0
    assert mask_count(a).tolist() == [3.0, 3.0]
    assert mask_count(b).tolist() == [0.0, 3.0]


def test_step_mask_count_other_step_ids_not_cached():
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    s1 = torch.tensor([0, 0, 1, 1])
    assert step_mask_count(m, s1, 2).tolist() == [3.0, 3.0]
    assert step_mask_count(m, s1, 2).tolist() == [3.0, 3.0]
    s2 = torch.tensor([0, 1, 1, 0])
    assert step_mask_count(m, s2, 2).tolist() == [2.0, 4.0]
    s3 = torch.tensor([2, 1, 0, 0])
    assert step_mask_count(m, s3, 3).tolist() == [3.0, 1.0, 2.0]
    # same values, other object: still right
    assert step_mask_count(m, s1.clone(), 2).tolist() == [3.0, 3.0]
    # other n_steps with the same step_ids
    assert step_mask_count(m, s1, 3).tolist() == [3.0, 3.0, 0.0]
    # and an in-place change of the mask after all that
    m[2, 2] = 0.0
    assert step_mask_count(m, s1, 2).tolist() == [3.0, 2.0]


def test_step_masked_mean_after_in_place_mask_change():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.ones(2, 3)
    sid = torch.tensor([0, 1])
    torch.testing.assert_close(step_masked_mean(v, m, sid, 2), torch.tensor([2.0, 5.0]))
    m[1, 2] = 0.0
    torch.testing.assert_close(step_masked_mean(v, m, sid, 2), torch.tensor([2.0, 4.5]))


# ---- extrema -------------------------------------------------------------------------------


@HS
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 10_000), st.integers(1, 3))
def test_step_masked_extrema_matches_reference(rows, T, seed, n_steps):
    v, m = _data(rows, T, seed)
    g = torch.Generator().manual_seed(seed + 1)
    sid = torch.randint(0, n_steps, (rows,), generator=g)
    mean, mx, mn = step_masked_extrema(v, m, sid, n_steps)
    rmean, rmx, rmn = _ref_extrema(v, m, sid, n_steps)
    torch.testing.assert_close(mean, rmean, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(mx, rmx, equal_nan=True)
    torch.testing.assert_close(mn, rmn, equal_nan=True)


def test_step_masked_extrema_not_stale_after_in_place_mask_change():
    v = torch.tensor([[5.0, -7.0, 1.0, 2.0], [3.0, 9.0, -1.0, 0.5]])
    m = torch.tensor([[0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0]])
    sid = torch.zeros(2, dtype=torch.long)
    mean, mx, mn = step_masked_extrema(v, m, sid, 1)
    assert (mx.item(), mn.item()) == (3.0, -1.0)
    # the same values tensor and mask again: remembered offset is fine
    assert step_masked_extrema(v, m, sid, 1)[1].item() == 3.0
    m[0, 0] = 1.0
    m[0, 1] = 1.0
    m[1, 2] = 0.0
    for got, want in zip(step_masked_extrema(v, m, sid, 1), _ref_extrema(v, m, sid, 1)):
        torch.testing.assert_close(got, want)
    mean, mx, mn = step_masked_extrema(v, m, sid, 1)
    assert (mx.item(), mn.item()) == (5.0, -7.0)
    # and a row whose only masked token is removed in place
    m.zero_()
    m[1, 3] = 1.0
    mean, mx, mn = step_masked_extrema(v, m, sid, 1)
    assert (mean.item(), mx.item(), mn.item()) == (0.5, 0.5, 0.5)


def test_masked_row_extrema_offset_follows_values_dtype():
    m = torch.tensor([[1.0, 0.0, 1.0]])
    v32 = torch.tensor([[1.0, 100.0, -2.0]])
    mx, mn = _masked_row_extrema(v32, m)
    assert (mx.item(), mn.item()) == (1.0, -2.0)
    v64 = v32.double()
    mx, mn = _masked_row_extrema(v64, m)
    assert mx.dtype == torch.float64 and (mx.item(), mn.item()) == (1.0, -2.0)
    mx, mn = _masked_row_extrema(v32, m)
    assert mx.dtype == torch.float32 and (mx.item(), mn.item()) == (1.0, -2.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 3.0e38, -3.0e38])
def test_masked_row_extrema_extreme_values_outside_mask(bad):
    v = torch.tensor([[bad, 1.0, -2.0], [4.0, bad, 0.0]])
    m = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    mx, mn = _masked_row_extrema(v, m)
    assert mx.tolist() == [1.0, 4.0]
    assert mn.tolist() == [-2.0, 0.0]


@pytest.mark.parametrize("big", [3.0e38, -3.0e38, float("inf"), float("-inf")])
def test_masked_row_extrema_extreme_values_inside_mask(big):
    v = torch.tensor([[big, 1.0, -2.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    b32 = torch.tensor(big, dtype=torch.float32).item()
    mx, mn = _masked_row_extrema(v, m)
    assert mx.item() == max(b32, 1.0) and mn.item() == min(b32, 1.0)


F32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize(
    "values, dtype",
    [
        # finite float32 values near the top of the range outside the mask: v - 3e38 is still
        # above every masked value when those are negative (and v + 3e38 below positive ones)
        ([[F32_MAX, -1.0, -2.0], [-F32_MAX, 1.0, 2.0]], torch.float32),
        ([[3.2e38, -1.0, -2.0], [-3.2e38, 1.0, 2.0]], torch.float32),
        # float64 values: a fixed 3e38 offset does not push 1e300 out of the max
        ([[1e300, -1.0, -2.0], [-1e300, 1.0, 2.0]], torch.float64),
    ],
)
def test_step_masked_extrema_huge_finite_values_outside_mask(values, dtype):
    """step_masked_extrema promises torch.masked_select's max/min: nothing outside the mask may
    take part, whatever its (finite) value."""
    v = torch.tensor(values, dtype=dtype)
    m = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    sid = torch.tensor([0, 1])
    _, mx, mn = step_masked_extrema(v, m, sid, 2)
    assert mx.tolist() == [-1.0, 2.0]
    assert mn.tolist() == [-2.0, 1.0]


def test_masked_row_extrema_nan_inside_mask_propagates():
    v = torch.tensor([[float("nan"), 1.0], [2.0, 3.0]])
    m = torch.ones(2, 2)
    mx, mn = _masked_row_extrema(v, m)
    assert torch.isnan(mx[0]) and torch.isnan(mn[0])
    assert (mx[1].item(), mn[1].item()) == (3.0, 2.0)


def test_no_module_global_memo():
    """Nothing in the engine's reduction modules remembers tensors between calls."""
    for mod in (segments, kernels, layout):
        held = [k for k, v in vars(mod).items() if not k.startswith("__") and isinstance(v, (dict, list, set))]
        assert not held, f"{mod.__name__} holds module-global containers {held}"
