"""The compiled counts of the diagnostic TIS weights (rldiag.engine.diag_is_native,
native/tis_counts.c) against numpy and against their twin in rldiag.engine.diag_is: the same
counts, truncation and extrema, exactly, for masks of both dtypes and lengths around the eight
lanes; and tis_statistics the same to the bit with the kernel and without."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import rldiag.engine.diag_is_native as native
from rldiag.engine.diag_is import tis_statistics
from rldiag.engine.layout import Rows
from rldiag.engine.segments import step_token_bounds

pytestmark = pytest.mark.skipif(not native.built(),
                                reason="the compiled kernel was not built (no C compiler at install); .ci/run requires it")

HS = hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@HS
@given(st.integers(0, 10_000), st.integers(1, 70), st.booleans())
def test_counts_truncation_and_extrema_against_numpy(seed, n, bool_mask):
    rng = np.random.default_rng(seed)
    raw = np.exp(np.clip(rng.normal(0, 0.9, n), -20, 20)).astype(np.float32)
    raw[rng.random(n) < 0.1] = 2.0  # exactly at the cap
    on = rng.random(n) < 0.7
    w = torch.from_numpy(raw.copy())  # exp(clamp(d)) on every token: the kernel makes it 0 off the mask
    raw[~on] = 0.0
    mask = torch.from_numpy(on) if bool_mask else torch.from_numpy(on.astype(np.float32))
    d = torch.from_numpy(rng.normal(0, 0.9, n).astype(np.float32))
    d[0] = float("inf")  # inf x 0 is NaN off the mask, as torch's product
    products = torch.empty_like(d)
    got = native.step_counts(w, mask, 2.0, 0.5, 2.0, d, products)
    assert torch.equal(products.isnan(), (d * mask).isnan())
    assert torch.equal(products.nan_to_num(), (d * mask).nan_to_num())  # the rows' masked sums' terms
    assert got.above == int((raw > 2.0).sum()) and got.below == int((raw < 0.5).sum())
    trunc = np.minimum(raw, np.float32(2.0))
    assert np.array_equal(w.numpy(), trunc)  # truncated in place
    assert got.max == float(trunc.max())
    assert got.min == float(trunc[on].min() if on.any() else np.float32(2.0))


@HS
@given(st.integers(0, 10_000), st.integers(1, 70), st.booleans())
def test_spread_terms_are_torchs_bits(seed, n, bool_mask):
    """The standard deviation's and the effective sample size's token terms against the torch
    operations they replace, to the bit, for masks of both dtypes and lengths around the lanes."""
    rng = np.random.default_rng(seed)
    on = rng.random(n) < 0.7
    w = torch.from_numpy(np.minimum(np.exp(rng.normal(0, 0.9, n)), 2.0).astype(np.float32) * on)
    mask = torch.from_numpy(on) if bool_mask else torch.from_numpy(on.astype(np.float32))
    mean = w.sum() / (torch.tensor(float(on.sum())) + 1e-8)
    den = mean + 1e-8
    dev, norm = torch.empty_like(w), torch.empty_like(w)
    native.spread(w, mask, float(mean), float(den), dev, norm)
    assert torch.equal(dev, (w - mean).square_().mul_(mask))
    assert torch.equal(norm, torch.div(w, mean.reshape(1) + 1e-8).square_())


def test_tis_statistics_the_same_bits_with_and_without_the_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    rows = Rows.from_lengths(torch.randint(0, 200, (30,), generator=gen))
    sid = torch.repeat_interleave(torch.tensor([0, 1, 2]), torch.tensor([10, 10, 10]))
    for mask in ((torch.rand(rows.n_tokens, generator=gen) < 0.8).float(), torch.rand(rows.n_tokens, generator=gen) < 0.6):
        d = torch.randn(rows.n_tokens, generator=gen) * 0.8
        bounds = step_token_bounds(rows, sid, 3)
        got = tis_statistics(d, mask.float(), rows, sid, 3, bounds, 2.0)
        with monkeypatch.context() as m:
            m.setattr(native, "_LIB", None)
            want = tis_statistics(d, mask.float(), rows, sid, 3, bounds, 2.0)
        assert got is not None and want is not None
        assert torch.equal(got.token_weights, want.token_weights)
        for k, v in want.token.items():
            assert torch.equal(got.token[k].isnan(), v.isnan()) and torch.equal(got.token[k][~v.isnan()], v[~v.isnan()]), k
        assert got.token["rollout_is_ratio_fraction_high"].sum() > 0  # drift past the threshold


@HS
@given(st.integers(0, 10_000), st.lists(st.integers(0, 6), min_size=1, max_size=9), st.floats(0.01, 30.0))
def test_the_sequence_table_is_its_numpy_twins_to_the_bit(seed, rows_per_step, spread):
    """Steps with no row, one row, rows of no actor token, steps of one actor token (std 0),
    ratios around and far beyond the threshold, log-ratios on the bounds and at exactly 0."""
    from rldiag.engine.diag_is import MEAN_EPS, _log_bounds, _sequence_table

    rng = np.random.default_rng(seed)
    n = len(rows_per_step)
    sid = np.repeat(np.arange(n, dtype=np.int64), rows_per_step)
    rows = sid.shape[0]
    log_ratio = (rng.normal(0, 1, rows) * spread).astype(np.float32)
    up, lo = _log_bounds(2.0)
    picks = rng.random(rows)
    log_ratio[picks < 0.1] = up
    log_ratio[(picks >= 0.1) & (picks < 0.2)] = lo
    log_ratio[(picks >= 0.2) & (picks < 0.25)] = 0.0
    ratio = torch.exp(torch.clamp(torch.from_numpy(log_ratio), -20, 20)).numpy()
    row_count = rng.integers(0, 40, rows).astype(np.float32)
    row_count[picks > 0.9] = 0.0
    count = np.bincount(sid, weights=row_count, minlength=n).astype(np.float32)
    args = (ratio, log_ratio, row_count, sid, count, 2.0, up, lo)
    got = native.sequence(*args, MEAN_EPS)
    want = _sequence_table(*args)
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape == (7, n)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    empty = np.asarray(rows_per_step) == 0
    assert np.isnan(got[3:, empty]).all() and not np.isnan(got[3:, ~empty]).any()


def test_the_sequence_table_refuses_rows_out_of_step_order():
    from rldiag.engine.diag_is import MEAN_EPS

    one = np.ones(3, dtype=np.float32)
    with pytest.raises(ValueError, match="step order"):
        native.sequence(one, one, one, np.array([1, 0, 1]), np.ones(2, dtype=np.float32), 2.0, np.float32(0.69),
                        np.float32(-0.69), MEAN_EPS)
