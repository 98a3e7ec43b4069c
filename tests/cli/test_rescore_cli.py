"""``rldiag rescore``: the function named before anything runs (path, SHA-256), the summary,
failed rows listed, exit 1 for a failed step."""

from __future__ import annotations

import hashlib

import pytest

from rldiag.cli.main import main
from tests.scenario.rescore_runs import write_text_run

pytestmark = pytest.mark.slow  # worker processes


def _row(text, source="ok", truth="7"):
    return {"text": text, "data_source": source, "ground_truth": truth, "score": 0.5}


def test_rescore_cli(tmp_path, capsys):
    fn = tmp_path / "r.py"
    fn.write_text("def f(data_source, solution_str, ground_truth, extra_info):\n"
                  "    if data_source == 'bad':\n        raise RuntimeError('no grader for ' + solution_str)\n"
                  "    return float(solution_str.endswith(ground_truth))\n")
    run = write_text_run(tmp_path / "run", [[_row("a 7"), _row("b 8"), _row("c 7", "bad"), _row("d 7")],
                                            [_row("e 7", "bad"), _row("f 7", "bad"), _row("g 7", "bad"), _row("h 7")]])
    code = main(["rescore", str(run), "--reward", f"{fn}:f", "--workers", "1", "--name", "strict"])
    out, err = capsys.readouterr()
    assert code == 1  # step 2: 3 of 4 rows failed
    assert f"sha256 {hashlib.sha256(fn.read_bytes()).hexdigest()}" in err
    assert "scenario strict: 8 rows scored" in out and "4 failed" in out
    assert "step 1 row 2 (bad): RuntimeError: no grader for c 7" in err
    assert "step 2: RewardError: 3 of 4 rows' reward calls failed" in err
    assert (run / "rldiag" / "scenarios" / "strict" / "rows" / "step_000001.parquet").is_file()


def test_from_config_without_a_function_is_an_error(tmp_path, capsys):
    run = write_text_run(tmp_path / "run", [[_row("a 7"), _row("b 8")]])
    assert main(["rescore", str(run), "--reward", "from-config"]) == 1
    assert "names no reward function" in capsys.readouterr().err
