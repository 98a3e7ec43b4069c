"""Hand-checkable rollout-correction examples (verl's verl/trainer/ppo/rollout_corr_helper.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rldiag.engine.rollout_correction import (
    IS_LEVELS,
    RS_OPTIONS,
    CorrectionConfig,
    correct,
    parse_is_threshold,
    parse_rs,
)
from rldiag.errors import ConfigError, UnknownKeyError
from tests.conftest import settings
from tests.engine.packing import full_rows, to_padded

E = math.exp


def run(train, rollout, mask=None, **kw):
    t = torch.tensor(train, dtype=torch.float32)
    r = torch.tensor(rollout, dtype=torch.float32)
    m = torch.ones_like(t) if mask is None else torch.tensor(mask, dtype=torch.float32)
    cfg = CorrectionConfig.from_settings(
        settings(**{f"algorithm.rollout_correction.{k}": v for k, v in kw.items()}), "algorithm.rollout_correction"
    )
    (tf, rf, mf), layout = full_rows(t, r, m)
    res = correct(tf, rf, mf, cfg, layout, torch.zeros(t.shape[0], dtype=torch.long), 1)
    res.mask = to_padded(res.mask, layout)  # (rows, width) for the row-wise checks
    if res.weights is not None:
        res.weights = to_padded(res.weights, layout)
    return res, {k.removeprefix("rollout_corr/"): v.item() for k, v in res.metrics.items()}


def test_registries_hold_verl_keys():
    assert IS_LEVELS.names() == ["sequence", "token"]
    assert set(RS_OPTIONS.names()) == {
        "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
        "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3", "binary_kl",
    }
    with pytest.raises(UnknownKeyError, match="valid: binary_kl, seq_max_k2"):
        parse_rs("seq_max_k1", 2.0)
    with pytest.raises(UnknownKeyError, match="sequence, token"):
        run([[0.0]], [[0.0]], rollout_is="geometric")


def test_threshold_parsing_tis_icepop_and_rs():
    assert parse_is_threshold(2.0) == (2.0, None)
    assert parse_is_threshold("2.5") == (2.5, None)
    assert parse_is_threshold("0.5_5.0") == (5.0, 0.5)  # IcePop
    for bad in (True, "0_2", "3_2", "-1", "", "a_b"):
        with pytest.raises(ConfigError):
            parse_is_threshold(bad)
    # k1 options take ratio bounds (upper alone -> lower 1/upper); others one upper bound
    assert parse_rs("token_k1,seq_mean_k3", "2.0,0.01") == {"token_k1": (0.5, 2.0), "seq_mean_k3": (None, 0.01)}
    assert parse_rs("seq_sum_k1, token_k2, seq_sum_k1", "1.25") == {"seq_sum_k1": (0.8, 1.25), "token_k2": (None, 1.25)}
    assert parse_rs("seq_sum_k1", "0.9_1.2") == {"seq_sum_k1": (0.9, 1.2)}
    with pytest.raises(ConfigError, match="one threshold shared by all options or exactly 2"):
        parse_rs("token_k1,token_k2", "2,3,4")
    with pytest.raises(ConfigError, match="single upper bound"):
        parse_rs("token_k2", "0.1_0.2")
    with pytest.raises(ConfigError, match="must be provided"):
        parse_rs("token_k2", None)


def test_token_tis_weights_and_metrics():
    # log r = [0.2, 1.0, -1.0]: raw [1.2214, 2.7183, 0.3679]; TIS at 2 -> [1.2214, 2, 0.3679]
    res, m = run([[0.2, 1.0, -1.0]], [[0.0, 0.0, 0.0]], rollout_is="token")
    w = [E(0.2), 2.0, E(-1.0)]
    assert res.weights[0].tolist() == pytest.approx(w, rel=1e-6)
    assert m["rollout_is_mean"] == pytest.approx(sum(w) / 3, rel=1e-6)
    assert m["rollout_is_max"] == pytest.approx(2.0) and m["rollout_is_min"] == pytest.approx(E(-1.0), rel=1e-6)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3, rel=1e-6)  # raw 2.718 > 2
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3, rel=1e-6)  # raw 0.368 < 1/2
    mu = sum(w) / 3
    std = math.sqrt(sum(x * x for x in w) / 3 - mu * mu)
    assert m["rollout_is_std"] == pytest.approx(std, rel=1e-5)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / (sum((x / mu) ** 2 for x in w) / 3), rel=1e-5)
    assert m["rollout_is_seq_mean"] == pytest.approx(mu, rel=1e-6)
    assert m["rollout_is_seq_std"] == 0.0  # a single row
    assert m["rollout_is_seq_max_deviation"] == pytest.approx(abs(mu - 1), rel=1e-5)
    assert "rollout_is_oob_ratio" not in m and "rollout_is_batch_norm_factor" not in m
    assert torch.equal(res.mask, torch.ones(1, 3))  # IS never rewrites the mask


def test_ess_example():
    # weights [2, 0.5]: mean 1.25 -> normalised [1.6, 0.4] -> mean square 1.36 -> ESS 0.7353
    _, m = run([[math.log(2.0), math.log(0.5)]], [[0.0, 0.0]], rollout_is="token", rollout_is_threshold=4.0)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / 1.36, rel=1e-5)


def test_icepop_zeroes_out_of_band_weights():
    res, m = run([[0.2, 1.0, -1.0]], [[0.0, 0.0, 0.0]], rollout_is="token", rollout_is_threshold="0.5_2.0")
    assert res.weights[0].tolist() == pytest.approx([E(0.2), 0.0, 0.0], rel=1e-6)
    assert m["rollout_is_oob_ratio"] == pytest.approx(2 / 3, rel=1e-6)
    assert m["rollout_is_min"] == 0.0


def test_sequence_is_uses_the_row_product():
    # row 0: log r [0.2, 0.3] -> e^0.5 = 1.6487 on both tokens; row 1: e^1 = 2.718 -> TIS 2
    res, m = run([[0.2, 0.3], [1.0, 7.0]], [[0.0, 0.0], [0.0, 0.0]], mask=[[1, 1], [1, 0]], rollout_is="sequence")
    assert res.weights.flatten().tolist() == pytest.approx([E(0.5), E(0.5), 2.0, 0.0], rel=1e-6)
    assert m["rollout_is_max"] == pytest.approx(E(1.0), rel=1e-6)  # log-space, before truncation
    assert m["rollout_is_min"] == pytest.approx(E(0.5), rel=1e-6)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # rows with sum log r > log 2
    assert m["rollout_is_mean"] == pytest.approx((2 * E(0.5) + 2) / 3, rel=1e-6)


def test_batch_normalize_divides_by_the_mean_weight():
    res, m = run([[0.2, 1.0, -1.0]], [[0.0, 0.0, 0.0]], rollout_is="token", rollout_is_batch_normalize=True)
    w = [E(0.2), 2.0, E(-1.0)]
    mu = sum(w) / 3
    assert res.weights[0].tolist() == pytest.approx([x / mu for x in w], rel=1e-6)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(mu, rel=1e-6)
    assert m["rollout_is_mean"] == pytest.approx(mu, rel=1e-6)  # metrics before normalisation
    # sequence level: mean over rows with tokens of each row's weight: (e^0.5 + 2) / 2
    res, m = run([[0.2, 0.3], [1.0, 7.0], [0.0, 0.0]], [[0.0, 0.0]] * 3, mask=[[1, 1], [1, 0], [0, 0]],
                 rollout_is="sequence", rollout_is_batch_normalize=True)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx((E(0.5) + 2) / 2, rel=1e-6)


def test_token_k1_rejection_and_fractions():
    # -log r = [-0.2, -1.0, 0.1]; threshold 2 -> keep -log r in [log 0.5, log 2] = [-0.693, 0.693]
    res, m = run([[0.2, 1.0, -0.1], [0.1, 0.0, 0.0]], [[0.0] * 3] * 2, mask=[[1, 1, 1], [1, 0, 0]],
                 rollout_rs="token_k1", rollout_rs_threshold=2.0)
    assert res.mask.tolist() == [[1, 0, 1], [1, 0, 0]]
    p = "rollout_rs_token_k1"
    assert m[f"{p}_masked_fraction"] == pytest.approx(1 / 4)
    assert m[f"{p}_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(1 / 4)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m[f"{p}_mean"] == pytest.approx((-0.2 - 1.0 + 0.1 - 0.1) / 4, rel=1e-5)
    assert m[f"{p}_min"] == pytest.approx(-1.0) and m[f"{p}_max"] == pytest.approx(0.1)
    assert m[f"{p}_fraction_low"] == pytest.approx(1 / 4) and m[f"{p}_fraction_high"] == 0.0
    # per-row means of -log r: [-1.1/3, -0.1]
    assert m[f"{p}_seq_mean"] == pytest.approx((-1.1 / 3 - 0.1) / 2, rel=1e-5)
    assert m[f"{p}_seq_max_deviation"] == pytest.approx(1.1 / 3, rel=1e-5)


def test_sequence_rejection_options_drop_whole_rows():
    # rows: log r [0.1, 0.1] (k2 sum 0.01, mean 0.005, max 0.005), [0.3] (k2 0.045)
    train, roll, mask = [[0.1, 0.1], [0.3, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[1, 1], [1, 0]]
    res, m = run(train, roll, mask=mask, rollout_rs="seq_sum_k2", rollout_rs_threshold=0.02)
    assert res.mask.tolist() == [[1, 1], [0, 0]]
    assert m["rollout_rs_seq_sum_k2_seq_mean"] == pytest.approx((0.01 + 0.045) / 2, rel=1e-5)
    assert m["rollout_rs_seq_sum_k2_fraction_high"] == pytest.approx(0.5)  # rows above 0.02
    res, m = run(train, roll, mask=mask, rollout_rs="seq_mean_k2", rollout_rs_threshold=0.006)
    assert res.mask.tolist() == [[1, 1], [0, 0]]
    res, m = run(train, roll, mask=mask, rollout_rs="seq_max_k2", rollout_rs_threshold=0.05)
    assert res.mask.tolist() == [[1, 1], [1, 0]] and m["rollout_rs_masked_fraction"] == 0.0
    # seq_sum_k1 on ratio bounds: sum -log r = [-0.2, -0.3], bounds [log 0.75, log 1.3]=[-0.288, 0.262]
    res, m = run(train, roll, mask=mask, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.75_1.3")
    assert res.mask.tolist() == [[1, 1], [0, 0]]
    assert m["rollout_rs_seq_sum_k1_seq_fraction_low"] == pytest.approx(0.5)


def test_comma_list_ands_the_options():
    train, roll = [[0.05, 0.5], [0.01, 0.02]], [[0.0, 0.0], [0.0, 0.0]]
    # token_k3: e^x - 1 - x: [0.00127, 0.1487, ...]; <= 0.1 drops token (0,1). seq_mean_k2 of row 1 tiny.
    res, m = run(train, roll, rollout_rs="token_k3,seq_mean_k2", rollout_rs_threshold="0.1,0.05")
    # row 0 seq_mean_k2 = (0.00125 + 0.125) / 2 = 0.063 > 0.05 -> whole row dropped too
    assert res.mask.tolist() == [[0, 0], [1, 1]]
    assert m["rollout_rs_token_k3_masked_fraction"] == pytest.approx(0.25)
    assert m["rollout_rs_seq_mean_k2_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(0.5)


def test_offpolicy_diagnostics():
    # train [-1, -1], rollout [-1.2, -0.8]: log r [0.2, -0.2]
    _, m = run([[-1.0, -1.0]], [[-1.2, -0.8]])
    assert m["training_ppl"] == pytest.approx(E(1.0), rel=1e-6)
    assert m["rollout_ppl"] == pytest.approx(E(1.0), rel=1e-6)
    assert m["log_ppl_diff"] == pytest.approx(0.0, abs=1e-6) and m["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["k3_kl"] == pytest.approx(((E(0.2) - 1.2) + (E(-0.2) - 0.8)) / 2, rel=1e-4)
    assert m["chi2_token"] == pytest.approx((E(0.4) + E(-0.4)) / 2 - 1, rel=1e-4)  # cosh(0.4) - 1
    assert m["chi2_seq"] == pytest.approx(0.0, abs=1e-6)  # the row's log r sums to 0
    assert not any(k.startswith(("rollout_is", "rollout_rs")) for k in m)


def test_empty_batch_is_flagged_as_verl_raises():
    res, _ = run([[0.1]], [[0.0]], mask=[[0]], rollout_is="token")
    assert res.empty.tolist() == [True]


def test_all_icepop_weights_zero_fails_like_verl():
    # log r = 1.0 everywhere: raw weight e > 2 -> IcePop zeroes everything; verl's ESS is 1.0 / 0.0
    res, m = run([[1.0, 1.0]], [[0.0, 0.0]], rollout_is="token", rollout_is_threshold="0.5_2.0")
    assert res.weights.tolist() == [[0.0, 0.0]]
    assert [bool(v[0]) for v in res.failed.values()] == [False, True]
    assert "ZeroDivisionError" in list(res.failed)[1]
