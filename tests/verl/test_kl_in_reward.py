"""The adaptive KL controller in the reward against verl 0.9.1's: each step's statistic as
``apply_kl_penalty`` (``verl/trainer/ppo/ray_trainer.py``) computes it, from verl's
``kl_penalty`` and ``masked_mean``, fed to verl's ``AdaptiveKLController`` step after step, against
``rldiag recompute`` of every step and of a ``--steps`` subset (which replays the steps before
it). verl computes the statistic after ``_compute_old_log_prob`` and before rollout correction:
its ``old_log_probs`` are the rollout's in bypass mode, and its ``response_mask`` is the mask a
capture after rejection keeps as ``loss_mask``."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from rldiag.scenario.recompute import recompute
from tests.kl_runs import rejected_after_capture
from tests.verl.harness import assert_close, long_tail_table, padded, run_rldiag, write_run

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.utils.torch_functional import masked_mean  # noqa: E402

KL = {
    "algorithm.use_kl_in_reward": True,
    "algorithm.kl_penalty": "low_var_kl",
    "algorithm.kl_ctrl.type": "adaptive",
    "algorithm.kl_ctrl.kl_coef": 0.05,
    "algorithm.kl_ctrl.horizon": 50,
}
#: near each case's statistic (low_var_kl of old vs ref about 0.05, of rollout vs ref about 0.09),
#: so that no update is clipped and every step's statistic shows in the coefficients after it
TARGET = {"plain": 0.05, "bypass": 0.09, "loss_mask": 0.05}
STEPS = 6
FIRST = 4  # --steps 4:


def _verl_chain(run, bypass: bool, target_kl: float) -> dict[int, tuple[float, float]]:
    """step -> (the coefficient it used, its statistic), verl's controller over every step."""
    ctrl = core_algos.AdaptiveKLController(init_kl_coef=KL["algorithm.kl_ctrl.kl_coef"], target_kl=target_kl,
                                           horizon=KL["algorithm.kl_ctrl.horizon"])
    out = {}
    for step in range(1, STEPS + 1):
        table = pq.read_table(run / "batches" / f"step_{step}.parquet")
        mask = padded(table, "loss_mask" if "loss_mask" in table.column_names else "response_mask")
        old = padded(table, "rollout_log_probs" if bypass else "old_log_probs")
        kld = core_algos.kl_penalty(old, padded(table, "ref_log_prob"), kl_penalty=KL["algorithm.kl_penalty"]) * mask
        current_kl = masked_mean(kld, mask=mask, axis=-1).mean(dim=0).item()
        out[step] = (ctrl.value, current_kl)
        ctrl.update(current_kl=current_kl, n_steps=mask.shape[0])
    return out


@pytest.mark.parametrize("case", ["plain", "bypass", "loss_mask"])
def test_adaptive_coefficient_of_every_step_and_of_a_subset(tmp_path, case):
    rng = np.random.default_rng(41)
    run = write_run(tmp_path / "run", [long_tail_table(rng, s) for s in range(1, STEPS + 1)])
    if case == "loss_mask":
        rejected_after_capture(run)
    overrides = {**KL, "algorithm.kl_ctrl.target_kl": TARGET[case], "algorithm.rollout_correction.bypass_mode": case == "bypass"}
    want = _verl_chain(run, case == "bypass", TARGET[case])
    assert all(abs(kl / TARGET[case] - 1) < 0.2 for _, kl in want.values())  # no update clipped
    full, _ = run_rldiag(run, overrides, name="all")
    part = recompute_subset(run, overrides)
    assert sorted(part) == list(range(FIRST, STEPS + 1))
    for got, steps in ((full, range(1, STEPS + 1)), (part, range(FIRST, STEPS + 1))):
        for s in steps:
            beta, current_kl = want[s]
            assert_close(got[s]["actor/reward_kl_penalty_coeff"], beta, f"{case} coefficient, step {s}")
            assert_close(got[s]["actor/reward_kl_penalty"], current_kl, f"{case} statistic, step {s}")


def recompute_subset(run, overrides) -> dict[int, dict]:
    rep = recompute(run, overrides, name="part", steps=f"{FIRST}:", reuse=False)
    assert not rep.steps_failed, rep.steps_failed
    return {int(r["step"]): r for r in rep.metrics}
