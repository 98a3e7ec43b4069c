"""The compiled mismatch pass (rldiag.engine.mismatch_native, native/mismatch_chunk.c) against its
numpy twin (rldiag.engine.mismatch_scan): the same chunk records and picked tokens, and the same
statistics from ``mismatch_stats``, on batches with everything the pass must get right: tokens off
the mask, non-finite log-probs on and off it, empty rows, rows across chunk edges, positive
rollout log-probs, 16-bit values, masks of every dtype."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import rldiag.engine.mismatch_native as native
import rldiag.engine.mismatch_scan as scan
from rldiag.engine.layout import Rows
from rldiag.engine.mismatch import STATS, mismatch_stats

pytestmark = pytest.mark.skipif(not native.built(),
                                reason="the compiled kernel was not built (no C compiler at install); .ci/run requires it")

HS = hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

#: statistics that are counts, order statistics or ratios of counts: the same bits on both passes
EXACT = ("tokens", "gap_abs_p99", "gap_abs_p95", "gap_abs_max", "confident_share", "unconfident_share",
         "extreme_share", "half_share")


def batch(seed: int, n_rows: int, chunk_rows: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A float32 batch: long-tailed rows (some empty), about 5 % of tokens off the mask, a few
    non-finite log-probs on and off it, a few positive rollout log-probs, 16-bit values."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 400 if chunk_rows else 60, n_rows)
    lengths[rng.random(n_rows) < 0.1] = 0
    total = int(lengths.sum())
    old = -np.abs(rng.normal(0.8, 1.2, total))
    gap = rng.standard_t(3, total) * 0.05
    roll = old - gap
    positive = rng.random(total) < 0.02
    roll[positive] = rng.uniform(0.0, 0.5, int(positive.sum()))  # a few positive rollout log-probs
    half = rng.random(total) < 0.1
    roll[half] = roll[half].astype(np.float16)  # 16-bit values
    mask = (rng.random(total) >= 0.05).astype(np.float32)
    bad = rng.choice(total, size=min(total, 6), replace=False) if total else np.zeros(0, dtype=int)
    old[bad[:2]] = np.nan
    roll[bad[2:4]] = -np.inf
    mask[bad[4:]] = 0.0
    old[bad[4:]] = np.inf  # non-finite off the mask
    step = np.sort(rng.integers(0, 3, n_rows))
    return old.astype(np.float32), roll.astype(np.float32), mask, lengths, step


def both(old, roll, mask, lengths, step, n_steps):
    """``mismatch_stats`` by the compiled pass (float32 streams) and by the numpy pass (the same
    values in float64, which the kernel does not take)."""
    rows = Rows.from_lengths(torch.from_numpy(lengths))
    sid = torch.from_numpy(step)
    got = mismatch_stats(torch.from_numpy(old), torch.from_numpy(roll), torch.from_numpy(mask), rows, sid, n_steps)
    want = mismatch_stats(torch.from_numpy(old.astype(np.float64)), torch.from_numpy(roll.astype(np.float64)),
                          torch.from_numpy(mask), rows, sid, n_steps)
    return got, want


def assert_same(got, want):
    for k in STATS:
        g, w = got[k].numpy(), want[k].numpy()
        if k in EXACT:
            np.testing.assert_array_equal(g, w, err_msg=k)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-15, equal_nan=True, err_msg=k)


@HS
@given(seed=st.integers(0, 2**31 - 1), n_rows=st.integers(1, 40), chunk=st.sampled_from([64, 257, 4096]))
def test_every_statistic_equals_the_numpy_pass(seed, n_rows, chunk):
    """Chunks of 64 and 257 tokens (rows, pairs and positions across chunk edges) and one chunk a step."""
    old, roll, mask, lengths, step = batch(seed, n_rows, chunk_rows=True)
    saved = scan.CHUNK
    scan.CHUNK = chunk
    try:
        got, want = both(old, roll, mask, lengths, step, 3)
    finally:
        scan.CHUNK = saved
    assert_same(got, want)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.uint8])
@pytest.mark.parametrize("narrow", [torch.float32, torch.bfloat16, torch.float16])
def test_masks_of_every_dtype_and_16_bit_streams(mask_dtype, narrow):
    """A bool, integer or float mask, and bfloat16 / float16 log-prob streams (each widened to
    float32 exactly): the same statistics as the numpy pass on the same values in float64."""
    old, roll, mask, lengths, step = batch(11, 30, chunk_rows=True)
    keep = np.isfinite(old) & np.isfinite(roll)
    old, roll = np.where(keep, old, -1.0).astype(np.float32), np.where(keep, roll, -1.0).astype(np.float32)
    o, r = torch.from_numpy(old).to(narrow), torch.from_numpy(roll).to(narrow)
    rows, sid = Rows.from_lengths(torch.from_numpy(lengths)), torch.from_numpy(step)
    m = torch.from_numpy(mask).to(mask_dtype)
    assert native.usable(scan.Inputs.of(o, r, m, rows))
    got = mismatch_stats(o, r, m, rows, sid, 3)
    want = mismatch_stats(o.to(torch.float64), r.to(torch.float64), torch.from_numpy(mask), rows, sid, 3)
    assert_same(got, want)


def test_chunk_records_and_picks_equal_the_numpy_pass():
    """Chunk by chunk: every field of the record within float64 rounding (counts exactly), the
    same picked tokens in the same order and the same sample, at a threshold that picks some
    tokens and at 0 (every token above 0)."""
    old, roll, mask, lengths, step = batch(5, 60, chunk_rows=True)
    rows = Rows.from_lengths(torch.from_numpy(lengths))
    inp = scan.Inputs.of(torch.from_numpy(old), torch.from_numpy(roll), torch.from_numpy(mask), rows)
    total = int(lengths.sum())
    size = 1000
    buf, out = scan.Buffers(size), native.Out(size)
    counts = [scan.F[k] for k in ("n", "n_conf", "n_unconf", "extreme", "half", "pairs")]
    seen = 0
    for threshold in (0.05, 0.0):
        for a, m, me, _ in scan.chunks([(0, total)], size):
            mine, theirs = scan.Picked(threshold), scan.Picked(threshold)
            got = native.scan_chunk(inp, out, a, m, me, mine)
            want = scan.scan_chunk(buf, scan.load(inp, buf, a, m, me), False, theirs)
            np.testing.assert_array_equal(got[counts], want[counts])
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
            for g, w in ((mine.d, theirs.d), (mine.y, theirs.y), (mine.sample, theirs.sample)):
                np.testing.assert_array_equal(np.concatenate(g), np.concatenate(w))
            seen += len(mine.d[0])
    assert seen > 100  # the thresholds picked tokens


def test_first_threshold_equals_the_numpy_pass():
    old, roll, mask, lengths, _ = batch(3, 80, chunk_rows=True)
    inp = scan.Inputs.of(torch.from_numpy(old), torch.from_numpy(roll), torch.from_numpy(mask),
                         Rows.from_lengths(torch.from_numpy(lengths)))
    m = min(int(lengths.sum()), 6000)
    assert scan.threshold_positions(m).shape[0] >= 64  # a sample large enough to set a threshold above 0
    buf = scan.Buffers(m)
    want = scan.first_threshold(buf, scan.load(inp, buf, 0, m, m))
    picked = scan.Picked(math.nan)  # the kernel sets a step's first threshold from its first m tokens
    native.scan_chunk(inp, native.Out(m), 0, m, m, picked, sampled=m)
    assert picked.threshold == want and want > 0
    few = scan.Picked(math.nan)  # below 64 sampled tokens: 0, every token above 0 picked
    native.scan_chunk(inp, native.Out(m), 0, m, m, few, sampled=1000)
    assert scan.threshold_positions(1000).shape[0] < 64 and few.threshold == 0.0


def test_rows_starting_and_ending_at_a_chunk_edge_and_empty_rows(monkeypatch):
    """A worked case: rows of 3, 0, 0, 2 and 3 tokens in chunks of 3 (a row start on every edge,
    two empty rows at one offset): positions, pairs and their shifts as defined."""
    old = np.array([-1.0, -2.0, -0.5, -0.25, -1.5, -3.0, -0.75, -2.5], dtype=np.float32)
    roll = old - np.array([0.5, -0.25, 0.125, 0.0, 0.5, 1.0, -0.5, 0.25], dtype=np.float32)
    lengths = np.array([3, 0, 0, 2, 3])
    mask = np.ones(8, dtype=np.float32)
    monkeypatch.setattr(scan, "CHUNK", 3)
    got, want = both(old, roll, mask, lengths, np.zeros(5, dtype=np.int64), 1)
    assert_same(got, want)
    d, x, y = (old - roll).astype(np.float64), old.astype(np.float64), roll.astype(np.float64)
    pairs = [(0, 1), (1, 2), (3, 4), (5, 6), (6, 7)]  # within rows only
    assert got["pair_abs_gap"].item() == pytest.approx(np.mean([(abs(d[t]) + abs(d[u])) / 2 for t, u in pairs]))
    assert got["shift_next_abs_gap"].item() == pytest.approx(np.mean([abs(y[t] - x[u]) for t, u in pairs]))
    pos = np.array([0, 1, 2, 0, 1, 0, 1, 2], dtype=np.float64)
    a = np.abs(d)
    corr = np.mean((a - a.mean()) * (pos - pos.mean())) / (a.std() * pos.std())
    assert got["gap_position_corr"].item() == pytest.approx(corr, rel=1e-12)
    assert math.isfinite(got["gap_std"].item())


def test_the_kernels_exp_is_within_two_units_in_the_last_place():
    """A one-token chunk's ``exp`` field is that token's ``exp|d|``: the kernel's own exp against
    numpy's over gaps from 0 to 750 (past 700 the kernel takes libm's exp; past 709.78 both
    overflow to inf), the reduction's edges (odd multiples of ln 2 / 2) included."""
    rng = np.random.default_rng(2)
    gaps = np.concatenate([[0.0, 1e-30, 1e-8, 0.5 * math.log(2), 1.5 * math.log(2), 700.0, 709.0, 709.7, 710.0, 750.0],
                           rng.uniform(0, 1, 300), rng.uniform(0, 50, 300), rng.exponential(3, 300)])
    roll = np.float32(-1.0) - gaps.astype(np.float32)
    old = np.full_like(roll, -1.0)
    gaps = old.astype(np.float64) - roll.astype(np.float64)  # float32 values: the gap is exact in float64
    n = len(gaps)
    inp = scan.Inputs.of(torch.from_numpy(old), torch.from_numpy(roll), torch.ones(n),
                         Rows.from_lengths(torch.ones(n, dtype=torch.long)))
    out = native.Out(4)
    got = np.array([native.scan_chunk(inp, out, i, 1, 1, scan.Picked(1.0))[scan.F["exp"]] for i in range(n)])
    with np.errstate(over="ignore"):
        want = np.exp(gaps)
    finite = np.isfinite(want)
    assert (np.isinf(got) == ~finite).all()
    np.testing.assert_allclose(got[finite], want[finite], rtol=4.5e-16, atol=0)


def test_the_small_gaps_exp_is_within_two_units_in_the_last_place():
    """Up to |d| = 1/8 the kernel takes exp's Taylor series without range reduction: held to
    numpy's exp densely there and on both sides of the cut (float32 gaps, exact in float64)."""
    cut = 0.125
    gaps32 = np.concatenate([np.linspace(0.0, 0.2, 2001, dtype=np.float32),
                             np.nextafter(np.float32(cut), np.float32(0)) * np.ones(1, np.float32),
                             np.float32(cut) * np.ones(1, np.float32),
                             np.nextafter(np.float32(cut), np.float32(1)) * np.ones(1, np.float32)])
    roll = np.float32(-1.0) - gaps32
    old = np.full_like(roll, -1.0)
    gaps = old.astype(np.float64) - roll.astype(np.float64)
    n = len(gaps)
    inp = scan.Inputs.of(torch.from_numpy(old), torch.from_numpy(roll), torch.ones(n),
                         Rows.from_lengths(torch.ones(n, dtype=torch.long)))
    out = native.Out(4)
    got = np.array([native.scan_chunk(inp, out, i, 1, 1, scan.Picked(1.0))[scan.F["exp"]] for i in range(n)])
    np.testing.assert_allclose(got, np.exp(gaps), rtol=4.5e-16, atol=0)


def test_four_and_eight_lane_blocks_give_the_same_bits(monkeypatch):
    """The blocks in one AVX-512 vector (where the processor has it) and in two four-lane ones
    (``RLDIAG_NATIVE_LANES=4``): every field, pick and sample the same bits, with each kind of
    mask and gaps on both sides of the small exp's cut and past vexp's range."""
    old, roll, mask, lengths, _ = batch(21, 200, chunk_rows=True)
    roll[::97] = old[::97] - 3.0  # |d| above 1/8 in some octets only
    roll[5000] = old[5000] - 701.0  # past vexp's range: that block takes libm's exp
    rows = Rows.from_lengths(torch.from_numpy(lengths))
    total = int(lengths.sum())
    assert total > 6000
    runs = {}
    for lanes in ("8", "4"):
        if lanes == "4":
            monkeypatch.setenv("RLDIAG_NATIVE_LANES", "4")
        else:
            monkeypatch.delenv("RLDIAG_NATIVE_LANES", raising=False)
        records = []
        for m in (torch.from_numpy(mask), torch.from_numpy(mask > 0), torch.from_numpy(mask).to(torch.uint8)):
            inp = scan.Inputs.of(torch.from_numpy(old), torch.from_numpy(roll), m, rows)
            out = native.Out(3000)
            for a, n, me, _ in scan.chunks([(0, total)], 3000):
                picked = scan.Picked(0.05)
                rec = native.scan_chunk(inp, out, a, n, me, picked)
                records.append(np.concatenate([rec, *picked.d, *picked.y, *(s.astype(np.float64) for s in picked.sample)]))
        runs[lanes] = (native.lanes(), np.concatenate(records))
    assert runs["4"][0] == 4 and runs["8"][0] in (4, 8)
    assert np.array_equal(runs["8"][1], runs["4"][1])


def test_rldiag_native_0_turns_the_kernel_off(tmp_path):
    """``RLDIAG_NATIVE=0``: the numpy pass runs (and gives the statistics)."""
    import subprocess
    import sys

    code = ("import rldiag.engine.mismatch_native as m, torch; from rldiag.engine.layout import Rows;"
            "from rldiag.engine.mismatch import mismatch_stats;"
            "s = mismatch_stats(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0]), torch.ones(2),"
            " Rows.from_lengths(torch.tensor([2])), torch.zeros(1, dtype=torch.long), 1);"
            "print(m.built(), float(s['gap_mean'][0]))")
    import os

    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, RLDIAG_NATIVE="0"), capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", "0.25"]


def gaps(seed: int, n: int, kind: str) -> np.ndarray:
    """Picked gaps of several shapes: heavy-tailed over many octaves, 16-bit values (many ties),
    all equal, zeros among them."""
    rng = np.random.default_rng(seed)
    if kind == "tailed":
        d = rng.standard_t(2, n) * 10.0 ** rng.uniform(-6, 0, n)
    elif kind == "ties":
        d = (rng.normal(0, 0.1, n).astype(np.float16)).astype(np.float64)
    elif kind == "equal":
        d = np.full(n, -0.125)
    else:
        d = rng.normal(0, 1, n)
        d[rng.random(n) < 0.3] = 0.0
    return d


@HS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 3000), kind=st.sampled_from(["tailed", "ties", "equal", "zeros"]),
       data=st.data())
def test_select_gives_a_sorts_order_statistics(seed, n, kind, data):
    """The radix selection against ``np.sort`` of ``|d|``: the same values at every asked rank
    (exactly), the top k's summed ``d^2 / 2`` within float64 rounding of an exact sum, the count
    above ``extreme`` exactly."""
    d = gaps(seed, n, kind)
    ranks = sorted(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=8)))
    k = data.draw(st.integers(0, n))
    vals, top_sum, n_ext = native.select(d, ranks, k, 0.5)
    a = np.sort(np.abs(d))
    np.testing.assert_array_equal(vals, a[ranks])
    top = a[n - k:] if k else a[:0]
    assert top_sum == pytest.approx(math.fsum((0.5 * top * top).tolist()), rel=1e-13, abs=0)
    assert n_ext == int(np.count_nonzero(a > 0.5))


def test_select_refuses_ranks_out_of_order_or_range():
    d = np.linspace(-1, 1, 50)
    for ranks, k in (([3, 2], 1), ([50], 1), ([-1], 1), ([1], 51)):
        with pytest.raises(ValueError, match="outside 50 tokens"):
            native.select(d, ranks, k, 1.0)


@pytest.mark.parametrize("kind", ["tailed", "ties", "zeros"])
def test_above_sums_the_tokens_above_the_level(kind):
    d = gaps(4, 1001, kind)  # an odd count: the four lanes' tail
    y = -np.abs(np.random.default_rng(5).normal(0.5, 1.0, d.shape[0]))
    level = float(np.quantile(np.abs(d), 0.6))
    got = native.above(d, y, level)
    sel = np.abs(d) > level
    e, f = d[sel], y[sel]
    want = [sel.sum(), e.sum(), f.sum(), np.abs(e).sum(), ((e - e.mean()) ** 2).sum(),
            ((e - e.mean()) * (f - f.mean())).sum(), ((f - f.mean()) ** 2).sum()]
    assert got[0] == want[0] > 0
    np.testing.assert_allclose(got[1:], want[1:], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_compiled_tails_equal_the_numpy_tails(seed, monkeypatch):
    """The step's order statistics and body by the library's selection and sums against the numpy
    twins (``np.partition``, boolean selection) on the same picks: the order statistics the same
    bits, the sums within float64 rounding."""
    import rldiag.engine.mismatch as mm

    old, roll, mask, lengths, step = batch(seed, 40, chunk_rows=True)
    args = (torch.from_numpy(old), torch.from_numpy(roll), torch.from_numpy(mask),
            Rows.from_lengths(torch.from_numpy(lengths)), torch.from_numpy(step), 3)
    got = mismatch_stats(*args)
    monkeypatch.setattr(mm.native, "built", lambda: False)
    want = mismatch_stats(*args)
    assert_same(got, want)
    np.testing.assert_array_equal(got["gap_abs_p95"].numpy(), want["gap_abs_p95"].numpy())


def test_a_library_of_another_version_is_refused():
    """``native.checked``: the library only where its calling convention's number and record
    length are the bindings' (an install not rebuilt since the C changed runs the twin)."""
    from rldiag.engine import native as libs

    fields = len(scan.FIELDS)
    assert libs.checked("mismatch_chunk", "mismatch", native.ABI, fields) is not None
    assert libs.checked("mismatch_chunk", "mismatch", native.ABI - 1, fields) is None
    assert libs.checked("mismatch_chunk", "mismatch", native.ABI, fields + 1) is None
    assert libs.checked("mismatch_chunk", "nothing", native.ABI, fields) is None  # no such functions
