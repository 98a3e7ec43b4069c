"""The compiled finish of the rows' sums (rldiag.engine.rows_native, native/row_sums.c) against its
twin (rldiag.engine.layout.Rows._chunked_sum's torch operations, rounded to float32): the same
bits for rows shorter than a chunk, rows over many chunks, empty rows, rows starting and ending on
chunk boundaries, magnitudes from 1e-30 to 1e30, negative zeros; and a row whose sum is not finite
handed back to Rows.sum's float64 path, which keeps it in its own row."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import rldiag.engine.rows_native as native
from rldiag.engine import host
from rldiag.engine.layout import PIECE, Rows

pytestmark = pytest.mark.skipif(not native.built(),
                                reason="the compiled kernel was not built (no C compiler at install); .ci/run requires it")

HS = hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def twin(rows: Rows, x: torch.Tensor) -> torch.Tensor:
    """Rows.sum without the kernel: the chunked float64 sum, or the plain float64 segment sum
    where a row is not finite, rounded to float32."""
    out = rows._chunked_sum(x)
    if not host.all_finite(out):
        out = torch.segment_reduce(x.to(torch.float64), "sum", offsets=rows.offsets)
    return out.to(torch.float32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@HS
@given(st.integers(0, 10_000), st.lists(st.integers(0, 5 * PIECE + 3), min_size=0, max_size=12), st.integers(-30, 30))
def test_the_finish_gives_the_twins_bits(seed, lengths, exponent):
    g = torch.Generator().manual_seed(seed)
    rows = Rows.from_lengths(torch.tensor(lengths, dtype=torch.long))
    x = torch.randn(rows.n_tokens, generator=g) * 10.0 ** exponent
    got = native.row_sums(x, rows.offsets, PIECE)
    assert got is not None
    assert same_bits(got, twin(rows, x))
    assert same_bits(rows.sum(x), got)  # Rows.sum takes the kernel


def test_chunk_boundaries_and_signed_zeros():
    # rows that start and end on multiples of PIECE, one of a whole chunk exactly, one inside a chunk
    lengths = [PIECE, 2 * PIECE, PIECE // 2, PIECE // 2, 0, 3 * PIECE + 1, 1, PIECE - 1, 0]
    rows = Rows.from_lengths(torch.tensor(lengths))
    x = torch.linspace(-3.0, 5.0, rows.n_tokens) ** 3
    x[: PIECE] = -0.0  # a row of negative zeros: torch's sums from 0 give +0
    got = native.row_sums(x, rows.offsets, PIECE)
    assert got is not None and same_bits(got, twin(rows, x))
    assert got[0].item() == 0.0 and not torch.signbit(got[0])
    assert got[4].item() == 0.0 and got[-1].item() == 0.0  # empty rows


def test_chunk_sums_are_added_in_float64():
    # three whole chunks summing to 6.4e7, 32 and -6.4e7: float32 running sums would lose the 32
    rows = Rows.from_lengths(torch.tensor([3 * PIECE]))
    x = torch.cat([torch.full((PIECE,), 1e6), torch.full((PIECE,), 0.5), torch.full((PIECE,), -1e6)])
    got = native.row_sums(x, rows.offsets, PIECE)
    assert got is not None and got.item() == PIECE / 2
    assert same_bits(got, twin(rows, x))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_row_not_finite_goes_back_to_the_float64_path(bad):
    rows = Rows.from_lengths(torch.tensor([5, 3 * PIECE, 7, 2 * PIECE]))
    x = torch.ones(rows.n_tokens)
    x[5 + PIECE + 4] = bad  # inside the second row's whole chunks: the running totals after it are not finite
    assert native.row_sums(x, rows.offsets, PIECE) is None
    got = rows.sum(x)
    want = torch.tensor([5.0, bad if bad == bad else float("nan"), 7.0, 2.0 * PIECE])
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    keep = ~torch.isnan(want)
    assert torch.equal(got[keep], want[keep])  # the other rows keep their sums


def test_where_the_kernel_does_not_apply():
    rows = Rows.from_lengths(torch.tensor([4, 4]))
    assert native.usable(torch.ones(8), rows.offsets)
    assert not native.usable(torch.ones(8, dtype=torch.float64), rows.offsets)
    assert not native.usable(torch.ones(16)[::2], rows.offsets)  # not contiguous
    assert not native.usable(torch.ones(2, 4), rows.offsets)
    grad = torch.ones(8, requires_grad=True)
    assert not native.usable(grad, rows.offsets)  # the twin's sums carry the derivative
    rows.sum(grad * torch.arange(8.0)).sum().backward()
    assert torch.equal(grad.grad, torch.arange(8.0))
    # Rows.sum's other paths give the same numbers for those
    assert torch.equal(rows.sum(torch.ones(16)[::2]), torch.tensor([4.0, 4.0]))
    assert rows.sum(torch.ones(8, dtype=torch.float64)).dtype == torch.float64
