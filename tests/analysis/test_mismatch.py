"""The mismatch diagnosis names the cause planted in a synthetic run (rldiag.synth.mismatch:
real softmax distributions, sampled at one temperature and scored at another, top-p with
renormalised log-probs, bf16 logits, a one-position shift, a drifting policy with a per-row
policy_version, a handful of corrupted tokens), says nothing about a clean run, and reads the
run's sampling settings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import rldiag
from rldiag.analysis.mismatch import CAUSES, SamplingConfig, diagnose_mismatch, ramp
from rldiag.synth import MismatchSpec, write_mismatch_run
from rldiag.synth.mismatch import OUTLIER_TEXT

PLANTED = [c for c in CAUSES]
#: the run size the issue fixes for these tests: 8 steps x 64 rows x 200 tokens
SIZE = dict(steps=8, rows=64, tokens=200)


def _diagnose(tmp_path, **spec):
    run = write_mismatch_run(tmp_path / "run", MismatchSpec(**{**SIZE, **spec}))
    return rldiag.mismatch(run, examples=spec.get("cause") == "outlier_tokens")


def _assert_named(diag, cause):
    assert diag.confidences[cause] > 0.8, (cause, diag.confidences)
    others = {c: v for c, v in diag.confidences.items() if c != cause}
    assert all(v < 0.5 for v in others.values()), (cause, others)
    assert [c.cause for c in diag.causes] == [cause]


@pytest.mark.parametrize("cause", PLANTED)
def test_the_planted_cause_is_named_and_no_other(tmp_path, cause):
    diag = _diagnose(tmp_path, cause=cause, seed=0)
    _assert_named(diag, cause)
    found = diag.causes[0]
    assert found.steps and len(found.steps) == len(found.values) and found.remedy and found.statistic


@hsettings(max_examples=20, deadline=None, derandomize=True,
           suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cause=st.sampled_from(PLANTED + ["clean", "float_noise"]), seed=st.integers(1, 10_000),
       temperature=st.sampled_from([0.6, 0.8, 1.25, 1.5]), top_p=st.sampled_from([0.8, 0.9, 0.95]))
def test_over_many_seeds_the_planted_cause_and_only_it(tmp_path_factory, cause, seed, temperature, top_p):
    tmp = tmp_path_factory.mktemp("mm")
    diag = _diagnose(tmp, cause=cause, seed=seed, rollout_temperature=temperature, top_p=top_p)
    if cause in ("clean", "float_noise"):
        assert diag.causes == [] and max(diag.confidences.values()) < 0.5, diag.confidences
    else:
        _assert_named(diag, cause)


def test_a_clean_run_has_no_finding_and_says_the_streams_agree(tmp_path):
    diag = _diagnose(tmp_path, cause="clean")
    assert diag.clean and diag.summary["gap_abs_p99"] == 0.0
    assert any("agree" in n for n in diag.notes)


def test_temperature_planted_the_way_verl_does_raw_logprobs(tmp_path):
    """verl's trainer divides by the rollout temperature; raw log-probs are the engine's at T=1: the
    config (raw_logprobs, temperature 0.7) predicts the temperature cause, and it is found."""
    diag = _diagnose(tmp_path, cause="temperature", temperature_mode="raw")
    _assert_named(diag, "temperature")
    assert diag.causes[0].config["predicts"] is True
    assert diag.causes[0].message.startswith("temperature=0.7 with raw log-probs in the run's config")
    assert diag.causes[0].severity == "critical"


def test_the_config_agrees_or_disagrees_with_the_fingerprint(tmp_path):
    said = _diagnose(tmp_path / "a", cause="sampling_truncation", top_p=0.9)
    assert said.causes[0].message.startswith("top_p=0.9 with processed log-probs in the run's config, and the gap "
                                             "is one-sided")
    silent = _diagnose(tmp_path / "b", cause="sampling_truncation", config_matches=False)
    assert silent.causes[0].config["predicts"] is False
    assert silent.causes[0].message.startswith("the config (no top-p / top-k with processed log-probs) predicts no "
                                               "truncation, yet the gap is one-sided")
    # the config predicts truncation, the data shows none: a note, no finding
    steps = [1, 2]
    flat = {"tokens": np.array([100.0, 100.0]), "gap_abs_p99": np.array([0.0, 0.0]), "gap_mean": np.zeros(2),
            "gap_std": np.zeros(2)}
    d = diagnose_mismatch(steps, flat, {"actor_rollout_ref.rollout.top_p": 0.8})
    assert d.causes == [] and any("predicts sampling_truncation" in n for n in d.notes)


def test_outlier_tokens_are_listed_with_their_text(tmp_path):
    diag = _diagnose(tmp_path, cause="outlier_tokens")
    ex = diag.causes[0].examples
    assert len(ex) == 10 and all(t["token"] in OUTLIER_TEXT for t in ex)
    assert all(abs(t["gap"]) > 1 for t in ex)
    assert sum(t["kl_share"] for t in ex if t["step"] == ex[0]["step"]) > 0.5


def test_precision_severity_follows_the_gap_size():
    steps = [1, 2, 3]
    base = {"tokens": np.full(3, 1000.0), "gap_abs_p99": np.full(3, 0.01), "gap_mean": np.zeros(3),
            "positive_share": np.full(3, 0.5), "slope": np.ones(3), "gap_rollout_corr": np.zeros(3)}
    small = diagnose_mismatch(steps, {**base, "gap_std": np.full(3, 0.003)}, {})
    large = diagnose_mismatch(steps, {**base, "gap_std": np.full(3, 0.2), "gap_abs_p99": np.full(3, 0.5)}, {})
    assert [(c.cause, c.severity) for c in small.causes] == [("precision", "info")]
    assert [(c.cause, c.severity) for c in large.causes] == [("precision", "warning")]


def test_sampling_config_predictions():
    assert SamplingConfig(top_p=0.9).predicts("sampling_truncation") is True
    assert SamplingConfig(top_k=50).predicts("sampling_truncation") is True
    assert SamplingConfig(top_p=0.9, logprobs_mode="raw_logprobs").predicts("sampling_truncation") is False
    assert SamplingConfig(temperature=0.7).predicts("temperature") is False  # processed: after temperature
    assert SamplingConfig(temperature=0.7, logprobs_mode="raw_logits").predicts("temperature") is True
    assert SamplingConfig(temperature=1.0, logprobs_mode="raw_logprobs").predicts("temperature") is False
    assert SamplingConfig().predicts("precision") is None
    got = SamplingConfig.from_settings({"actor_rollout_ref.rollout.top_p": 0.95, "actor_rollout_ref.rollout.top_k": None})
    assert got.top_p == 0.95 and got.top_k == -1


def test_ramp():
    assert ramp(np.array([0.0, 0.5, 1.0, 2.0, np.nan]), 0.5, 1.0).tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]


def test_mismatch_tokens_frame(tmp_path):
    run = write_mismatch_run(tmp_path / "run", MismatchSpec(cause="misaligned", steps=2, rows=8, n=4, tokens=30))
    f = rldiag.mismatch_tokens(run, 1)
    assert {"row", "position", "old_log_prob", "rollout_log_prob", "gap", "kl", "kl_share", "old_next", "old_prev",
            "token"} <= set(f.columns)
    inner = f.filter(f["old_next"].is_not_nan() & (f["position"] < 28))
    # the planted shift: rollout[t] == old[t + 1] wherever both are actor tokens
    np.testing.assert_allclose(inner["rollout_log_prob"].to_numpy(), inner["old_next"].to_numpy(), atol=1e-6)
    assert f["kl_share"].sum() == pytest.approx(1.0)
    with pytest.raises(rldiag.errors.RunDirError, match="no batch file for step 9"):
        rldiag.mismatch_tokens(run, 9)


def test_logprobs_mode_null_is_vllms_raw_default():
    got = SamplingConfig.from_settings({"actor_rollout_ref.rollout.logprobs_mode": None,
                                        "actor_rollout_ref.rollout.temperature": 0.6})
    assert got.logprobs_mode == "raw_logprobs" and got.predicts("temperature") is True
    assert SamplingConfig(top_p=0.9, logprobs_mode="processed_logits").predicts("sampling_truncation") is True


def test_the_docs_table_is_the_thresholds():
    import re
    from pathlib import Path

    from rldiag.analysis.mismatch import markdown_table

    text = (Path(__file__).resolve().parents[2] / "docs" / "mismatch.md").read_text()
    table = re.search(r"<!-- mismatch-thresholds:start -->\n(.*)<!-- mismatch-thresholds:end -->", text, re.S)
    assert table, "docs/mismatch.md has lost its generated table's markers"
    assert table.group(1) == markdown_table(), "regenerate it from rldiag.analysis.mismatch.markdown_table()"
