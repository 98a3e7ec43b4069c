"""The effective per-token weights' closed forms against the engine's aggregation differentiated
(the compare's earlier path), per mode on random layouts, and a whole compare on a real run."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.analysis import agreement
from rldiag.analysis import compare as compare_mod
from rldiag.analysis.compare import compare
from rldiag.analysis.weights import ROW_FACTORS, effective_weights, weights_by_autograd
from rldiag.config.settings import resolve_settings
from rldiag.engine.aggregation import AGG_MODES
from rldiag.io.run_layout import RunLayout
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run

AGG = "actor_rollout_ref.actor.loss_agg_mode"


def test_every_aggregation_mode_has_a_closed_form():
    assert sorted(ROW_FACTORS) == AGG_MODES.names()


@hsettings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(sorted(ROW_FACTORS)),
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([None, 1.0, 512.0]),
    horizon=st.sampled_from([None, 64]),
    with_is=st.booleans(),
)
def test_closed_form_equals_the_engine_derivative(mode, lengths, seed, scale, horizon, with_is):
    rng = np.random.default_rng(seed)
    lengths = np.array(lengths, dtype=np.int64)
    n = int(lengths.sum())
    mask = (rng.random(n) < 0.7).astype(np.float64)
    adv = rng.normal(size=n) * mask
    isw = rng.random(n) * 2 if with_is else None
    n_norm = float(mask.sum()) + float(rng.integers(0, 3))  # the loss mask may count more tokens
    if n_norm == 0:
        n_norm = 1.0
    cfg = {AGG: mode, "actor_rollout_ref.actor.loss_scale_factor": scale, "data.max_response_length": horizon}
    s = resolve_settings(config={k: v for k, v in cfg.items() if v is not None})
    fast = effective_weights(adv, mask, lengths, s, n_norm, isw)
    slow = weights_by_autograd(adv, mask, lengths, s, n_norm, isw)
    assert fast.dtype == np.float64 and fast.shape == (n,)
    np.testing.assert_allclose(fast, slow, rtol=2e-6, atol=1e-12)
    assert np.all(fast[mask == 0] == 0)


def _old_dot(x, y):  # the earlier pearson's BLAS dot
    return float(np.dot(x, y))


@pytest.mark.parametrize("mode_b", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_compare_equals_the_earlier_path_on_a_run(tmp_path, monkeypatch, mode_b):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=3, seed=31, prompts=6, n=4, min_len=3, max_len=40))
    recompute(run, name="base", save_tokens=True)
    recompute(run, {"algorithm.adv_estimator": "rloo", AGG: mode_b}, name="other", save_tokens=True)
    streamed = []
    fast = compare(run, "base", "other", on_step=streamed.append)
    fast_files = {f: pq.read_table(RunLayout(run).comparison("base", "other").dir / f).to_pylist()
                  for f in ("tokens.parquet", "groups.parquet", "metrics.parquet")}
    assert [a.step for a in streamed] == fast.token_steps == [1, 2, 3]
    assert streamed == fast.tokens

    monkeypatch.setattr(compare_mod, "effective_weights", weights_by_autograd)
    monkeypatch.setattr(agreement, "_dot", _old_dot)
    slow = compare(run, "base", "other")
    slow_files = {f: pq.read_table(RunLayout(run).comparison("base", "other").dir / f).to_pylist() for f in fast_files}
    assert fast_files["groups.parquet"] == slow_files["groups.parquet"]
    assert fast_files["metrics.parquet"] == slow_files["metrics.parquet"]
    for got, want in zip(fast_files["tokens.parquet"], slow_files["tokens.parquet"], strict=True):
        assert got.keys() == want.keys()
        for k in got:
            assert got[k] == pytest.approx(want[k], rel=1e-6, nan_ok=True), k
    assert fast.tokens[0].weight_mean_abs_change > 0.01  # the two modes' weights differ
    for k, v in slow.summary.items():
        assert fast.summary[k] == pytest.approx(v, rel=1e-6, nan_ok=True), k
