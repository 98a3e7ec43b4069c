"""The adaptive KL controller is replayed across steps in step order, also for a --steps subset."""

from __future__ import annotations

import numpy as np
import pytest

from rldiag.io.outputs import read_scenario
from rldiag.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run

KL = {
    "algorithm.use_kl_in_reward": True,
    "algorithm.kl_ctrl.type": "adaptive",
    "algorithm.kl_ctrl.kl_coef": 0.05,
    "algorithm.kl_ctrl.target_kl": 0.001,
    "algorithm.kl_ctrl.horizon": 100,
}


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
