"""rldiag/engine/host.py: numpy's comparisons and index scans on the host give what torch's plain
forms give (NaN, signed zeros, empty and non-contiguous tensors included), and the plain form
answers for a dtype numpy lacks."""

from __future__ import annotations

import torch

from rldiag.engine.host import (
    count_equal,
    count_true,
    greater_on,
    indicator_on,
    indices_above,
    nonzero_indices,
    positive,
    positive_float,
    running_sum_on,
)


def _values() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=g).round(decimals=1)  # many ties
    x[::97] = float("nan")
    x[5::101] = -0.0
    x[7::103] = 0.0
    x[11::89] = float("inf")
    return [x, x[::3], torch.zeros(0), x.to(torch.float64), (x * 10).nan_to_num().to(torch.int64)]


def test_comparisons_match_torch():
    for x in _values():
        assert torch.equal(positive(x), x > 0)
        assert torch.equal(positive_float(x), (x > 0).to(torch.float32))
        assert positive_float(x).dtype == torch.float32
        for t in (0.0, 0.3, -1.0, float("inf")):
            tt = torch.tensor(t if x.is_floating_point() else min(t, 9.0), dtype=torch.float64).to(x.dtype)
            assert torch.equal(indices_above(x, tt), torch.nonzero(x > tt).flatten()), (x.dtype, t)
            assert count_equal(x, tt) == int(torch.count_nonzero(x == tt)), (x.dtype, t)


def test_scans_match_torch():
    for x in _values():
        cond = x > 0
        assert torch.equal(nonzero_indices(cond), torch.nonzero(cond).flatten())
        assert nonzero_indices(cond).dtype == torch.int64
        assert count_true(cond) == int(torch.count_nonzero(cond))
        assert torch.equal(nonzero_indices(x), torch.nonzero(x).flatten())  # nonzero numbers count as true


def test_masked_indicators_match_torch():
    """indicator_on and greater_on: the 0/1 float32 products the policy losses wrote with torch
    (signed zeros of a negative value off the mask, NaN kept; a NaN is never greater)."""
    g = torch.Generator().manual_seed(5)
    for x in _values()[:2] + [_values()[3]]:
        y = x.flip(0)
        mask = (torch.rand(x.numel(), generator=g) > 0.3).to(torch.float32)
        for ind in (x > y, x):
            want = ind.to(torch.float32) * (mask > 0).to(torch.float32)
            got = indicator_on(ind, mask)
            assert got.dtype == torch.float32
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)) if x.dtype == torch.float32 else \
                torch.equal(got.nan_to_num(), want.nan_to_num())
        want = (x > y).to(torch.float32) * (mask > 0).to(torch.float32)
        assert torch.equal(greater_on(x, y, mask), want)
        assert float(greater_on(x, y, mask).sum()) == float(((x > y) & (mask > 0)).sum())


def test_a_dtype_numpy_lacks_takes_torch():
    x = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.bfloat16)
    assert positive(x).tolist() == [True, False, False, True]
    assert positive_float(x).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert indices_above(x, torch.tensor(0.0, dtype=torch.bfloat16)).tolist() == [0, 3]
    assert count_equal(x, torch.tensor(-1.0, dtype=torch.bfloat16)) == 1


def test_running_sum_on_matches_torch():
    g = torch.Generator().manual_seed(7)
    count = torch.randint(-3, 4, (4000,), generator=g, dtype=torch.int32)
    on = torch.rand(4000, generator=g) > 0.2
    want = torch.cumsum(count, 0, dtype=torch.int32) * on
    got = running_sum_on(count.clone(), on)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert running_sum_on(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.bool)).numel() == 0


def test_every_function_off_the_host_gives_the_same():
    """The torch forms (what another device takes) against the numpy forms, on the same inputs."""
    from unittest.mock import patch

    from rldiag.engine import host

    x = _values()[0]
    g = torch.Generator().manual_seed(9)
    count = torch.randint(-2, 3, (x.numel(),), generator=g, dtype=torch.int32)
    t = torch.tensor(0.3)
    y = x.flip(0)
    mask = (torch.rand(x.numel(), generator=g) > 0.3).to(torch.float32)

    def each() -> list:
        return [positive(x), positive_float(x), nonzero_indices(x > 0), count_true(x > 0), indices_above(x, t),
                count_equal(x, t), running_sum_on(count.clone(), x > 0), indicator_on(x > 0.3, mask), indicator_on(x, mask),
                greater_on(x, y, mask)]

    on_host = each()
    with patch.object(host, "view", return_value=None):
        off_host = each()
    for a, b in zip(on_host, off_host):
        if isinstance(a, int):
            assert a == b
        else:  # as bit patterns (NaN included)
            assert a.dtype == b.dtype
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else torch.equal(a, b)


def test_counts_min_and_running_count_match_torch():
    """count_above / count_below / min_where / running_count against their torch forms (NaN,
    signed zeros, ties and the bounds themselves included)."""
    from rldiag.engine.host import count_above, count_below, min_where, running_count

    g = torch.Generator().manual_seed(13)
    for x in _values()[:2] + [_values()[3]]:
        if not x.numel():
            continue
        cond = (torch.rand(x.numel(), generator=g) > 0.4).to(torch.float32)
        for t in (0.0, 0.5, 2.0, float("inf")):
            tt = torch.tensor(t, dtype=x.dtype)
            assert count_above(x, tt) == int(torch.count_nonzero(x > tt))
            assert count_below(x, tt) == int(torch.count_nonzero(x < tt))
        fill = torch.tensor(2.0, dtype=x.dtype)
        finite = x.nan_to_num(nan=1.5)
        for v in (finite, x):  # a NaN on the condition wins, as in amin
            got, want = min_where(v, cond, fill), torch.where(cond > 0, v, fill).amin()
            assert got.dtype == want.dtype and got.shape == () and torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
        assert float(min_where(finite, torch.zeros_like(cond), fill)) == 2.0
        for dtype in (torch.int32, torch.int64):
            got = running_count(x, dtype)
            assert got.dtype == dtype and torch.equal(got, torch.cumsum(x > 0, 0, dtype=dtype))


def test_after_last_zero_matches_the_token_form():
    """metrics.after_last_zero by numpy's scan of the zeros against the token-sized torch form (the
    one another device takes): rows without a zero, empty rows, a zero at a row's start and end."""
    from unittest.mock import patch

    from rldiag.engine import host
    from rldiag.engine.layout import Rows
    from rldiag.engine.metrics import after_last_zero

    g = torch.Generator().manual_seed(17)
    lengths = torch.randint(0, 30, (80,), generator=g)
    lengths[[0, 9, 79]] = 0
    rows = Rows.from_lengths(lengths)
    for p in (0.0, 0.05, 0.5):
        mask = (torch.rand(rows.n_tokens, generator=g) >= p).to(torch.float32)
        mask[rows.offsets[3]] = 0.0  # a row starting with a zero
        mask[rows.offsets[5] - 1] = -0.0  # one ending with one
        got = after_last_zero(mask, rows)
        with patch.object(host, "view", return_value=None):
            want = after_last_zero(mask, rows)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(after_last_zero(torch.ones(rows.n_tokens), rows), torch.zeros(80))
