"""``rldiag rows RUN``: the per-row tables filtered, sorted and paged, as JSON or a table; a run
without them says to recompute first (exit 1)."""

from __future__ import annotations

import json

import pytest

import rldiag
from rldiag.cli.main import main
from rldiag.synth import SynthSpec, write_synth_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = write_synth_run(tmp_path_factory.mktemp("rows-cli") / "run", SynthSpec(steps=3, min_len=4, max_len=24, seed=3))
    rldiag.recompute(path, device="cpu")
    return path


def test_json_rows_filtered_sorted_and_limited(run, capsys):
    args = ["rows", str(run), "--where", "length > 10", "--sort", "-advantage_mean", "--limit", "5", "--json"]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert isinstance(got, list) and len(got) == 5
    advs = [r["advantage_mean"] for r in got]
    assert advs == sorted(advs, reverse=True) and all(r["length"] > 10 for r in got)
    want = rldiag.rows(run, where="length > 10", sort="-advantage_mean", limit=5)
    assert [(r["step"], r["row"]) for r in got] == want.select("step", "row").rows()
    assert main(args[:-1] + ["--offset", "5", "--json"]) == 0
    rest = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["row"]) for r in rest] == rldiag.rows(
        run, where="length > 10", sort="-advantage_mean", limit=5, offset=5).select("step", "row").rows()


def test_a_table_with_the_count(run, capsys):
    assert main(["rows", str(run), "--where", "group_has_signal = 1", "--limit", "3"]) == 0
    out = capsys.readouterr().out
    n = rldiag.rows_count(run, where="group_has_signal = 1")
    assert f"rows 1-3 of {n}" in out and "advantage_mean" in out


def test_errors_exit_1_with_the_reason(run, tmp_path, capsys):
    assert main(["rows", str(run), "--where", "lenght > 3"]) == 1
    err = capsys.readouterr().err
    assert "QueryError: where 'lenght > 3': no column 'lenght'" in err and "did you mean 'length'?" in err
    bare = write_synth_run(tmp_path / "bare", SynthSpec(steps=1, seed=1))
    # another scenario is the user's to name and compute
    assert main(["rows", str(bare), "--scenario", "other"]) == 1
    assert "run `rldiag recompute RUN --name other ...` first" in capsys.readouterr().err


def test_a_run_with_no_baseline_has_it_computed_first_and_answers(tmp_path, capsys):
    """One command on a run never recomputed: the baseline is computed (said on stderr), then the
    rows are those a recompute followed by rows gives."""
    bare = write_synth_run(tmp_path / "bare", SynthSpec(steps=2, seed=1))
    assert main(["rows", str(bare), "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "has no baseline yet; computing it" in captured.err
    got = json.loads(captured.out)
    assert len(got) == rldiag.rows_count(bare) > 0 and {g["step"] for g in got} == {1, 2}
    assert main(["rows", str(bare), "--json", "--no-progress"]) == 0  # the second time, read only
    captured = capsys.readouterr()
    assert "computing" not in captured.err and json.loads(captured.out) == got
