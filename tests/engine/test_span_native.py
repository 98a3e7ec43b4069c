"""The compiled masked span sums (rldiag.engine.span_native, native/span_sums.c) against their
twin (rldiag.engine.layout.Rows.mask_count, masked_sum and sum): the same sums within float32's
rounding, for masks as float32 and bool and none (plain sums), a difference column, NaN and
infinities off the mask, empty spans and spans around the kernel's eight lanes and its blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import rldiag.engine.span_native as native
from rldiag.engine.layout import Rows

pytestmark = pytest.mark.skipif(not native.built(),
                                reason="the compiled kernel was not built (no C compiler at install); .ci/run requires it")

HS = hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> bool:
    """Within float32 rounding of sums whose terms add up to ``scale`` in magnitude."""
    return bool(((got.double() - want.double()).abs() <= 1e-6 * (1.0 + scale.double())).all())


@HS
@given(st.integers(0, 10_000), st.lists(st.integers(0, 600), min_size=1, max_size=8), st.sampled_from(["float", "bool", "none"]))
def test_span_sums_match_the_twin(seed, lengths, kind):
    g = torch.Generator().manual_seed(seed)
    spans = Rows.from_lengths(torch.tensor(lengths))
    n = spans.n_tokens
    a, b, c, d = (torch.randn(n, generator=g) for _ in range(4))
    on = torch.rand(n, generator=g) < 0.75
    mask = {"float": on.float(), "bool": on, "none": None}[kind]
    if kind != "none" and n:
        off = torch.nonzero(~on).flatten()[:3]
        a[off] = float("nan")  # off the mask: nowhere
        c[off[:1]] = float("inf")
    got = native.span_sums([a, b], mask, spans.offsets, (c, d))
    assert got is not None
    count, sums = got
    assert len(sums) == 3 and all(x.dtype == torch.float32 and x.shape == (len(lengths),) for x in sums)
    if mask is None:
        want_count = spans.lengths.float()
        want = [spans.sum(a), spans.sum(b), spans.sum(c - d)]
        mag = [spans.sum(x.abs()) for x in (a, b, c - d)]
    else:
        want_count = spans.mask_count(mask if mask.dtype == torch.float32 else mask.float())
        want = [spans.masked_sum(a, mask), spans.masked_sum(b, mask), spans.masked_sum(c - d, mask)]
        mag = [spans.masked_sum(x.abs(), mask) for x in (a, b, c - d)]
    assert torch.equal(count, want_count)  # exact: counts
    for x, y, m in zip(sums, want, mag):
        assert torch.isfinite(x).all() and close(x, y, m)


def test_a_nan_on_the_mask_makes_its_span_nan():
    spans = Rows.from_lengths(torch.tensor([3, 9]))
    a = torch.arange(12, dtype=torch.float32)
    a[5] = float("nan")
    count, (s,) = native.span_sums([a], torch.ones(12), spans.offsets)
    assert s[0].item() == 3.0 and torch.isnan(s[1]) and count.tolist() == [3.0, 9.0]


def test_the_twin_runs_where_the_kernel_does_not_apply(monkeypatch):
    spans = Rows.from_lengths(torch.tensor([4]))
    x = torch.ones(4)
    assert native.span_sums([x.double()], None, spans.offsets) is None
    assert native.span_sums([x] * 8, None, spans.offsets) is None  # more series than the kernel sums
    assert native.span_sums([x], x.to(torch.int8), spans.offsets) is None
    monkeypatch.setattr(native, "_LIB", None)
    assert native.span_sums([x], None, spans.offsets) is None
