"""The doctor's rule ``rollout_mismatch``: one finding per cause with the contract's evidence
(``cause``, ``confidence``, ``steps``), severity ``info`` for bf16-level precision (never counted),
shown beside the size-and-trend rules; the bundled samples' findings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rldiag.cli.main import main
from rldiag.doctor import diagnose
from rldiag.synth import MismatchSpec, write_mismatch_run

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def test_json_finding_of_a_planted_cause(tmp_path, capsys):
    run = write_mismatch_run(tmp_path / "run", MismatchSpec(cause="sampling_truncation", steps=4, rows=32, tokens=100))
    assert main(["doctor", str(run), "--json", "--no-progress"]) == 1
    d = json.loads(capsys.readouterr().out)
    mm = [f for f in d["findings"] if f["rule"] == "rollout_mismatch"]
    assert len(mm) == 1
    f = mm[0]
    assert f["severity"] == "warning" and d["healthy"] is False
    ev = f["evidence"]
    assert ev["cause"] == "sampling_truncation" and 0.8 < ev["confidence"] <= 1
    assert ev["steps"] == [1, 2, 3, 4] and len(ev["values"]) == 4
    assert ev["details"]["config"]["predicts"] is True and ev["details"]["config"]["settings"]["top_p"] == 0.9
    assert "top_p=0.9 with processed log-probs" in f["message"] and "rollout_is=token" in f["remedy"]


def test_text_output_shows_the_cause_with_the_size_rules(tmp_path, capsys):
    run = write_mismatch_run(tmp_path / "run", MismatchSpec(cause="outlier_tokens", steps=6, rows=32, tokens=100))
    assert main(["doctor", str(run), "--no-progress"]) == 1
    out = capsys.readouterr().out
    section = out[out.index("Rollout vs trainer log-probs"):]
    assert "outlier_tokens, confidence 1.00" in section and "what to do:" in section
    assert "passed rollout_kl_growing" in section or "(rollout_kl_growing)" in section
    assert "token: step" in section and ("'</s>'" in section or "'<|tool_call|>'" in section)


def test_a_clean_run_passes_the_rule(tmp_path):
    run = write_mismatch_run(tmp_path / "run", MismatchSpec(cause="clean", steps=3, rows=16, tokens=50))
    rep = diagnose(run)
    assert not [f for f in rep.findings if f.rule == "rollout_mismatch"]
    assert "agree" in rep.passed["rollout_mismatch"]


@pytest.mark.parametrize(("sample", "settled"), [("grpo-tool", 16), ("ppo-gae", 13)])
def test_the_bundled_samples_findings(tmp_path, sample, settled, capsys):
    """One warning: ref_kl_high (KL(pi_old || pi_ref) above 0.5 nats a token from about step 10;
    the calibration corpus: precision 0.97, 0.42 false alarms per 100 healthy steps). Information,
    not counted: length_clipped (on the corpus a share of cut responses came with healthy runs as
    often as with sick ones) and the mismatch's precision. length_clipped's clip ratio is back
    under 0.1 at every step from ``settled`` on: resolved."""
    run = shutil.copytree(SAMPLES / sample, tmp_path / sample)
    rep = diagnose(run)
    got = sorted((f.rule, f.severity, f.evidence.cause) for f in rep.findings)
    assert got == [("length_clipped", "info", None), ("ref_kl_high", "warning", None),
                   ("rollout_mismatch", "info", "precision")], got
    info = next(f for f in rep.findings if f.rule == "rollout_mismatch")
    assert info.evidence.confidence > 0.8 and info.evidence.details["statistics"]["gap_std"] < 0.01
    assert main(["doctor", str(run), "--no-progress"]) == 1  # ref_kl_high counts, information does not
    assert "\n1 finding; " in (out := capsys.readouterr().out) and "; 2 for information (not counted)" in out
    clipped = next(f for f in rep.findings if f.rule == "length_clipped")
    values = dict(zip(clipped.evidence.sparkline["steps"], clipped.evidence.sparkline["values"], strict=True))
    assert values[settled - 1] > 0.1 and all(v <= 0.1 for s, v in values.items() if s >= settled)
    assert (clipped.evidence.state, clipped.evidence.state_since) == ("resolved", settled)
    assert f"state: resolved since step {settled}: response_length/clip_ratio back below 0.1" in out
    assert "trend of response_length/clip_ratio: " in out and "trend of rldiag/mismatch/gap_std: " in out
    assert out.count("not a probability") == 1 and "calibration: " in out
    assert (info.evidence.state, info.evidence.state_since) == ("ongoing", 1)


def test_info_alone_exits_zero(tmp_path, capsys):
    run = write_mismatch_run(tmp_path / "run", MismatchSpec(cause="precision", steps=3, rows=32, min_len=20, max_len=100))
    rep = diagnose(run)
    assert [(f.rule, f.severity) for f in rep.findings] == [("rollout_mismatch", "info")] and rep.healthy
    assert main(["doctor", str(run), "--no-progress"]) == 0
    assert "no problem found" in capsys.readouterr().out
