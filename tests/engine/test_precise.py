"""rldiag.engine.precise and the float64 whitening: row sums in float64 across blocks of tokens
(never a float64 copy of every token), the float32 pair of a mean, and whitening that is exact on
a tie and float64-accurate otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from rldiag.engine import precise
from rldiag.engine.layout import Rows
from rldiag.engine.precise import mean_pair, row_sums64
from rldiag.engine.step_failures import StepErrors
from rldiag.engine.whiten import step_whiten


class LargestFloat64(TorchFunctionMode):
    """Records the largest float64 tensor any torch function returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.largest = max(self.largest, t.numel())
        return out


def _layout(rng, rows: int) -> Rows:
    lengths = torch.from_numpy(rng.integers(0, 40, rows))
    lengths[3] = 0
    lengths[5] = 300  # a row across several blocks
    return Rows.from_lengths(lengths)


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 20])
def test_row_sums_in_float64_across_blocks(monkeypatch, block):
    monkeypatch.setattr(precise, "BLOCK", block)
    rng = np.random.default_rng(block)
    rows = _layout(rng, 50)
    x = torch.from_numpy((1e4 + rng.normal(0, 1, rows.n_tokens)).astype(np.float32))
    want = np.array([x[a:b].double().sum().item() for a, b in zip(rows.offsets[:-1], rows.offsets[1:])])
    got = row_sums64(x, rows)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-15, atol=1e-9)
    tie = torch.full((rows.n_tokens,), 0.7, dtype=torch.float32)
    assert torch.equal(row_sums64(tie, rows), rows.lengths.double() * float(np.float32(0.7)))


def test_no_float64_copy_of_every_token(monkeypatch):
    """With blocks of 64 tokens, no float64 tensor larger than a block or the rows appears, in
    the row sums or in the float64 whitening."""
    monkeypatch.setattr(precise, "BLOCK", 64)
    rng = np.random.default_rng(0)
    rows = _layout(rng, 50)
    x = torch.from_numpy(rng.normal(0, 1, rows.n_tokens).astype(np.float32))
    mask = torch.from_numpy((rng.random(rows.n_tokens) < 0.8).astype(np.float32))
    steps = torch.from_numpy(rng.integers(0, 3, rows.n_rows))
    with LargestFloat64() as mode:
        step_whiten(x, mask, rows, steps, 3, stats64=True)
    assert rows.n_tokens > 1000
    assert 0 < mode.largest <= max(64, rows.n_rows + 1)


def test_mean_pair_holds_the_float64_mean():
    mean = torch.tensor([0.1, 1e4 / 3, -2.5, 0.0], dtype=torch.float64)
    hi, lo = mean_pair(mean)
    assert hi.dtype == lo.dtype == torch.float32
    assert torch.equal(hi, mean.float())
    assert (hi.double() + lo.double() - mean).abs().max() < 1e-12 * mean.abs().max()
    assert lo[2] == 0 and lo[3] == 0  # a float32 mean leaves nothing


def test_whiten64_is_exact_on_a_tie_and_float64_accurate_else():
    rng = np.random.default_rng(1)
    rows = Rows.from_lengths(torch.from_numpy(rng.integers(1, 30, 400)))
    steps = (torch.arange(400) >= 200).long()
    x = torch.from_numpy((50 + rng.normal(0, 1, rows.n_tokens)).astype(np.float32))
    x[rows.row_ids >= 200] = 0.7  # step 1 tied
    mask = torch.from_numpy((rng.random(rows.n_tokens) < 0.7).astype(np.float32))
    errors = StepErrors([1, 2])
    got = step_whiten(x, mask, rows, steps, 2, errors, stats64=True)
    assert not errors.failed()
    tied = rows.row_ids >= 200
    assert torch.equal(got[tied], torch.zeros_like(got[tied]))
    xs, ms = x[~tied].double().numpy(), mask[~tied].double().numpy()
    n = ms.sum()
    mean = (xs * ms).sum() / n
    want = (xs - mean) / np.sqrt(((xs - mean) ** 2 * ms).sum() / (n - 1) + 1e-8)
    np.testing.assert_allclose(got[~tied].double().numpy(), want, rtol=1e-5, atol=1e-6)
    # verl's float32 form of the same step: one ulp of a mean of 50 is 4e-6 of a std of 1
    f32 = step_whiten(x, mask, rows, steps, 2).double().numpy()
    assert np.abs(f32[~tied.numpy()] - want).max() > np.abs(got[~tied].double().numpy() - want).max()


def test_whiten64_flags_steps_of_one_token():
    rows = Rows.from_lengths(torch.tensor([2, 3]))
    mask = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
    errors = StepErrors([1, 2])
    step_whiten(torch.ones(5), mask, rows, torch.tensor([0, 1]), 2, errors, "w", stats64=True)
    assert set(errors.failed()) == {1, 2}
    assert "single token" in errors.failed()[1] and "no token" in errors.failed()[2]
