"""The CLI's one table of exit codes (rldiag.cli.exit_codes), command by command."""

from __future__ import annotations

import json

import pytest

from rldiag.analysis.verify import VerifyReport
from rldiag.cli import exit_codes
from rldiag.cli.main import main
from rldiag.synth import SynthSpec, write_synth_run


def test_the_table_keeps_the_documented_numbers():
    assert (exit_codes.OK, exit_codes.FAILED, exit_codes.CANNOT_CHECK, exit_codes.INTERRUPTED) == (0, 1, 2, 130)
    assert exit_codes.error_exit("verify") == exit_codes.error_exit("doctor") == 2
    assert exit_codes.error_exit("check") == exit_codes.error_exit("import-wandb") == exit_codes.error_exit(None) == 1


@pytest.mark.parametrize("status", ["match", "mismatch", "unverifiable"])
def test_verify_report_and_cli_agree_on_every_status(status, monkeypatch):
    monkeypatch.setattr(VerifyReport, "status", property(lambda self: status))
    report = VerifyReport(run="r", settings={}, overrides={}, tolerances={}, masked_only=False)
    assert report.exit_code == exit_codes.VERIFY_STATUS_EXIT[status]
    assert report.to_dict()["exit_code"] == exit_codes.VERIFY_STATUS_EXIT[status]


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: rldiag" in capsys.readouterr().out


@pytest.mark.parametrize("command, code", [("check", 1), ("recompute", 1), ("compare", 1), ("doctor", 2), ("verify", 2)])
def test_an_error_exits_with_the_commands_code(tmp_path, capsys, command, code):
    missing = str(tmp_path / "no-such-run")
    assert main([command, missing] + (["baseline", "logged"] if command == "compare" else [])) == code
    err = capsys.readouterr().err
    assert f"RunDirError: run directory {missing} does not exist" in err.replace("\n", "")


def test_verify_json_reports_an_unverifiable_run_with_its_code(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["verify", str(missing), "--json"]) == 2
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["status"] == "unverifiable" and report["exit_code"] == 2
    assert report["error"] == f"RunDirError: run directory {missing} does not exist"
    assert "verify: the run cannot be verified" in out.err


def test_a_healthy_and_a_failing_answer(tmp_path):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=3))
    assert main(["check", str(run)]) == 0
    assert main(["recompute", str(run)]) == 0
    (run / "batches" / "step_2.parquet").write_bytes(b"not parquet")
    assert main(["check", str(run)]) == 1
    assert main(["recompute", str(run), "--name", "again"]) == 1
