"""The rollout-vs-trainer mismatch fingerprints (rldiag.engine.mismatch) against a per-step numpy
reference, and the stage that writes them (rldiag/mismatch/*)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.config.settings import resolve_settings
from rldiag.engine.layout import Rows
from rldiag.engine.mismatch import LAG_STATS, STATS, mismatch_stats, top_gap_tokens
from rldiag.engine.pipeline import recompute_batch
from rldiag.engine.requirements import recompute_columns
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir
from rldiag.synth import MismatchSpec, write_mismatch_run

HS = hsettings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _corr(a, b):
    if len(a) < 1:
        return math.nan
    if a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.mean((a - a.mean()) * (b - b.mean())) / (a.std() * b.std()))


def reference(old, roll, mask, lengths, step_of_row, n_steps, lag=None):
    """One step at a time, one row at a time: every statistic as its docstring defines it."""
    old, roll = np.asarray(old, dtype=np.float64), np.asarray(roll, dtype=np.float64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = {k: np.full(n_steps, math.nan) for k in STATS + (LAG_STATS if lag is not None else ())}
    for s in range(n_steps):
        xs, ys, pos, rows = [], [], [], []
        pairs = []  # (|d_t| + |d_t+1|) / 2, |y_t - x_t+1|, |y_t+1 - x_t|
        for r in np.flatnonzero(step_of_row == s):
            a, b = offsets[r], offsets[r + 1]
            keep = [t for t in range(a, b) if mask[t] > 0 and np.isfinite(old[t]) and np.isfinite(roll[t])]
            for t in keep:
                xs.append(float(old[t])), ys.append(float(roll[t])), pos.append(t - a), rows.append(r)
            for t in keep:
                if t + 1 in keep:
                    pairs.append((abs(old[t] - roll[t]) / 2 + abs(old[t + 1] - roll[t + 1]) / 2,
                                  abs(roll[t] - old[t + 1]), abs(roll[t + 1] - old[t])))
        x, y = np.array(xs, dtype=np.float64), np.array(ys, dtype=np.float64)
        n = len(x)
        out["tokens"][s] = n
        if n == 0:
            continue
        d = x - y
        ad = np.abs(d)
        out["gap_mean"][s], out["gap_std"][s] = d.mean(), d.std()
        out["gap_abs_mean"][s], out["gap_abs_max"][s] = ad.mean(), ad.max()
        out["gap_abs_p99"][s] = np.quantile(ad, 0.99)
        out["gap_abs_p95"][s] = np.quantile(ad, 0.95)
        k2 = 0.5 * d * d
        out["kl_k2"][s] = k2.mean()
        top = math.ceil(0.01 * n)
        out["top_kl_share"][s] = np.sort(k2)[::-1][:top].sum() / k2.sum() if k2.sum() > 0 else 0.0
        out["positive_share"][s] = np.clip(d, 0, None).sum() / ad.sum() if ad.sum() > 0 else 0.5
        out["slope"][s] = np.mean((x - x.mean()) * (y - y.mean())) / y.var() if y.var() > 0 else 1.0
        out["gap_rollout_corr"][s] = _corr(d, y)
        out["logprob_corr"][s] = _corr(x, y)
        conf, unconf = y >= math.log(0.5), y < math.log(0.05)
        out["gap_confident"][s] = d[conf].mean() if conf.any() else 0.0
        out["gap_unconfident"][s] = d[unconf].mean() if unconf.any() else 0.0
        out["confident_share"][s], out["unconfident_share"][s] = conf.mean(), unconf.mean()
        out["gap_position_corr"][s] = _corr(ad, np.array(pos, dtype=np.float64))
        out["gap_logprob_corr"][s] = _corr(ad, np.abs(y))
        p = np.array(pairs) if pairs else np.zeros((1, 3))
        out["pair_abs_gap"][s], out["shift_next_abs_gap"][s], out["shift_prev_abs_gap"][s] = p.mean(axis=0)
        out["token_mult_prob_error"][s] = np.exp(ad).mean()
        out["extreme_share"][s] = (ad > math.log(2)).mean()
        body = ad <= out["gap_abs_p95"][s]  # the top 5 % left out
        xb, yb, db = x[body], y[body], d[body]
        out["body_gap_mean"][s], out["body_gap_std"][s] = db.mean(), db.std()
        out["body_positive_share"][s] = np.clip(db, 0, None).sum() / np.abs(db).sum() if np.abs(db).sum() > 0 else 0.5
        out["body_slope"][s] = np.mean((xb - xb.mean()) * (yb - yb.mean())) / yb.var() if yb.var() > 0 else 1.0
        out["body_gap_rollout_corr"][s] = _corr(db, yb)
        y32 = torch.tensor(y, dtype=torch.float32)
        half = [(v != 0) and (v == float(v.to(torch.bfloat16)) or (v == float(v.to(torch.float16)) and abs(v) >= 2**-14))
                for v in y32]  # a bfloat16, or a normal float16
        out["half_share"][s] = np.mean(half)
        if lag is not None:
            rr = np.array(rows)
            urows = np.unique(rr)
            lg = lag[urows].astype(np.float64)
            gp = np.array([ad[rr == r].mean() for r in urows])
            out["lag_mean"][s] = lg.mean()
            out["lag_gap_corr"][s] = _corr(lg, gp)
            out["lag_gap_slope"][s] = np.mean((lg - lg.mean()) * (gp - gp.mean())) / lg.var() if lg.var() > 0 else 0.0
            tl = lag[rr]
            out["lag_abs_gap_lag0"][s] = ad[tl == 0].mean() if (tl == 0).any() else 0.0
            out["lag_abs_gap_lagged"][s] = ad[tl != 0].mean() if (tl != 0).any() else 0.0
            out["lag0_share"][s] = (tl == 0).mean()
            for name, part in (("lag_body_std_lag0", tl == 0), ("lag_body_std_lagged", tl != 0)):
                out[name][s] = d[part & body].std() if (part & body).any() else 0.0
            on = d[(tl == 0) & body]
            out["lag0_positive_share"][s] = np.clip(on, 0, None).sum() / np.abs(on).sum() if np.abs(on).sum() > 0 else 0.5
    return out


@st.composite
def batches(draw):
    n_steps = draw(st.integers(1, 3))
    n_rows = draw(st.integers(1, 7))
    lengths = np.array(draw(st.lists(st.integers(0, 9), min_size=n_rows, max_size=n_rows)), dtype=np.int64)
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    total = int(lengths.sum())
    old = -np.abs(rng.normal(0.5, 1.5, total))
    kind = draw(st.sampled_from(["noise", "equal", "one_sided", "shift"]))
    roll = {"noise": old + rng.normal(0, 0.05, total), "equal": old.copy(),
            "one_sided": old - np.abs(rng.normal(0, 0.1, total)), "shift": np.roll(old, 1)}[kind]
    mask = (rng.random(total) < 0.8).astype(np.float32)
    if total and draw(st.booleans()):
        roll[rng.integers(0, total)] = -np.inf  # a non-finite log-prob is left out
    step_of_row = rng.integers(0, n_steps, n_rows)
    lag = rng.integers(0, 3, n_rows) if draw(st.booleans()) else None
    return (old.astype(np.float32), roll.astype(np.float32), mask, lengths, step_of_row, n_steps, lag)


@HS
@given(batches())
def test_every_statistic_equals_the_per_step_reference(b):
    old, roll, mask, lengths, step_of_row, n_steps, lag = b
    got = mismatch_stats(torch.from_numpy(old), torch.from_numpy(roll), torch.from_numpy(mask),
                         Rows.from_lengths(torch.from_numpy(lengths)), torch.from_numpy(step_of_row), n_steps,
                         lag=None if lag is None else torch.from_numpy(lag))
    want = reference(old, roll, mask, lengths, step_of_row, n_steps, lag)
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(got[k].numpy(), v, rtol=1e-9, atol=1e-12, equal_nan=True, err_msg=k)


def test_rows_in_another_order_give_the_same_statistics():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 30, 40)
    old = -np.abs(rng.normal(0, 2, lengths.sum())).astype(np.float32)
    roll = (old + rng.normal(0, 0.1, lengths.sum())).astype(np.float32)
    sid = rng.integers(0, 2, 40)
    rows = Rows.from_lengths(torch.from_numpy(lengths))
    a = mismatch_stats(torch.from_numpy(old), torch.from_numpy(roll), torch.ones(len(old)), rows, torch.from_numpy(sid), 2)
    perm = torch.from_numpy(rng.permutation(40))
    sub, tok = rows.take(perm)
    b = mismatch_stats(torch.from_numpy(old)[tok], torch.from_numpy(roll)[tok], torch.ones(len(old)), sub,
                       torch.from_numpy(sid)[perm], 2)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-12, equal_nan=True, msg=k)


def test_truncation_is_one_sided_and_a_shift_agrees_shifted():
    """The two fingerprints on constructed data: renormalised log-probs (d = log kept mass <= 0)
    give positive_share 0; a rollout series one position ahead agrees with the trainer's next."""
    x = torch.tensor([-0.1, -2.0, -0.5, -3.0, -1.0, -0.2], dtype=torch.float32)
    rows = Rows.from_lengths(torch.tensor([6]))
    step0 = torch.zeros(1, dtype=torch.long)
    one = mismatch_stats(x, x + torch.tensor([0.0, 0.3, 0.05, 0.4, 0.1, 0.01]), torch.ones(6), rows, step0, 1)
    assert one["positive_share"].item() == 0.0 and one["gap_mean"].item() < 0
    ahead = torch.cat([x[1:], x[-1:]])
    sh = mismatch_stats(x, ahead, torch.ones(6), rows, torch.zeros(1, dtype=torch.long), 1)
    assert sh["shift_next_abs_gap"].item() == 0.0 and sh["pair_abs_gap"].item() > 0.5


def test_other_frameworks_units_on_a_hand_built_batch():
    """token_mult_prob_error (NeMo RL: the token mean of exp(|d|)) and extreme_share (AReaL: the
    share of tokens with |d| > ln 2, strictly) on three steps: step 0 has gaps 0, ln 3, -ln 4, 0.5
    and, left out, a masked token and one with a -inf rollout log-prob; step 1 one gap of exactly
    ln 2 (not extreme) and one of 1; step 2 no actor token."""
    ln = math.log
    old = torch.zeros(9, dtype=torch.float64)
    roll = torch.tensor([0.0, -ln(3), ln(4), -0.5, -9.0, -math.inf,  # step 0, row 0
                         -ln(2), 1.0,  # step 1, row 1
                         -3.0], dtype=torch.float64)  # step 2, row 2 (masked)
    mask = torch.tensor([1, 1, 1, 1, 0, 1, 1, 1, 0], dtype=torch.float32)
    got = mismatch_stats(old, roll, mask, Rows.from_lengths(torch.tensor([6, 2, 1])), torch.tensor([0, 1, 2]), 3)
    tmpe, ext = got["token_mult_prob_error"].tolist(), got["extreme_share"].tolist()
    assert tmpe[0] == pytest.approx((1 + 3 + 4 + math.exp(0.5)) / 4, rel=1e-15)
    assert tmpe[1] == pytest.approx((2 + math.e) / 2, rel=1e-15)
    assert ext[:2] == [0.5, 0.5]
    assert math.isnan(tmpe[2]) and math.isnan(ext[2])
    # NeMo RL's reduction on the padded (rows, tokens) layout: masked_mean(exp(|d| * mask), mask)
    # over the step's rows equals ours (the -inf token, non-finite, is not an actor token here)
    pad_d = np.array([[0.0, ln(3), ln(4), 0.5], [ln(2), 1.0, 0.0, 0.0]])
    pad_m = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=np.float64)
    per_step = [(np.exp(pad_d[r] * pad_m[r]) * pad_m[r]).sum() / pad_m[r].sum() for r in range(2)]
    assert tmpe[:2] == pytest.approx(per_step, rel=1e-15)
    # equal streams: 1 and 0
    same = mismatch_stats(old[:4], old[:4], torch.ones(4), Rows.from_lengths(torch.tensor([4])),
                          torch.zeros(1, dtype=torch.long), 1)
    assert same["token_mult_prob_error"].item() == 1.0 and same["extreme_share"].item() == 0.0


def test_top_gap_tokens_are_the_largest_with_their_share():
    x = torch.zeros(10)
    y = torch.zeros(10)
    y[3], y[7] = 2.0, -1.0
    top = top_gap_tokens(x, y, torch.ones(10), Rows.from_lengths(torch.tensor([5, 5])), torch.zeros(2, dtype=torch.long), 1, 2)
    assert top.index.tolist() == [3, 7] and top.row.tolist() == [0, 1] and top.pos.tolist() == [3, 2]
    assert top.share.tolist() == pytest.approx([0.8, 0.2])


# ---- the stage ----------------------------------------------------------------------------------


def _recompute(run, overrides=None):
    settings = resolve_settings(run, overrides or {})
    rd = RunDir(run)
    sf = rd.step_files()[1]
    data = load_step(sf, settings, recompute_columns(settings))
    return data, recompute_batch(data.batch, settings, None)


@pytest.fixture(scope="module")
def lag_run(tmp_path_factory):
    return write_mismatch_run(tmp_path_factory.mktemp("mm") / "run",
                              MismatchSpec(cause="policy_lag", steps=3, rows=16, n=4, tokens=40, seed=5))


def test_the_stage_writes_the_fingerprints_with_the_lag(lag_run):
    data, res = _recompute(lag_run)
    names = {k.removeprefix("rldiag/mismatch/") for k in res.metrics if k.startswith("rldiag/mismatch/")}
    assert names == set(STATS + LAG_STATS)
    assert all(torch.isfinite(v).all() for k, v in res.metrics.items() if k.startswith("rldiag/mismatch/"))
    b = data.batch
    lag = data.step - 1 - b.extra["policy_version"]
    want = mismatch_stats(b.old_log_probs, b.rollout_log_probs, b.response_mask, b.rows, b.step_ids, 1, lag=lag)
    for k, v in want.items():
        torch.testing.assert_close(res.metrics[f"rldiag/mismatch/{k}"].to(torch.float64), v, equal_nan=True, msg=k)
    assert res.metrics["rldiag/mismatch/lag_abs_gap_lag0"].item() == 0.0  # lag-0 rows agree exactly


def test_the_stage_runs_whatever_the_correction_settings_and_can_be_switched_off(lag_run):
    data, plain = _recompute(lag_run, {"algorithm.rollout_correction.rollout_is": "token"})
    _, bypass = _recompute(lag_run, {"algorithm.rollout_correction.bypass_mode": True,
                                     "algorithm.rollout_correction.rollout_is": "token"})
    b = data.batch
    lag = data.step - 1 - b.extra["policy_version"]
    # decoupled mode compares old_log_probs; bypass mode (old_log_probs is the rollout's, copied) the update's log_probs
    for res, trainer in ((plain, b.old_log_probs), (bypass, b.log_probs)):
        want = mismatch_stats(trainer, b.rollout_log_probs, b.response_mask, b.rows, b.step_ids, 1, lag=lag)
        torch.testing.assert_close(res.metrics["rldiag/mismatch/gap_std"].to(torch.float64), want["gap_std"])
    _, off = _recompute(lag_run, {"rldiag.mismatch.enable": False})
    assert not any(k.startswith("rldiag/mismatch/") for k in off.metrics)
    assert "actor/pg_loss" in off.metrics  # nothing else changes


# ---- the chunked pass's paths -------------------------------------------------------------------


def _mixed_batch(seed: int, kind: str):
    """3 steps of rows in shuffled step order, 10 % of the tokens off the mask, a -inf rollout
    log-prob, a lag per row; ``kind``: noisy streams, or a constant gap (0) but for 3 % outliers."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 60, 30)
    total = int(lengths.sum())
    old = -np.abs(rng.normal(0.5, 1.5, total))
    roll = old + rng.standard_t(2, total) * 0.05
    if kind == "constant_body":
        roll = old.copy()
        roll[rng.integers(0, total, total // 30)] -= 2.0
    mask = (rng.random(total) >= 0.1).astype(np.float32)
    roll[rng.integers(0, total)] = -np.inf
    sid = rng.integers(0, 3, 30)
    lag = rng.integers(0, 3, 30)
    return old.astype(np.float32), roll.astype(np.float32), mask, lengths, sid, 3, lag


@pytest.mark.parametrize("chunk", [5, 64])
@pytest.mark.parametrize("cancel", [0.0, 2.0**16])
@pytest.mark.parametrize("kind", ["noise", "constant_body"])
@pytest.mark.parametrize("with_lag", [False, True])
def test_chunks_and_both_moment_paths_equal_the_reference(monkeypatch, chunk, cancel, kind, with_lag):
    """Chunks much shorter than the rows (pairs and positions across chunk edges), and both ways
    to the moments: plain product sums and the body as the step less its outliers (``CANCEL``
    2^16), or every step rescanned centred and the body summed on its own (``CANCEL`` 0)."""
    import rldiag.engine.mismatch as mm
    import rldiag.engine.mismatch_scan as scan

    monkeypatch.setattr(scan, "CHUNK", chunk)
    monkeypatch.setattr(mm, "CANCEL", cancel)
    old, roll, mask, lengths, sid, n, lag = _mixed_batch(3, kind)
    lag = lag if with_lag else None
    got = mismatch_stats(torch.from_numpy(old), torch.from_numpy(roll), torch.from_numpy(mask),
                         Rows.from_lengths(torch.from_numpy(lengths)), torch.from_numpy(sid), n,
                         lag=None if lag is None else torch.from_numpy(lag))
    want = reference(old, roll, mask, lengths, sid, n, lag)
    for k, v in want.items():
        np.testing.assert_allclose(got[k].numpy(), v, rtol=1e-9, atol=1e-12, equal_nan=True, err_msg=k)
    if kind == "constant_body":  # the body's gap is exactly 0: its spread and correlation exactly 0, whatever the path
        assert got["body_gap_std"].tolist() == [0.0] * n and got["body_gap_rollout_corr"].tolist() == [0.0] * n


# ---- the order statistics from the picked tokens ----------------------------------------------


def _tail_reference(old, roll, mask, lengths, sid, n_steps):
    """The statistics that come from the step's largest |d|, vectorised (the per-token reference
    is too slow for steps of tens of thousands of tokens)."""
    x, y = old.astype(np.float64), roll.astype(np.float64)
    step = np.repeat(sid, lengths)
    keep = (mask > 0) & np.isfinite(x) & np.isfinite(y)
    out = {k: [] for k in ("gap_abs_p99", "gap_abs_p95", "gap_abs_max", "top_kl_share", "extreme_share",
                           "body_gap_mean", "body_gap_std", "body_slope")}
    for s in range(n_steps):
        d = (x - y)[keep & (step == s)]
        yy = y[keep & (step == s)]
        ad = np.abs(d)
        p99, p95 = np.quantile(ad, [0.99, 0.95])
        k2 = 0.5 * d * d
        body = ad <= p95
        db, yb = d[body], yy[body]
        out["gap_abs_p99"].append(p99)
        out["gap_abs_p95"].append(p95)
        out["gap_abs_max"].append(ad.max())
        out["top_kl_share"].append(np.sort(k2)[::-1][: math.ceil(0.01 * len(d))].sum() / k2.sum())
        out["extreme_share"].append((ad > math.log(2)).mean())
        out["body_gap_mean"].append(db.mean())
        out["body_gap_std"].append(db.std())
        out["body_slope"].append(np.mean((db + yb - (db + yb).mean()) * (yb - yb.mean())) / yb.var())
    return out


@pytest.mark.parametrize("layout", ["stationary", "quiet_first_chunk", "loud_first_chunk", "mostly_equal"])
def test_order_statistics_of_long_steps_from_the_picked_tokens(monkeypatch, layout):
    """Steps of about 30,000 tokens in chunks of 4,096: the threshold the first chunk sets picks
    the step's top tokens (``stationary``); a first chunk whose gaps are 100 times smaller than
    the rest's sets one that picks nearly every token; 100 times larger, one that picks too few,
    and the step is read again with a lower threshold; most gaps exactly 0 (``mostly_equal``):
    the tokens above 0 are picked, the others' order statistics are 0."""
    import rldiag.engine.mismatch as mm
    import rldiag.engine.mismatch_scan as scan

    monkeypatch.setattr(scan, "CHUNK", 4096)
    again = []
    real = mm._pick_again
    monkeypatch.setattr(mm, "_pick_again", lambda *a: again.append(1) or real(*a))
    rng = np.random.default_rng(7)
    lengths = rng.integers(200, 1200, 80)
    sid = np.repeat([0, 1], [40, 40])
    total = int(lengths.sum())
    old = -np.abs(rng.normal(0.5, 1.5, total))
    gap = rng.standard_t(3, total) * 0.05
    scale = {"quiet_first_chunk": 0.01, "loud_first_chunk": 100.0}.get(layout, 1.0)
    gap[:4096] *= scale  # step 0's first chunk
    if layout == "mostly_equal":
        gap[rng.random(total) < 0.97] = 0.0
    mask = (rng.random(total) >= 0.05).astype(np.float32)
    old32, roll32 = old.astype(np.float32), (old - gap).astype(np.float32)
    got = mismatch_stats(torch.from_numpy(old32), torch.from_numpy(roll32), torch.from_numpy(mask),
                         Rows.from_lengths(torch.from_numpy(lengths)), torch.from_numpy(sid), 2)
    want = _tail_reference(old32, roll32, mask, lengths, sid, 2)
    for k, v in want.items():
        np.testing.assert_allclose(got[k].numpy(), v, rtol=1e-9, atol=1e-12, err_msg=k)
    assert bool(again) == (layout == "loud_first_chunk")
    if layout == "mostly_equal":
        assert got["gap_abs_p95"].tolist() == [0.0, 0.0] and got["gap_abs_p99"].min() > 0


@pytest.mark.parametrize("chunk", [3, 5, 65536])
def test_empty_rows_at_a_chunk_edge_count_each_pair_once(monkeypatch, chunk):
    """Empty rows (a response of no tokens) share their offset with the next row: a chunk edge
    there once left the pair before it out three times (``pair_abs_gap`` 0.604 for 0.3875)."""
    import rldiag.engine.mismatch_scan as scan

    monkeypatch.setattr(scan, "CHUNK", chunk)
    old = np.array([-1.0, -2.0, -0.5, -0.25, -1.5, -3.0, -0.75, -2.5])
    roll = old - np.array([0.5, -0.25, 0.125, 0.0, 0.5, 1.0, -0.5, 0.25])
    lengths = np.array([3, 0, 0, 2, 3])
    sid = np.zeros(5, dtype=np.int64)
    rows = Rows.from_lengths(torch.from_numpy(lengths))
    got = mismatch_stats(torch.from_numpy(old), torch.from_numpy(roll), torch.ones(8), rows, torch.from_numpy(sid), 1)
    want = reference(old, roll, np.ones(8), lengths, sid, 1)
    for k, v in want.items():
        np.testing.assert_allclose(got[k].numpy(), v, rtol=1e-9, atol=1e-12, equal_nan=True, err_msg=k)
    assert got["pair_abs_gap"].item() == pytest.approx(0.3875)
