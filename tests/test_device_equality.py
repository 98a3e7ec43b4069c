"""The GPU path gives the CPU path's numbers (float32 tolerance). Runs where CUDA is present;
on CPU-only machines the same scan kernels are checked in tests/engine/test_scan.py."""

from __future__ import annotations

import pytest
import torch

from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.mark.parametrize("estimator", ["gae", "grpo", "reinforce_plus_plus", "rloo"])
def test_cuda_matches_cpu(tmp_path, estimator):
    run = write_synth_run(tmp_path / "r", SynthSpec(steps=3, prompts=8, n=4, max_len=200, seed=2))
    over = {"algorithm.adv_estimator": estimator, "algorithm.lam": 0.95,
            "algorithm.rollout_correction.rollout_is": "token"}
    cpu = {r["step"]: r for r in recompute(run, over, name="cpu", device="cpu", save_tokens=True).metrics}
    gpu = {r["step"]: r for r in recompute(run, over, name="gpu", device="cuda", save_tokens=True).metrics}
    for step, row in cpu.items():
        for key, value in row.items():
            assert gpu[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True), (step, key)
