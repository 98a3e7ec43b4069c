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


def _verl_correction(table, cfg: dict):
    """verl's rollout correction of one step's batch, as its trainer calls it: (batch, metrics)."""
    batch = DataProto.from_dict(tensors={
        "old_log_probs": padded(table, "old_log_probs"), "rollout_log_probs": padded(table, "rollout_log_probs"),
        "response_mask": padded(table, "response_mask"),
    })
    return helper.compute_rollout_correction_and_add_to_batch(batch, RolloutCorrectionConfig(**cfg))


def _compare(tmp_path, cfg: dict, seed: int):
    rng = np.random.default_rng(seed)
    tables = [long_tail_table(rng, s) for s in (1, 2)]
    run = write_run(tmp_path / "run", tables, {"algorithm": {"adv_estimator": "grpo"}})
    metrics, tokens = run_rldiag(run, {RC + k: v for k, v in cfg.items()})
    for table in tables:
        step = int(table["step"][0].as_py())
        out, want = _verl_correction(table, cfg)
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


def test_verify_accepts_verls_one_pass_std_rounding_noise(tmp_path):
    """Sequence-level IS weights that are all 1 up to float32 rounding: their true spread is ~0, and
    verl's one-pass float32 ``E[x^2] - E[x]^2`` logs rounding noise for ``*_std``, which rldiag's
    two-pass spread does not reproduce. ``verify`` with its default tolerances accepts that noise,
    and still rejects a std off by 0.05 (a wrong IS level or threshold is that far)."""
    import json

    import pyarrow as pa

    from rldiag.analysis.verify import verify_run

    rng = np.random.default_rng(11)
    tables = []
    for step in (1, 2):
        t = long_tail_table(rng, step)
        old = t["old_log_probs"].combine_chunks()
        # the rollout log-probs equal the trainer's up to a float32 ulp of a nearby value
        rollout = pa.ListArray.from_arrays(old.offsets, pa.array(
            (old.values.to_numpy() * np.float32(1 + 2e-7)).astype(np.float32)))
        tables.append(t.set_column(t.schema.get_field_index("rollout_log_probs"), "rollout_log_probs", rollout))
    cfg = dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=False)
    run = write_run(tmp_path / "run", tables, {"algorithm": {"adv_estimator": "grpo", "rollout_correction": cfg}})
    lines, noise = [], []
    for table in tables:
        step = int(table["step"][0].as_py())
        _, want = _verl_correction(table, cfg)
        logged = {k: float(v) for k, v in want.items() if k.startswith("rollout_corr/")}
        noise += [v for k, v in logged.items() if k.endswith("_std")]
        lines.append({"step": step, "data": logged})
    assert max(noise) > 1e-5  # verl's spread here is float32 rounding, not data
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rep = verify_run(run)
    std_fields = [k for k in rep.fields if k.startswith("rollout_corr/") and k.endswith("_std")]
    assert std_fields and all(rep.fields[k].mismatches == 0 for k in std_fields), rep.first_mismatch
    assert rep.exit_code == 0

    # a real difference in a spread is still caught
    lines[0]["data"][std_fields[0]] += 0.05
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rep = verify_run(run)
    assert rep.fields[std_fields[0]].mismatches == 1 and rep.exit_code == 1
