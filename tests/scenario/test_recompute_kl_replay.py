"""The adaptive KL controller is replayed across steps in step order, also for a --steps subset."""

from __future__ import annotations

import numpy as np
import pytest

from rldiag.io.outputs import read_scenario
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run
from tests.kl_runs import KL, KL_LIVE, poison, rejected_after_capture


def test_adaptive_coefficients_follow_verls_update(tmp_path):
    run = write_synth_run(tmp_path / "r", SynthSpec(steps=4, seed=5))
    rep = recompute(run, KL, name="kl")
    rows = sorted(rep.metrics, key=lambda r: r["step"])
    beta = 0.05
    for r in rows:
        assert r["actor/reward_kl_penalty_coeff"] == pytest.approx(beta, rel=1e-6)
        err = float(np.clip(r["actor/reward_kl_penalty"] / 0.001 - 1, -0.2, 0.2))
        beta *= 1 + err * 16 / 100  # 16 rows per step
    assert rows[-1]["actor/reward_kl_penalty_coeff"] != pytest.approx(0.05)


def test_subset_of_steps_replays_the_earlier_ones(tmp_path):
    run = write_synth_run(tmp_path / "r", SynthSpec(steps=4, seed=5))
    full = {r["step"]: r for r in recompute(run, KL, name="all").metrics}
    part = {r["step"]: r for r in recompute(run, KL, name="part", steps="3:").metrics}
    assert sorted(part) == [3, 4]
    for s in (3, 4):
        assert part[s]["actor/reward_kl_penalty_coeff"] == pytest.approx(full[s]["actor/reward_kl_penalty_coeff"], rel=1e-6)
        assert part[s]["critic/rewards/mean"] == pytest.approx(full[s]["critic/rewards/mean"], rel=1e-6)
    meta, _ = read_scenario(run, "part")
    assert meta["steps_done"] == [3, 4]


# --- `recompute --steps N:` against a recompute of every step ------------------------------------
#
# KL_LIVE: the controller moves at every step, so a replay that reads a different statistic
# shows in every later step.

COEF = "actor/reward_kl_penalty_coeff"
FIRST = 6  # --steps 6: of 8 steps


def _live_run(path, loss_mask=False):
    run = write_synth_run(path, SynthSpec(steps=8, seed=3))
    if loss_mask:
        rejected_after_capture(run)
    return run


def _by_step(rep):
    return {r["step"]: r for r in rep.metrics}


def _subset_matches_full(run, overrides, steps=f"{FIRST}:"):
    """The steps of a --steps recompute equal those of a recompute of every step: the coefficient
    of the first to the bit (the replay reads the statistic in the full recompute's packs), every
    metric (the KL-in-reward ones among them) to float32 rounding."""
    full = _by_step(recompute(run, overrides, name="all"))
    part = _by_step(recompute(run, overrides, name="part", steps=steps))
    first = min(part)
    assert part[first][COEF] == full[first][COEF]
    for s, row in part.items():
        assert set(row) == set(full[s])
        for k, v in row.items():
            assert v == pytest.approx(full[s][k], rel=1e-6, abs=1e-12, nan_ok=True), (s, k)
        assert {"actor/reward_kl_penalty", "critic/rewards/mean"} <= set(row)
    coefs = [full[s][COEF] for s in sorted(full)]
    assert all(abs(b / a - 1) > 1e-3 for a, b in zip(coefs, coefs[1:]))  # the controller moved at every step
    return full, part


def test_subset_plain(tmp_path):
    _, part = _subset_matches_full(_live_run(tmp_path / "r"), KL_LIVE)
    assert sorted(part) == [6, 7, 8]


def test_subset_with_gaps_replays_the_steps_left_out_between(tmp_path):
    # step 5's coefficient depends on steps 3 and 4 too: every step left out before the last
    # chosen one is replayed, in step order
    _, part = _subset_matches_full(_live_run(tmp_path / "r"), KL_LIVE, steps="2,5:6,8")
    assert sorted(part) == [2, 5, 6, 8]


def test_subset_bypass_mode_replays_the_rollout_log_probs(tmp_path):
    # bypass: verl's old_log_probs are the rollout's, in the reward KL too
    _subset_matches_full(_live_run(tmp_path / "r"), {**KL_LIVE, "algorithm.rollout_correction.bypass_mode": True})


def test_subset_with_loss_mask_replays_the_mask_before_rejection(tmp_path):
    # the reward KL precedes rollout correction: it reads loss_mask, not the post-rejection response_mask
    _subset_matches_full(_live_run(tmp_path / "r", loss_mask=True), KL_LIVE)


def test_subset_with_rollout_correction(tmp_path):
    on = {"algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_rs": "token_k1",
          "algorithm.rollout_correction.rollout_rs_threshold": 0.01}
    full, _ = _subset_matches_full(_live_run(tmp_path / "r", loss_mask=True), {**KL_LIVE, **on})
    assert any(r["rollout_corr/rollout_rs_masked_fraction"] > 0 for r in full.values())


def test_subset_with_malformed_earlier_steps(tmp_path):
    """verl's controller advanced at every step the trainer ran. Step 2's file is malformed outside
    the statistic (log_probs): it fails, but its statistic still advances the controller, in a full
    recompute and in the replay alike. Step 4's is malformed inside it (ref_log_prob): skipped."""
    clean = _by_step(recompute(_live_run(tmp_path / "clean"), KL_LIVE, name="all"))
    run = _live_run(tmp_path / "r")
    poison(run, 2, "log_probs")
    poison(run, 4, "ref_log_prob")
    full, part = _subset_matches_full(run, KL_LIVE)
    assert sorted(full) == [1, 3, 5, 6, 7, 8] and sorted(part) == [6, 7, 8]
    assert full[3][COEF] == pytest.approx(clean[3][COEF], rel=1e-6)  # step 2 counted
    assert full[5][COEF] == pytest.approx(clean[4][COEF], rel=1e-6)  # step 4 not
    meta, _ = read_scenario(run, "part")
    assert meta["steps_done"] == [6, 7, 8]
