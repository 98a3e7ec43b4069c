"""Rollout correction against the per-row reference loop on random packed steps: IS weights,
the rewritten mask and every ``rollout_corr/*`` metric of each step; packing is inert."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine.rollout_correction import ZERO_WEIGHTS_MESSAGE, CorrectionConfig, correct, parse_rs
from tests.engine import reference_losses as ref
from tests.engine.gen_batches import layout, loss_step, packed, padded, step_ids, unpad

HS = hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

RS_THRESHOLDS = {
    "token_k1": ["0.8_1.25", "1.1", "2.0"],
    "token_k2": ["0.005", "0.05"],
    "token_k3": ["0.005", "0.05"],
    "seq_sum_k1": ["0.5_1.5", "1.2"],
    "seq_sum_k2": ["0.02", "0.2"],
    "seq_sum_k3": ["0.02", "0.2"],
    "seq_mean_k1": ["0.95_1.05", "1.02"],
    "seq_mean_k2": ["0.005", "0.02"],
    "seq_mean_k3": ["0.005", "0.02"],
    "seq_max_k2": ["0.02", "0.1"],
    "seq_max_k3": ["0.02", "0.1"],
    "binary_kl": ["0.001", "0.02"],
}


@st.composite
def rc_case(draw):
    steps = draw(st.lists(loss_step(need_token=True), min_size=1, max_size=3))
    level = draw(st.sampled_from([None, "token", "sequence"]))
    threshold = draw(st.sampled_from([2.0, 1.2, "0.8_1.5", "0.5_5.0"]))
    opts = draw(st.lists(st.sampled_from(sorted(RS_THRESHOLDS)), min_size=0, max_size=3, unique=True))
    specs = [draw(st.sampled_from(RS_THRESHOLDS[o])) for o in opts]
    cfg = {
        "rollout_is": level, "rollout_is_threshold": threshold,
        "rollout_is_batch_normalize": draw(st.booleans()),
        "rollout_rs": ",".join(opts) if opts else None, "rollout_rs_threshold": ",".join(specs) if opts else None,
    }
    return steps, cfg


def engine(steps, cfg):
    c = CorrectionConfig.from_settings({f"x.{k}": v for k, v in cfg.items()}, "x")
    res = correct(packed(steps, "old"), packed(steps, "rollout"), packed(steps, "mask"), c, layout(steps),
                  step_ids(steps), len(steps))
    res.mask = padded(res.mask, steps)  # token outputs back as (rows, width) for the row-wise checks
    if res.weights is not None:
        res.weights = padded(res.weights, steps)
    return res


def reference(d, cfg):
    rc = ref.RC(rollout_is=cfg["rollout_is"], batch_normalize=cfg["rollout_is_batch_normalize"])
    t = cfg["rollout_is_threshold"]
    if isinstance(t, str) and "_" in t:
        lo, up = t.split("_")
        rc.lower, rc.upper = float(lo), float(up)
    else:
        rc.upper = float(t)
    if cfg["rollout_rs"]:
        rc.rs = parse_rs(cfg["rollout_rs"], cfg["rollout_rs_threshold"])
    return ref.rollout_correction_ref(d["old"], d["rollout"], d["mask"], rc)


@HS
@given(rc_case())
def test_rollout_correction_matches_reference(c):
    steps, cfg = c
    res = engine(steps, cfg)
    assert not res.empty.any()
    row0 = 0
    for i, d in enumerate(steps):
        rows = slice(row0, row0 + len(d["lengths"]))
        row0 += len(d["lengths"])
        try:
            weights, mask, metrics = reference(d, cfg)
        except ZeroDivisionError:  # every IcePop weight 0: verl's ESS raises; the step fails
            assert res.failed[ZERO_WEIGHTS_MESSAGE][i]
            continue
        assert not any(bad[i] for bad in res.failed.values())
        assert unpad(res.mask[rows], d["lengths"]) == [[float(x) for x in r] for r in mask]
        if weights is None:
            assert res.weights is None
        else:
            for g, w in zip(unpad(res.weights[rows], d["lengths"]), weights):
                assert g == pytest.approx(w, rel=1e-4, abs=1e-5)
        got = {k.removeprefix("rollout_corr/"): v[i].item() for k, v in res.metrics.items()}
        assert set(got) == set(metrics)
        for k, v in metrics.items():
            assert got[k] == pytest.approx(v, rel=2e-4, abs=2e-5), (k, got[k], v)


@HS
@given(rc_case())
def test_packed_steps_are_corrected_independently(c):
    steps, cfg = c
    together = engine(steps, cfg)
    row0 = 0
    for i, d in enumerate(steps):
        alone = engine([d], cfg)
        rows = slice(row0, row0 + len(d["lengths"]))
        row0 += len(d["lengths"])
        w = alone.mask.shape[1]
        assert torch.equal(together.mask[rows, :w], alone.mask)
        for k, v in alone.metrics.items():
            torch.testing.assert_close(together.metrics[k][i : i + 1], v, rtol=1e-5, atol=1e-6)
