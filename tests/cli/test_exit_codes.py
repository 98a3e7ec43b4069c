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
    assert exit_codes.INTERNAL == 3
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


def _engine_raising(monkeypatch, exc: BaseException, on_step: int | None = None):
    """The engine raising ``exc`` on the packs holding ``on_step`` (every pack when None)."""
    from rldiag.executors import steps

    real = steps.recompute_batch

    def broken(batch, settings, kl_state, **how):
        if on_step is None or on_step in batch.steps:
            raise exc
        return real(batch, settings, kl_state, **how)

    monkeypatch.setattr(steps, "recompute_batch", broken)


def test_an_engine_bug_is_an_internal_error_with_its_traceback(tmp_path, capsys, monkeypatch):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=3, seed=3))
    _engine_raising(monkeypatch, TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'"))
    assert main(["recompute", str(run)]) == exit_codes.INTERNAL == 3
    err = capsys.readouterr().err.replace("\n", " ")
    assert "rldiag: internal error in steps 1, 2, 3: this is a bug in rldiag, please report it" in err
    assert "Traceback (most recent call last)" in err and "in broken" in err  # where it was raised
    assert "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'" in err
    meta = json.loads((run / "rldiag" / "scenarios" / "baseline" / "scenario.json").read_text())
    assert set(meta["steps_failed"]) == {"1", "2", "3"} and meta["steps_done"] == []
    assert meta["steps_failed"]["2"] == ("InternalError: steps 1, 2, 3: TypeError: unsupported operand type(s) for +: "
                                         "'Tensor' and 'NoneType'")


def test_an_engine_bug_fails_its_step_and_the_others_are_written(tmp_path, monkeypatch):
    from rldiag.scenario.recompute import recompute

    run = write_synth_run(tmp_path / "run", SynthSpec(steps=4, seed=3))
    _engine_raising(monkeypatch, IndexError("index 7 is out of bounds for dimension 0 with size 7"), on_step=2)
    rep = recompute(run, pack_tokens=1)  # each step its own pack
    assert rep.steps_done == [1, 3, 4] and list(rep.steps_failed) == [2] and list(rep.internal) == [2]
    assert rep.steps_failed[2] == "InternalError: steps 2: IndexError: index 7 is out of bounds for dimension 0 with size 7"
    assert "IndexError" in rep.internal[2] and rep.internal[2].startswith("Traceback")
    meta = json.loads((run / "rldiag" / "scenarios" / "baseline" / "scenario.json").read_text())
    assert meta["steps_done"] == [1, 3, 4] and list(meta["steps_failed"]) == ["2"]


@pytest.mark.parametrize("bug", [KeyError("critic/vf_loss"), AssertionError("rows out of order"),
                                 AttributeError("'NoneType' object has no attribute 'shape'")])
def test_any_exception_the_engine_raises_fails_its_steps_only(tmp_path, capsys, monkeypatch, bug):
    from rldiag.scenario.recompute import recompute

    run = write_synth_run(tmp_path / "run", SynthSpec(steps=3, seed=3))
    _engine_raising(monkeypatch, bug, on_step=3)
    rep = recompute(run, pack_tokens=1)
    assert rep.steps_done == [1, 2] and rep.steps_failed[3].startswith(f"InternalError: steps 3: {type(bug).__name__}")
    assert list(rep.internal) == [3]


def test_a_refused_input_stays_a_compute_error(tmp_path, capsys, monkeypatch):
    from rldiag.errors import ComputeError

    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=3))
    _engine_raising(monkeypatch, ComputeError("step 1: whitening over a single token"))
    assert main(["recompute", str(run)]) == exit_codes.FAILED
    err = capsys.readouterr().err
    assert "ComputeError: step 1: whitening over a single token" in err
    assert "internal error" not in err and "Traceback" not in err


def test_an_unexpected_exception_anywhere_is_an_internal_error(tmp_path, capsys, monkeypatch):
    from rldiag import api

    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'steps'")

    monkeypatch.setattr(api, "check", broken)
    assert main(["check", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "rldiag: internal error in rldiag check: AttributeError: 'NoneType' object has no attribute 'steps'" in err
    assert "Traceback (most recent call last)" in err


def test_running_out_of_memory_is_no_bug(tmp_path, capsys, monkeypatch):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=3))
    _engine_raising(monkeypatch, MemoryError("cannot allocate 8 GiB"))
    assert main(["recompute", str(run)]) == exit_codes.FAILED
    err = capsys.readouterr().err
    assert "ComputeError: steps 1, 2: MemoryError: cannot allocate 8 GiB" in err.replace("\n", " ")
    assert "internal error" not in err
