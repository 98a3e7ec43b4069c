"""Rollout correction: every IS level and rejection option of verl 0.9.1's rollout_corr_helper
(``compute_rollout_correction_and_add_to_batch``, as the trainer calls it) against the IS
weights, the rewritten response mask and the ``rollout_corr/*`` metrics of ``rldiag recompute``."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests.verl.harness import assert_close, in_rows, long_tail_table, padded, run_rldiag, write_run

helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
from verl import DataProto  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402

RC = "algorithm.rollout_correction."
#: a threshold verl accepts for each rejection option (k1: ratio bounds; the others: an upper bound)
RS_THRESHOLDS = {
    "token_k1": "0.6_1.6", "seq_sum_k1": "0.3_3.0", "seq_mean_k1": "0.8_1.25",
    "token_k2": 0.08, "token_k3": 0.08, "seq_sum_k2": 0.8, "seq_sum_k3": 0.8, "seq_mean_k2": 0.05,
    "seq_mean_k3": 0.05, "seq_max_k2": 0.2, "seq_max_k3": 0.2,
}
#: rldiag's options that the reference snapshot has and verl 0.9.1 does not
NEWER_THAN_0_9_1 = {"binary_kl"}


def _compare(tmp_path, cfg: dict, seed: int):
    rng = np.random.default_rng(seed)
    tables = [long_tail_table(rng, s) for s in (1, 2)]
    run = write_run(tmp_path / "run", tables, {"algorithm": {"adv_estimator": "grpo"}})
    metrics, tokens = run_rldiag(run, {RC + k: v for k, v in cfg.items()})
    for table in tables:
        step = int(table["step"][0].as_py())
        batch = DataProto.from_dict(tensors={
            "old_log_probs": padded(table, "old_log_probs"), "rollout_log_probs": padded(table, "rollout_log_probs"),
            "response_mask": padded(table, "response_mask"),
        })
        out, want = helper.compute_rollout_correction_and_add_to_batch(batch, RolloutCorrectionConfig(**cfg))
        inside = in_rows(table)
        assert_close(padded(tokens[step], "response_mask"), out.batch["response_mask"], f"{cfg} mask", inside)
        if cfg.get("rollout_is"):
            assert_close(padded(tokens[step], "rollout_is_weights"), out.batch["rollout_is_weights"], f"{cfg} weights",
                         inside & (padded(table, "response_mask") > 0))
        for name, value in want.items():
            assert name in metrics[step], f"{cfg}: rldiag does not report {name}"
            assert_close(metrics[step][name], value, f"{cfg} {name}, step {step}", atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_weights_match_verl(tmp_path, level, threshold, normalize):
    cfg = dict(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize)
    _compare(tmp_path, cfg, seed=zlib.crc32(f"{level}/{threshold}/{normalize}".encode()) % 1000)


@pytest.mark.parametrize("option", sorted(RS_THRESHOLDS))
def test_rejection_matches_verl(tmp_path, option):
    cfg = dict(rollout_is="token", rollout_rs=option, rollout_rs_threshold=RS_THRESHOLDS[option])
    _compare(tmp_path, cfg, seed=sorted(RS_THRESHOLDS).index(option))


def test_every_rejection_option_is_covered():
    from rldiag.engine.rollout_correction import RS_OPTIONS

    assert set(RS_THRESHOLDS) | NEWER_THAN_0_9_1 == set(RS_OPTIONS.names())
