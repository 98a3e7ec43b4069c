"""``rldiag doctor RUN --follow`` on copies of the bundled samples: the JSON-lines contract, the
same findings as ``rldiag doctor``, each fired once, and the exit codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.main import main

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
FOLLOW = ["--follow", "--idle-timeout", "0", "--poll", "0", "--no-counterfactual"]


def sample(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(SAMPLES / name, dst, ignore=shutil.ignore_patterns("rldiag"))
    return dst


def key(finding: dict) -> str:
    return json.dumps(finding, sort_keys=True)


@pytest.mark.parametrize("name", ["grpo-tool", "ppo-gae"])
def test_follow_on_a_finished_run_prints_the_doctors_findings_once_each(tmp_path, capsys, name):
    run = sample(tmp_path, name)
    # on both samples: ref_kl_high (a warning), length_clipped and precision (information)
    assert main(["doctor", str(run), "--json"]) == exit_codes.FAILED
    report = json.loads(capsys.readouterr().out)
    assert main(["doctor", str(run), "--json", *FOLLOW]) == exit_codes.OK  # an idle end is 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    events = [json.loads(line) for line in lines]  # stdout holds JSON lines only
    assert events and all(set(e) == {"event", "step", "finding"} for e in events)
    assert all(e["event"] == "fired" and isinstance(e["step"], int) for e in events)
    assert sorted(key(e["finding"]) for e in events) == sorted(key(f) for f in report["findings"])
    ids = [(e["finding"]["rule"], e["finding"]["evidence"]["cause"]) for e in events]
    assert len(ids) == len(set(ids))
    assert ("rollout_mismatch", "precision") in ids
    assert all("calibration" in e["finding"]["evidence"] for e in events)
    assert f"followed {run} to step 30 (idle)" in out.err.replace("\n", " ")


def test_follow_text_prints_a_line_per_event_and_the_summary(tmp_path, capsys):
    run = sample(tmp_path, "grpo-tool")
    # length_clipped as it was before the calibration corpus (a warning on the whole run's mean)
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {id: length_clipped, severity: warning, window: 100, min_steps: 1}\n")
    assert main(["doctor", str(run), "--logged-only", "--rules", str(rules), *FOLLOW]) == exit_codes.OK
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[0].split()[:5] == ["step", "1", "fired", "WARNING", "Many"]
    assert "(length_clipped): mean of response_length/clip_ratio over steps 1..30 = 0.2781" in lines[0]
    assert len(lines) == 2 and lines[1].startswith(f"followed {run} to step 30 (idle): 1 fired, 0 changed, 0 cleared")


def test_follow_refuses_steps_and_ctrl_c_exits_130(tmp_path, capsys, monkeypatch):
    run = sample(tmp_path, "grpo-tool")
    assert main(["doctor", str(run), "--steps", "1:3", *FOLLOW]) == exit_codes.CANNOT_CHECK
    assert "--steps cannot be combined with --follow" in capsys.readouterr().err
    assert main(["doctor", str(tmp_path / "missing"), *FOLLOW]) == exit_codes.CANNOT_CHECK
    assert "RunDirError" in capsys.readouterr().err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "follow_doctor", interrupted)
    assert main(["doctor", str(run), "--follow"]) == exit_codes.INTERRUPTED == 130
    assert "interrupted" in capsys.readouterr().err
