"""The packed token layout: per-row reductions and segmented scans equal their padded forms,
and no result depends on how rows are packed (their order, which rows share a call) or chunked."""

from __future__ import annotations

import dataclasses
from unittest.mock import patch

import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine import scan
from rldiag.engine.layout import OffsetRows, Rows, chunk_plan, chunk_plan_host
from rldiag.engine.scan import (
    cumsum_segmented,
    gae_segmented,
    reverse_cumsum_segmented,
    reward_to_go_segmented,
    segmented_reverse_linear_scan,
)
from tests.engine.packing import to_packed, to_padded
from tests.engine.reference_core import gae_loop, reverse_linear_scan_loop, reward_to_go_loop

GL = [(1.0, 1.0), (1.0, 0.95), (0.99, 0.0), (0.5, 0.7), (0.3, 0.01)]


@st.composite
def ragged(draw, max_rows=8, max_len=90):
    """Row lengths (empty rows and a long row now and then), a generator seed."""
    lengths = draw(st.lists(st.integers(0, 12), min_size=1, max_size=max_rows))
    if draw(st.booleans()):
        lengths[draw(st.integers(0, len(lengths) - 1))] = draw(st.integers(20, max_len))
    return lengths, draw(st.integers(0, 10_000))


def _inputs(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(max(lengths), 1)
    valid = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    r = torch.randn(rows, width, generator=g) * valid
    v = torch.randn(rows, width, generator=g) * valid
    m = (torch.rand(rows, width, generator=g) > 0.3).float() * valid
    return r, v, m


@hsettings(max_examples=40, deadline=None)
@given(ragged())
def test_row_reductions_equal_padded(case):
    lengths, seed = case
    r, _, m = _inputs(lengths, seed)
    flat, rows = to_packed(r, lengths)
    mf, _ = to_packed(m, lengths)
    L = torch.tensor(lengths)
    # summation order differs from the padded sum: each is within the recursive-summation bound
    # n * eps * sum|x| of the exact (float64) sum, not within a fixed 1e-6 (cancellation)
    exact = r.double().sum(-1)
    bound = L.double() * torch.finfo(torch.float32).eps * r.double().abs().sum(-1) + 1e-30
    assert bool(((rows.sum(flat).double() - exact).abs() <= bound).all())
    torch.testing.assert_close(rows.count(mf), m.sum(-1))
    torch.testing.assert_close(rows.lengths, L)
    big = torch.where(torch.arange(r.shape[1]) < L.unsqueeze(1), r, float("-inf")).amax(-1)
    torch.testing.assert_close(rows.amax(flat), big)
    small = torch.where(torch.arange(r.shape[1]) < L.unsqueeze(1), r, float("inf")).amin(-1)
    torch.testing.assert_close(rows.amin(flat), small)
    torch.testing.assert_close(rows.any(mf), m.sum(-1) > 0)
    torch.testing.assert_close(to_padded(flat, rows, r.shape[1]), r)
    torch.testing.assert_close(rows.expand(L.float()), L.float().repeat_interleave(L))
    pos = to_padded(rows.positions(), rows, r.shape[1])
    assert all(pos[i, :n].tolist() == list(range(n)) for i, n in enumerate(lengths))
    last = rows.last()
    assert last.sum() == sum(1 for n in lengths if n)
    assert all(bool(last[int(rows.offsets[i + 1]) - 1]) for i, n in enumerate(lengths) if n)


@hsettings(max_examples=30, deadline=None)
@given(ragged(), st.randoms(use_true_random=False))
def test_take_and_cat(case, rnd):
    lengths, seed = case
    r, _, _ = _inputs(lengths, seed)
    flat, rows = to_packed(r, lengths)
    order = list(range(len(lengths)))
    rnd.shuffle(order)
    sub, tok = rows.take(torch.tensor(order, dtype=torch.long))
    torch.testing.assert_close(to_padded(flat[tok], sub, r.shape[1]), r[order])
    both = Rows.cat([rows, sub])
    torch.testing.assert_close(both.lengths, torch.cat([rows.lengths, sub.lengths]))


@hsettings(max_examples=40, deadline=None)
@given(ragged(max_len=300), st.sampled_from([2, 3, 8, 64]), st.booleans())
def test_segmented_scan_equals_the_loop_on_each_row(case, block, small_off):
    lengths, seed = case
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(max(lengths), 1)
    a = torch.rand(rows, width, generator=g) * (torch.rand(rows, width, generator=g) > 0.2)
    b = torch.randn(rows, width, generator=g)
    af, layout = to_packed(a, lengths)
    bf, _ = to_packed(b, lengths)
    af = af * (~layout.last()).float()  # restart at each row's end
    with patch.object(scan, "SMALL", 2 if small_off else scan.SMALL):  # the chunked path, or doubling
        got = to_padded(segmented_reverse_linear_scan(af, bf, block=block), layout, width)
    valid = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    want = reverse_linear_scan_loop(a * valid, b * valid) * valid
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@hsettings(max_examples=40, deadline=None)
@given(ragged(max_len=200), st.sampled_from(GL))
def test_gae_and_reward_to_go_equal_the_padded_loops(case, gl):
    lengths, seed = case
    r, v, m = _inputs(lengths, seed)
    gamma, lam = gl
    rf, rows = to_packed(r, lengths)
    vf, _ = to_packed(v, lengths)
    mf, _ = to_packed(m, lengths)
    last = rows.last()
    width = r.shape[1]
    torch.testing.assert_close(to_padded(gae_segmented(rf, vf, mf, last, gamma, lam), rows, width),
                               gae_loop(r, v, m, gamma, lam) * _valid(lengths, width),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(to_padded(reward_to_go_segmented(rf, mf, last, gamma), rows, width),
                               reward_to_go_loop(r, m, gamma) * _valid(lengths, width), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(to_padded(reverse_cumsum_segmented(rf, rows), rows, width),
                               r.flip(-1).cumsum(-1).flip(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(to_padded(cumsum_segmented(rf, rows), rows, width),
                               r.cumsum(-1) * _valid(lengths, width), rtol=1e-5, atol=1e-5)


def _valid(lengths, width):
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


def _per_row(flat, rows):
    return [flat[int(rows.offsets[i]): int(rows.offsets[i + 1])] for i in range(rows.n_rows)]


@hsettings(max_examples=30, deadline=None)
@given(ragged(max_len=200), ragged(max_len=200), st.sampled_from(GL), st.randoms(use_true_random=False))
def test_scans_do_not_depend_on_packing(case_a, case_b, gl, rnd):
    """Two steps packed together, in any row order, give each row what it gets alone."""
    gamma, lam = gl
    parts = []
    for lengths, seed in (case_a, case_b):
        r, v, m = _inputs(lengths, seed)
        parts.extend(zip(*[_per_row(*to_packed(t, lengths)) for t in (r, v, m)]))
    alone = []
    for r, v, m in parts:
        rows = Rows.from_lengths(torch.tensor([r.numel()]))
        alone.append((gae_segmented(r, v, m, rows.last(), gamma, lam), reward_to_go_segmented(r, m, rows.last(), gamma)))
    order = list(range(len(parts)))
    rnd.shuffle(order)
    rows = Rows.from_lengths(torch.tensor([parts[i][0].numel() for i in order]))
    r, v, m = (torch.cat([parts[i][k] for i in order]) for k in range(3))
    adv = _per_row(gae_segmented(r, v, m, rows.last(), gamma, lam), rows)
    rtg = _per_row(reward_to_go_segmented(r, m, rows.last(), gamma), rows)
    for j, i in enumerate(order):
        torch.testing.assert_close(adv[j], alone[i][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rtg[j], alone[i][1], rtol=1e-6, atol=1e-6)


@hsettings(max_examples=25, deadline=None)
@given(ragged(max_len=300), st.sampled_from([2, 5, 16, 64, 128]))
def test_scan_does_not_depend_on_the_block(case, block):
    lengths, seed = case
    r, v, m = _inputs(lengths, seed)
    a, rows = to_packed(m * 0.9, lengths)
    b, _ = to_packed(r, lengths)
    a = a * (~rows.last()).float()
    with patch.object(scan, "SMALL", 2):  # chunks of `block` at every level
        chunked = segmented_reverse_linear_scan(a, b, block=block)
    torch.testing.assert_close(chunked, segmented_reverse_linear_scan(a, b, block=64), rtol=1e-6, atol=1e-6)


@st.composite
def long_ragged(draw):
    """Rows over many chunks of the chunked reductions (PIECE = 64), short and empty rows between."""
    lengths = draw(st.lists(st.one_of(st.integers(0, 70), st.integers(60, 700)), min_size=1, max_size=12))
    return lengths, draw(st.integers(0, 10_000))


@hsettings(max_examples=40, deadline=None)
@given(long_ragged(), st.floats(1e-3, 1e6))
def test_chunked_row_reductions_equal_float64_per_row(case, scale):
    """Rows spanning many chunks: each row's sum, max and min equal a float64 reduction of that
    row alone, however large its neighbours (no token of another row enters it)."""
    lengths, seed = case
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(sum(lengths), generator=g) * torch.rand(sum(lengths), generator=g).pow(8) * scale
    rows = Rows.from_lengths(torch.tensor(lengths))
    pieces = torch.split(flat, lengths)
    want = torch.tensor([float(p.double().sum()) for p in pieces], dtype=torch.float64)
    got = rows.sum(flat).double()
    tol = 1e-6 * torch.tensor([float(p.double().abs().sum()) for p in pieces]) + 1e-30
    assert bool(((got - want).abs() <= tol).all()), (got - want).abs().max()
    inf = float("inf")
    assert rows.amax(flat).tolist() == [float(p.max()) if len(p) else -inf for p in pieces]
    assert rows.amin(flat).tolist() == [float(p.min()) if len(p) else inf for p in pieces]


def test_nan_and_inf_stay_in_their_own_row():
    lengths = [300, 5, 700, 0, 130]
    flat = torch.arange(float(sum(lengths))) / 100
    flat[400] = float("nan")  # in row 2 (tokens 305..1004), in a whole chunk inside it (320..1023)
    flat[1006] = float("inf")  # in row 4, an edge fragment
    rows = Rows.from_lengths(torch.tensor(lengths))
    s, mx, mn = rows.sum(flat), rows.amax(flat), rows.amin(flat)
    assert torch.isnan(s[2]) and torch.isnan(mx[2]) and torch.isnan(mn[2])
    assert s[4] == float("inf") and mx[4] == float("inf") and torch.isfinite(mn[4])
    for i in (0, 1):
        p = flat[int(rows.offsets[i]): int(rows.offsets[i + 1])]
        assert float(mx[i]) == float(p.max()) and float(mn[i]) == float(p.min())
        assert abs(float(s[i]) - float(p.double().sum())) < 1e-3
    assert s[3] == 0 and mx[3] == float("-inf") and mn[3] == float("inf")


@hsettings(max_examples=60, deadline=None)
@given(long_ragged())
def test_chunk_plan_on_the_host_is_torchs(case):
    """The row split of the chunked reductions computed by numpy on the host (the CPU's form)
    is the same integers as torch's form (the other devices')."""
    lengths, _ = case
    rows = Rows.from_lengths(torch.tensor(lengths, dtype=torch.long))
    host, plain = chunk_plan_host(rows.offsets, rows.n_tokens), chunk_plan(rows.offsets, rows.n_tokens)
    for f in dataclasses.fields(host):
        a, b = getattr(host, f.name), getattr(plain, f.name)
        assert a == b if isinstance(a, int) else (a.dtype == b.dtype and torch.equal(a, b)), f.name


def test_offset_rows_reduce_as_rows():
    """A layout from its offsets alone (no row ids until read) sums as the full layout, to the bit."""
    lengths = [300, 5, 0, 700, 64, 1, 130]
    full = Rows.from_lengths(torch.tensor(lengths))
    lazy = OffsetRows(full.offsets, full.n_tokens)
    g = torch.Generator().manual_seed(4)
    x, m = torch.randn(full.n_tokens, generator=g), (torch.rand(full.n_tokens, generator=g) > 0.3).float()
    assert lazy.n_tokens == full.n_tokens and lazy.n_rows == full.n_rows
    assert torch.equal(lazy.sum(x), full.sum(x)) and torch.equal(lazy.masked_sum(x, m), full.masked_sum(x, m))
    assert torch.equal(lazy.mask_count(m), full.mask_count(m))
    assert "row_ids" not in lazy.__dict__  # none of these made the row ids
    assert torch.equal(lazy.row_ids, full.row_ids)


def test_column_sum_is_remembered_while_the_tensor_is_unchanged():
    """The row sums of a column several stages sum are computed once per tensor and version: an
    in-place change (a new version) or another tensor is summed anew; each caller gets a copy."""
    rows = Rows.from_lengths(torch.tensor([3, 0, 70, 2]))
    x = torch.arange(75, dtype=torch.float32)
    first = rows.column_sum(x)
    assert torch.equal(first, rows.sum(x))
    first[0] = -1.0  # the caller's copy
    assert torch.equal(rows.column_sum(x), rows.sum(x))
    with patch.object(Rows, "sum", side_effect=AssertionError("summed again")):
        rows.column_sum(x)  # remembered
    x[0] = 100.0  # a new version: summed again
    assert rows.column_sum(x)[0].item() == 103.0
    assert torch.equal(rows.column_sum(x.clone()), rows.sum(x))


def test_expand_on_the_host_is_the_gather():
    """Rows.expand by numpy's repeat (the host) gives torch's gather by row ids, empty rows, a
    strided input, bool and bfloat16 (the gather) included; a wrong row count is an error."""
    import pytest

    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(0, 40, (57,), generator=g)
    lengths[[0, 5, 56]] = 0
    rows = Rows.from_lengths(lengths)
    x = torch.randn(57 * 2, generator=g)
    x[3] = float("nan")
    for per_row in (x[:57], x[::2], x[:57].to(torch.float64), x[:57] > 0, torch.arange(57), x[:57].to(torch.bfloat16)):
        got = rows.expand(per_row)
        want = per_row.index_select(0, rows.row_ids)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())
    with pytest.raises(ValueError, match="56 values for 57 rows"):
        rows.expand(x[:56])


def test_masked_sum_is_remembered_per_pair_while_both_are_unchanged():
    """Rows.masked_sum is computed once per (values, mask) pair and versions: a change to either
    (in place: a new version), or another tensor, is summed anew; each caller gets a copy."""
    from rldiag.engine import kernels

    rows = Rows.from_lengths(torch.tensor([3, 0, 70, 2]))
    x = torch.arange(75, dtype=torch.float32)
    m = (torch.arange(75) % 3 != 0).to(torch.float32)
    want = kernels.masked_row_sums(x, m, rows)
    first = rows.masked_sum(x, m)
    assert torch.equal(first, want)
    first[0] = -1.0  # the caller's copy
    with patch.object(kernels, "masked_row_sums", side_effect=AssertionError("summed again")):
        assert torch.equal(rows.masked_sum(x, m), want)  # remembered
    m[1] = 0.0  # the mask changes: summed again
    assert rows.masked_sum(x, m)[0].item() == 2.0
    x[2] = 10.0  # the values change: summed again
    assert rows.masked_sum(x, m)[0].item() == 10.0
    assert rows.masked_sum(m, x)[0].item() == 10.0  # the pair in the other order is another pair
    assert torch.equal(rows.masked_sum(x.clone(), m), kernels.masked_row_sums(x, m, rows))
