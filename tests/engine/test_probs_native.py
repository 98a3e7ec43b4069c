"""The compiled comparison of the trainer's and the rollout engine's probabilities
(rldiag.engine.probs_native, native/rollout_probs.c) against its torch twin in
rldiag.engine.metrics.rollout_probs_metrics: the same five metrics on batches with what the read
must get right: tokens off the mask holding NaN or infinities, steps without tokens or with one,
rows of one step apart, log-probs far below float32's smallest probability, masks as float32 and
bool."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import rldiag.engine.probs_native as native
from rldiag.engine.layout import Rows
from rldiag.engine.metrics import rollout_probs_metrics

pytestmark = pytest.mark.skipif(not native.built(),
                                reason="the compiled kernel was not built (no C compiler at install); .ci/run requires it")

HS = hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def batch(seed: int, n_rows: int, n_steps: int):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 300, n_rows)
    lengths[rng.random(n_rows) < 0.1] = 0
    total = int(lengths.sum())
    old = -np.abs(rng.normal(0.5, 1.5, total))
    roll = old - rng.standard_t(3, total) * 0.05
    roll[rng.random(total) < 0.01] = 0.2  # a few positive rollout log-probs
    old[rng.random(total) < 0.01] = -150.0  # below float32's smallest probability
    mask = (rng.random(total) >= 0.1).astype(np.float32)
    off = np.flatnonzero(mask == 0)
    if off.size >= 3:
        old[off[0]], roll[off[1]], old[off[2]] = np.nan, np.inf, -np.inf  # nowhere: off the mask
    step = rng.integers(0, n_steps, n_rows)  # a step's rows apart, in no order
    return (torch.from_numpy(old.astype(np.float32)), torch.from_numpy(roll.astype(np.float32)), torch.from_numpy(mask),
            Rows.from_lengths(torch.from_numpy(lengths)), torch.from_numpy(step))


def both(old, roll, mask, rows, step, n_steps, monkeypatch):
    got = rollout_probs_metrics(old, roll, mask, rows, step, n_steps)
    with monkeypatch.context() as m:
        m.setattr(native, "_LIB", None)
        want = rollout_probs_metrics(old, roll, mask, rows, step, n_steps)
    return got, want


#: the kernel's float32 probabilities are the float64 exponential rounded once (correctly rounded
#: but for a double rounding), torch's within a unit in the last place: a gap |p_old - p_rollout|
#: may differ by a unit of p's last place, about 6e-8 where p is near 1, whatever the gap's size
ATOL = 2e-7


def assert_same(got, want):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=1e-5, atol=ATOL, equal_nan=True, err_msg=k)
        assert got[k].dtype == want[k].dtype == torch.float32


@HS
@given(seed=st.integers(0, 2**31 - 1), n_rows=st.integers(1, 30), n_steps=st.integers(1, 4))
def test_every_metric_equals_the_torch_twin(seed, n_rows, n_steps):
    import _pytest.monkeypatch

    mp = _pytest.monkeypatch.MonkeyPatch()
    try:
        old, roll, mask, rows, step = batch(seed, n_rows, n_steps)
        assert_same(*both(old, roll, mask, rows, step, n_steps, mp))
    finally:
        mp.undo()


def test_a_bool_mask_and_steps_without_tokens_or_with_one(monkeypatch):
    old, roll, mask, rows, step = batch(7, 20, 2)
    step = torch.where(step == 1, torch.tensor(2), step)  # step 1: no row
    lengths = torch.zeros(21, dtype=torch.long)
    lengths[:20] = rows.lengths
    lengths[20] = 1  # step 3: one token
    old, roll = torch.cat([old, torch.tensor([-0.5])]), torch.cat([roll, torch.tensor([-0.7])])
    mask = torch.cat([mask, torch.tensor([1.0])]).bool()
    rows, step = Rows.from_lengths(lengths), torch.cat([step, torch.tensor([3])])
    got, want = both(old, roll, mask, rows, step, 4, monkeypatch)
    assert_same(got, want)
    assert got["training/rollout_probs_diff_valid"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert torch.isnan(got["training/rollout_probs_diff_mean"][1]) and torch.isnan(got["training/rollout_probs_diff_std"][3])


def test_a_worked_step():
    """Two rows of one step: p = exp(log p) in float32, the gaps' max, mean and unbiased std, and
    the Pearson correlation of the probabilities, against numpy on the same float32 values."""
    old = torch.tensor([-0.1, -2.0, -0.5, -1.0, -3.0], dtype=torch.float32)
    roll = torch.tensor([-0.2, -1.5, -0.5, -1.2, -2.0], dtype=torch.float32)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    got = rollout_probs_metrics(old, roll, mask, Rows.from_lengths(torch.tensor([3, 2])), torch.tensor([0, 0]), 1)
    po, pr = np.exp(old.numpy()), np.exp(roll.numpy())
    keep = mask.numpy() > 0
    d = np.abs(po - pr)[keep].astype(np.float64)
    assert got["training/rollout_probs_diff_max"].item() == pytest.approx(d.max(), abs=ATOL)
    assert got["training/rollout_probs_diff_mean"].item() == pytest.approx(d.mean(), abs=ATOL)
    assert got["training/rollout_probs_diff_std"].item() == pytest.approx(d.std(ddof=1), abs=ATOL)
    corr = np.corrcoef(po[keep].astype(np.float64), pr[keep].astype(np.float64))[0, 1]
    assert got["training/rollout_actor_probs_pearson_corr"].item() == pytest.approx(corr, abs=ATOL)


def test_the_kernel_does_not_take_float64_log_probs():
    old, roll, mask, rows, step = batch(3, 5, 1)
    assert native.step_fields(old.double(), roll.double(), mask, rows, step, 1) is None
    assert native.step_fields(old, roll, mask, rows, step, 1) is not None


def test_each_probability_within_one_unit_in_the_last_place_of_exp():
    """p = exp(log p) by the kernel's eight-lane float32 exponential, read back one token a step
    (the rollout's log-prob -inf: the gap is p itself): within one unit in the last place of the
    correctly rounded float32 exp, over the whole range down to float32's subnormals and 0."""
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.uniform(-1.0, 0.5, 3000), rng.uniform(-30.0, 0.0, 3000), rng.uniform(-104.0, -86.0, 2000),
                        np.array([0.0, -0.0, -1e-30, -87.33, -103.97, -104.5, -200.0, 0.3466, -0.3466])]).astype(np.float32)
    n = x.size
    old, roll = torch.from_numpy(x), torch.full((n,), float("-inf"))
    fields = native.step_fields(old, roll, torch.ones(n), Rows.from_lengths(torch.ones(n, dtype=torch.long)),
                                torch.arange(n), n)
    got = fields["diff_max"].astype(np.float32)
    exact = np.exp(x.astype(np.float64)).astype(np.float32)  # float64's exp rounded once: correctly rounded here
    units = np.abs(got.view(np.int32).astype(np.int64) - exact.view(np.int32).astype(np.int64))
    assert units.max() <= 1, x[units.argmax()]
    assert got[-3] == 0.0 and got[-4] == 0.0 and got[-7] == 1.0  # 0 below float32's range; exp(-1e-30) = 1
    assert np.mean(units == 0) > 0.8  # mostly the correctly rounded value itself
