"""The Off-policy page's mismatch pictures and diagnosis layout (rldiag.viz.mismatch): the numbers
each picture draws, checked against numpy (and, for the shift bars, against the engine's own
per-step statistics)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from rldiag.analysis.mismatch import Cause, MismatchDiagnosis
from rldiag.viz import mismatch as mm
from rldiag.viz.offpolicy import MISMATCH, OTHER, has_rollout_corr, panels


def tokens_frame(old, rollout, rows=None, positions=None, lag=None, text=None) -> pl.DataFrame:
    """A ``mismatch_tokens`` frame for the arrays given (one row by default, positions 0..n-1)."""
    old, rollout = np.asarray(old, dtype=np.float64), np.asarray(rollout, dtype=np.float64)
    n = len(old)
    rows = np.zeros(n, dtype=np.int64) if rows is None else np.asarray(rows)
    positions = np.arange(n) if positions is None else np.asarray(positions)
    gap = old - rollout
    kl = 0.5 * gap * gap
    same_next = np.r_[(rows[1:] == rows[:-1]) & (positions[1:] == positions[:-1] + 1), False]
    same_prev = np.r_[False, (rows[1:] == rows[:-1]) & (positions[1:] == positions[:-1] + 1)]
    cols = {"row": rows, "position": positions, "old_log_prob": old, "rollout_log_prob": rollout, "gap": gap,
            "kl": kl, "kl_share": kl / kl.sum() if kl.sum() > 0 else np.zeros(n),
            "old_next": np.where(same_next, np.r_[old[1:], np.nan], np.nan),
            "old_prev": np.where(same_prev, np.r_[np.nan, old[:-1]], np.nan)}
    if lag is not None:
        cols["policy_lag"] = np.asarray(lag)
    if text is not None:
        cols["token"] = text
    return pl.DataFrame(cols)


def noisy(n=500, seed=0, scale=0.01):
    rng = np.random.default_rng(seed)
    old = -rng.gamma(1.5, 1.0, n)
    return old, old - rng.normal(0, scale, n)


def test_compact_steps():
    assert mm.compact_steps([7, 1, 2, 3, 5, 8, 3]) == "1-3, 5, 7-8"
    assert mm.compact_steps([4]) == "4"
    assert mm.compact_steps([]) == ""


def test_logprob_hist2d_counts_every_token_on_one_square_grid():
    old, rollout = noisy()
    old[3] = np.nan  # left out
    h = mm.logprob_hist2d(rollout, old, bins=40)
    assert h.counts.shape == (40, 40) and h.edges.shape == (41,)
    assert h.counts.sum() == 499
    finite = np.isfinite(old)
    both = np.r_[old[finite], rollout[finite]]
    assert h.edges[0] == both.min() and h.edges[-1] == both.max()
    # y (rows) is the trainer's: the reference histogram with the same edges
    ref, _, _ = np.histogram2d(old[finite], rollout[finite], bins=[h.edges, h.edges])
    np.testing.assert_array_equal(h.counts, ref)


def test_logprob_figure_identity_line_spans_the_data():
    old, rollout = noisy(300, seed=1)
    frame = tokens_frame(old, rollout)
    fig = mm.logprob_figure(frame, bins=30)
    heat, line = fig.data
    assert np.asarray(heat.customdata).sum() == 300
    lo, hi = min(old.min(), rollout.min()), max(old.max(), rollout.max())
    np.testing.assert_allclose(line.x, [lo, hi])
    np.testing.assert_allclose(line.y, [lo, hi])
    # the colour is log10 of the counts, blank where there are none
    z, counts = np.asarray(heat.z, dtype=np.float64), np.asarray(heat.customdata)
    np.testing.assert_allclose(z[counts > 0], np.log10(counts[counts > 0]))
    assert np.isnan(z[counts == 0]).all()


def test_logprob_hist2d_of_one_point_and_of_nothing():
    h = mm.logprob_hist2d(np.array([-1.0]), np.array([-1.0]), bins=4)
    assert h.counts.sum() == 1 and h.edges[0] < -1.0 < h.edges[-1]
    empty = mm.logprob_hist2d(np.array([]), np.array([]), bins=4)
    assert empty.counts.sum() == 0


def test_gap_histogram_is_symmetric_about_zero_and_shows_one_sidedness():
    old, rollout = noisy(400, seed=2)
    h = mm.gap_histogram(old - rollout, bins=20)
    assert h.counts.sum() == 400
    np.testing.assert_allclose(h.edges[0], -h.edges[-1])
    assert np.abs(h.edges).min() == 0.0  # 0 is the middle edge
    assert h.above == pytest.approx(((old - rollout) > 0).mean())
    # truncation: d <= 0 on every token -> the upper half is empty
    trunc = -np.abs(old - rollout)
    t = mm.gap_histogram(trunc, bins=20)
    assert t.counts[10:].sum() == 0 and t.counts.sum() == 400 and t.above == 0.0


def test_gap_figure_bars_hold_the_tokens_and_mark_zero():
    old, rollout = noisy(250, seed=3)
    fig = mm.gap_figure(tokens_frame(old, rollout), bins=30)
    assert np.asarray(fig.data[0].y).sum() == 250
    (zero,) = fig.layout.shapes
    assert zero.x0 == zero.x1 == 0.0
    assert "above 0" in fig.layout.title.text


def test_position_profile_equals_a_numpy_reference():
    rng = np.random.default_rng(4)
    pos = rng.integers(0, 97, 2000)
    gap = rng.normal(0, 0.01, 2000) * (1 + pos / 50)
    p = mm.position_profile(pos, gap, bins=10)
    assert p["tokens"].sum() == 2000
    assert p["position_lo"][0] == 0 and p["position_hi"][-1] == 96
    for lo, hi, mean, p90 in p.select("position_lo", "position_hi", "mean_abs_gap", "p90_abs_gap").iter_rows():
        sel = np.abs(gap[(pos >= lo) & (pos <= hi)])
        assert mean == pytest.approx(sel.mean()) and p90 == pytest.approx(np.quantile(sel, 0.9))
    # fewer positions than bins: one bin per position
    small = mm.position_profile(np.array([0, 0, 1, 2]), np.array([0.1, -0.3, 0.2, 0.0]), bins=30)
    assert small["position_lo"].to_list() == [0, 1, 2] and small["position_hi"].to_list() == [0, 1, 2]
    assert small["mean_abs_gap"].to_list() == pytest.approx([0.2, 0.2, 0.0])


def test_position_figure_draws_the_profile():
    old, rollout = noisy(120, seed=5)
    frame = tokens_frame(old, rollout, rows=np.repeat(np.arange(4), 30), positions=np.tile(np.arange(30), 4))
    fig = mm.position_figure(frame, bins=6)
    ref = mm.position_profile(frame["position"].to_numpy(), frame["gap"].to_numpy(), 6)
    np.testing.assert_allclose(fig.data[0].y, ref["mean_abs_gap"].to_numpy())
    np.testing.assert_allclose(fig.data[1].y, ref["p90_abs_gap"].to_numpy())
    np.testing.assert_allclose(fig.data[0].x, [2, 7, 12, 17, 22, 27])


def test_shift_agreement_finds_an_off_by_one():
    old = -np.linspace(0.5, 3.0, 12) ** 1.3
    # the rollout series is the trainer's one position later: rollout_t = old_{t+1}
    rollout = np.r_[old[1:], -1.0]
    a = mm.shift_agreement(tokens_frame(old, rollout))
    assert a["+1"] == pytest.approx(0.0)
    assert a["unshifted"] > 0.1 and a["-1"] > a["unshifted"]
    aligned = mm.shift_agreement(tokens_frame(old, old))
    assert aligned["unshifted"] == 0.0 and aligned["+1"] > 0 and aligned["-1"] > 0


def test_shift_agreement_equals_the_engines_step_statistics(tmp_path):
    """The bars are the step's ``rldiag/mismatch/{pair,shift_next,shift_prev}_abs_gap``."""
    from rldiag import api
    from rldiag.synth import SynthSpec, write_synth_run

    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=3))
    api.mismatch(run, examples=False)
    metrics = pq.read_table(run / "rldiag" / "scenarios" / "baseline" / "metrics.parquet").to_pylist()
    for row in metrics:
        a = mm.shift_agreement(api.mismatch_tokens(run, row["step"]))
        assert a["unshifted"] == pytest.approx(row["rldiag/mismatch/pair_abs_gap"], rel=1e-9)
        assert a["+1"] == pytest.approx(row["rldiag/mismatch/shift_next_abs_gap"], rel=1e-9)
        assert a["-1"] == pytest.approx(row["rldiag/mismatch/shift_prev_abs_gap"], rel=1e-9)


def test_shift_figure_bars_and_lines_over_training():
    over = pl.DataFrame({"step": [1, 2, 1, 2, 1, 2], "metric": [m for m in mm.SHIFT_METRICS for _ in (1, 2)],
                         "logged": [None] * 6, "baseline": [0.1, 0.2, 1.0, 1.1, 1.2, 1.3]})
    fig = mm.shift_figure({"unshifted": 0.2, "+1": 1.1, "-1": 1.3}, 2, over, "baseline")
    bars, *lines = fig.data
    assert list(bars.y) == [0.2, 1.1, 1.3]
    assert [tr.name for tr in lines] == list(mm.SHIFT_LABELS.values())
    assert list(lines[0].y) == [0.1, 0.2] and list(lines[2].x) == [1, 2]
    assert len(mm.shift_figure({"unshifted": 0.2}, 2).data) == 1  # no history: the bars only


def test_shift_agreement_without_pairs_is_nan():
    a = mm.shift_agreement(tokens_frame([-1.0, -2.0], [-1.1, -2.0], rows=[0, 1]))
    assert all(np.isnan(v) for v in a.values())


def test_top_kl_tokens():
    old, rollout = noisy(60, seed=6)
    frame = tokens_frame(old, rollout, text=[f"t{i}" for i in range(60)])
    top = mm.top_kl_tokens(frame, k=20)
    assert top.height == 20
    assert top.columns == ["row", "position", "token", "old_log_prob", "rollout_log_prob", "gap", "kl_share"]
    assert top["kl_share"].to_list() == sorted(frame["kl_share"].to_list(), reverse=True)[:20]
    first = int(np.argmax(np.abs(old - rollout)))
    assert top["position"][0] == first and top["token"][0] == f"t{first}"
    assert "token" not in mm.top_kl_tokens(tokens_frame(old, rollout)).columns


def test_lag_profile_and_figure():
    old, rollout = noisy(90, seed=7)
    rows = np.repeat(np.arange(9), 10)
    lag = rows % 3
    frame = tokens_frame(old, rollout, rows=rows, positions=np.tile(np.arange(10), 9), lag=lag)
    p = mm.lag_profile(frame)
    assert p is not None and p["policy_lag"].to_list() == [0, 1, 2]
    assert p["tokens"].to_list() == [30, 30, 30] and p["rows"].to_list() == [3, 3, 3]
    for k in range(3):
        assert p["mean_abs_gap"][k] == pytest.approx(np.abs(old - rollout)[lag == k].mean())
    fig = mm.lag_figure(p)
    np.testing.assert_allclose(fig.data[0].y, p["mean_abs_gap"].to_numpy())
    assert mm.lag_profile(tokens_frame(old, rollout)) is None


def test_default_step():
    kl = {1: 0.1, 2: 0.5, 3: 0.3, 4: float("nan")}
    assert mm.default_step([1, 2, 3, 4], kl, preferred=[1, 3]) == 3
    assert mm.default_step([1, 2, 3, 4], kl) == 2
    assert mm.default_step([1, 2, 3, 4], kl, preferred=[4]) == 4  # no finite KL: the last of them
    assert mm.default_step([1, 2, 3, 4], {}) == 4
    assert mm.default_step([1, 2], kl, preferred=[9]) == 2  # preferred steps not shown: all steps
    assert mm.default_step([], kl) is None


def test_metric_by_step():
    joined = pl.DataFrame({"step": [1, 2, 1], "metric": [mm.KL_METRIC, mm.KL_METRIC, "x"],
                           "logged": [None, None, None], "baseline": [0.5, None, 2.0]})
    assert mm.metric_by_step(joined, mm.KL_METRIC, "baseline") == {1: 0.5}
    assert mm.metric_by_step(joined, mm.KL_METRIC, "nope") == {}


def _diag(causes=(), steps=(1, 2), notes=()):
    return MismatchDiagnosis(list(steps), {"gap_abs_p99": 5e-5} if steps else {}, {}, list(causes), {}, list(notes))


def test_verdict_says_what_is_needed_or_that_the_streams_agree():
    box, text = mm.verdict(_diag(steps=()))
    assert box == "info" and "actor_rollout_ref.rollout.calculate_log_probs=True" in text
    assert "rollout_log_probs" in text and "old_log_probs" in text
    box, text = mm.verdict(_diag())
    assert box == "success" and "agree" in text and "2 steps" in text
    cause = Cause("precision", 0.9, "info", "m", "s", [1], [0.9], "r")
    assert mm.verdict(_diag([cause])) is None


def test_cause_views():
    ex = [{"step": 3, "row": 1, "position": 4, "token": None, "old_log_prob": -1.0, "rollout_log_prob": -1.5,
           "gap": 0.5, "kl_share": 0.6}]
    causes = [Cause("outlier_tokens", 0.8, "warning", "a few tokens", "top_kl_share 0.6", [3, 4, 5, 9], [0.8] * 4,
                    "mask them", examples=ex),
              Cause("temperature", 0.7, "critical", "slope", "slope 1.2", [2], [0.7], "fix it")]
    v1, v2 = mm.cause_views(_diag(causes))
    assert (v1.title, v1.box, v1.badge, v1.confidence, v1.steps) == ("Outlier tokens", "warning", "orange", "0.80", "3-5, 9")
    assert v1.examples is not None and v1.examples.columns == [
        "step", "row", "position", "old_log_prob", "rollout_log_prob", "gap", "kl_share"]  # no text: no token column
    assert (v2.box, v2.badge, v2.examples) == ("error", "red", None)
    assert mm.SEVERITY["info"] == ("info", "blue")


def test_offpolicy_panels_add_the_mismatch_fingerprints():
    names = ["rollout_corr/kl", "rldiag/mismatch/slope", "rldiag/mismatch/gap_std", "rldiag/mismatch/tokens"]
    p = panels(names)
    assert p[MISMATCH] == ["rldiag/mismatch/gap_std", "rldiag/mismatch/slope"]  # the panel's order, tokens left out
    assert list(p) == ["Rollout vs train KL", MISMATCH] and OTHER not in p
    assert has_rollout_corr(p) and not has_rollout_corr(panels(names[1:]))
