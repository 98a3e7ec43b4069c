"""The analysis' tensor code names its device: ``rldiag verify`` recomputes on ``--device`` (the
batch moved there) and reads the results back; the effective weights differentiate the engine's
aggregation on the CPU on purpose. Run under torch's default-device context
``torch.device("meta")`` with CPU inputs, a tensor made without a device is a meta tensor and
mixing it with the inputs raises (tests/engine/test_device_placement.py explains the check)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rldiag.analysis.verify import verify_run
from rldiag.analysis.weights import effective_weights, weights_by_autograd
from rldiag.config.settings import resolve_settings
from rldiag.engine.aggregation import AGG_MODES

SAMPLES = sorted(p for p in (Path(__file__).resolve().parents[2] / "samples").iterdir() if (p / "run.yaml").is_file())


@pytest.mark.parametrize("mode", AGG_MODES.names())
def test_weights_by_autograd_under_the_meta_default(mode):
    lengths = np.array([3, 0, 5, 2], dtype=np.int64)
    rng = np.random.default_rng(0)
    mask = (rng.random(int(lengths.sum())) < 0.7).astype(np.float64)
    adv = rng.normal(size=mask.size) * mask
    s = resolve_settings(config={"actor_rollout_ref": {"actor": {"loss_agg_mode": mode}}})
    with torch.device("meta"):
        slow = weights_by_autograd(adv, mask, lengths, s, float(mask.sum()))
    np.testing.assert_allclose(effective_weights(adv, mask, lengths, s, float(mask.sum())), slow, rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_verify_under_the_meta_default(sample):
    with torch.device("meta"):
        report = verify_run(sample, steps="1:3", candidates=False, device="cpu")
    assert report.steps_unverifiable == {}
    assert report.steps_checked == [1, 2, 3]
    assert report.status == "match"
