"""Remedies written for the run at hand (rldiag.doctor.remedies): never a setting the run already
has (it says what that setting did instead), the exact verl keys, the effective value the data
imply when the config disagrees with the fingerprint; counterfactual lines that change nothing
left out with the reason, and an alternative the run already has said, not skipped silently."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import yaml

from rldiag.doctor import diagnose
from rldiag.doctor.evaluators import Evidence, Finding
from rldiag.doctor.remedies import STALENESS_KEY, SYNC_KEY, correction_state, fold_implied, mismatch_remedy
from rldiag.synth import MismatchSpec, write_mismatch_run

RC = "algorithm.rollout_correction"


def _nan(metric: str) -> float:
    return math.nan


def _mismatch(report, cause):
    return next(f for f in report.findings if f.rule == "rollout_mismatch" and f.evidence.cause == cause)


def _no_equal_lines(report):
    for f in report.findings:
        for e in f.counterfactual:
            assert e["with"] != e["without"], (f.rule, e)


@pytest.fixture(scope="module")
def truncation_unrecorded(tmp_path_factory):
    """Top-p 0.9 planted, run.yaml with verl's defaults (top_p=1, top_k=-1)."""
    run = write_mismatch_run(tmp_path_factory.mktemp("rem") / "run", MismatchSpec(
        cause="sampling_truncation", steps=4, rows=32, top_p=0.9, config_matches=False))
    return run, diagnose(run)


def test_truncation_the_config_does_not_predict_says_where_else_and_the_effective_top_p(truncation_unrecorded):
    run, rep = truncation_unrecorded
    f = _mismatch(rep, "sampling_truncation")
    cfg = yaml.safe_load((run / "run.yaml").read_text())["actor_rollout_ref"]["rollout"]
    assert (cfg["top_p"], cfg["top_k"]) == (1.0, -1)
    assert "top_p=1.0 and" not in f.remedy and "Sample the training rollouts with" not in f.remedy
    assert "already samples without truncation" in f.remedy and "generation_config.json" in f.remedy
    # the effective top-p from the gap's floor: the median per-step p99 of |d|, read back from the baseline
    base = pl.read_parquet(run / "rldiag" / "scenarios" / "baseline" / "metrics.parquet")
    floor = float(np.median(base["rldiag/mismatch/gap_abs_p99"].to_numpy()))
    assert f"exp(-{floor:.3g}) = {math.exp(-floor):.3f}" in f.remedy
    assert abs(math.exp(-floor) - 0.9) < 0.02  # the planted top-p
    _no_equal_lines(rep)


def test_an_alternative_the_run_has_is_said_with_what_it_did_and_equal_lines_are_left_out(tmp_path):
    """Policy lag on a run that already has rollout_is=token: the remedy names verl's async keys,
    never suggests rollout_is, quotes its IS ESS over the window; the counterfactual does not try
    it and says so; a line whose with and without are equal is not listed but said."""
    run = write_mismatch_run(tmp_path / "run", MismatchSpec(cause="policy_lag", steps=6, rows=32))
    cfg = yaml.safe_load((run / "run.yaml").read_text())
    cfg.setdefault("algorithm", {})["rollout_correction"] = {"rollout_is": "token"}
    (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    rep = diagnose(run)
    f = _mismatch(rep, "policy_lag")
    assert STALENESS_KEY in f.remedy and SYNC_KEY in f.remedy
    assert "rollout_is=token with" not in f.remedy and "rollout_is=sequence" not in f.remedy
    base = pl.read_parquet(run / "rldiag" / "scenarios" / "baseline" / "metrics.parquet")
    ess = float(base["rollout_corr/rollout_is_eff_sample_size"].mean())
    assert f"the run already sets {RC}.rollout_is=token (threshold 2.0): IS ESS {ess:.2f}" in f.remedy
    tried = {tuple(sorted(e["settings"])) for e in f.counterfactual}
    assert tried == {(f"{RC}.rollout_rs", f"{RC}.rollout_rs_threshold")}
    notes = f.evidence.details["counterfactual_skipped"]
    assert notes[0].startswith(f"rollout_is=token, rollout_is_threshold=2: the run already has it: IS ESS {ess:.2f}")
    _no_equal_lines(rep)


def test_equal_lines_are_said_once_with_the_reason(truncation_unrecorded):
    """rollout_is=token scales the loss, never pi_theta / pi_old: actor/ppo_kl is the same with
    and without it, so that line is left out and said."""
    _, rep = truncation_unrecorded
    f = _mismatch(rep, "sampling_truncation")
    notes = f.evidence.details["counterfactual_skipped"]
    assert any(n.startswith("rollout_is=token, rollout_is_threshold=2: actor/ppo_kl is ") and "with and without it" in n
               for n in notes)
    assert not any(e["metric"] == "actor/ppo_kl" and e["settings"].get(f"{RC}.rollout_is") == "token"
                   for e in f.counterfactual)


def test_remedies_from_settings_alone():
    settings = {"actor_rollout_ref.rollout.top_p": 0.9, "actor_rollout_ref.rollout.top_k": -1}
    text = mismatch_remedy("sampling_truncation", settings, {}, _nan, "default")
    assert "actor_rollout_ref.rollout.top_p=1.0 (now 0.9)" in text and "top_k=-1 (now" not in text
    # temperature: raw log-probs -> processed; the effective temperature from the slope
    stats = {"slope": np.array([0.8, 0.85, 0.9])}
    raw = {"actor_rollout_ref.rollout.temperature": 0.7, "actor_rollout_ref.rollout.logprobs_mode": "raw_logprobs"}
    text = mismatch_remedy("temperature", raw, stats, _nan, "default")
    assert "logprobs_mode=processed_logprobs (now raw_logprobs)" in text and "0.850 x 0.7 = 0.59" in text
    done = {**raw, "actor_rollout_ref.rollout.logprobs_mode": "processed_logprobs"}
    text = mismatch_remedy("temperature", done, stats, _nan, "default")
    assert "logprobs_mode is already processed_logprobs" in text and "=processed_logprobs (now" not in text
    # both corrections on: nothing left to suggest, what each does said
    both = {f"{RC}.rollout_is": "token", f"{RC}.rollout_is_threshold": 2.0, f"{RC}.rollout_rs": "token_k1",
            f"{RC}.rollout_rs_threshold": 2.0}
    means = {"rollout_corr/rollout_is_eff_sample_size": 0.14, "rollout_corr/rollout_is_ratio_fraction_high": 0.031,
             "rollout_corr/rollout_rs_masked_fraction": 0.002}
    already, todo = correction_state(both, lambda m: means.get(m, math.nan))
    assert todo == "" and "IS ESS 0.14 and 3.1% of the weights truncated" in already and "masks 0.2%" in already
    text = mismatch_remedy("precision", both, {}, lambda m: means.get(m, math.nan), "default")
    assert "rollout_is=token with" not in text and "rollout_rs=token_k1 with" not in text
    assert mismatch_remedy("unknown", {}, {}, _nan, "default") == "default"


def test_an_implied_cause_is_kept_inside_the_dominant_one():
    lag = Finding("rollout_mismatch", "t: policy_lag", "warning", "w", "lag", Evidence(cause="policy_lag", confidence=0.9))
    out = Finding("rollout_mismatch", "t: outlier_tokens", "warning", "w", "outliers in lagged rows",
                  Evidence(cause="outlier_tokens", confidence=0.7, statistic="top_kl_share 0.8",
                           details={"implied_by": "policy_lag"}))
    alone = Finding("rollout_mismatch", "t: precision", "info", "w", "noise", Evidence(cause="precision", confidence=0.6,
                                                                                    details={"implied_by": "temperature"}))
    assert fold_implied([lag, out, alone]) == [lag, alone]  # no temperature finding: precision stays
    assert lag.evidence.details["implies"] == [{"cause": "outlier_tokens", "confidence": 0.7,
                                                "message": "outliers in lagged rows", "statistic": "top_kl_share 0.8"}]
