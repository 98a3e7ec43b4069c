"""One bad file fails only its step: the other steps are written, the step is named, and
``rldiag check`` does not call the run clean. Hostile ``metrics.jsonl`` lines are skipped by
every reader, and ``rldiag check`` names them."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rldiag.cli.main import main
from rldiag.io.outputs import read_scenario
from rldiag.io.rundir import MAX_STEP, iter_metrics_records
from rldiag.synth import SynthSpec, write_synth_run

STEPS = 30
HUGE = 123456789012345678901234567890  # 30 digits: beyond int64


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=STEPS, prompts=2, n=3, max_len=12, critic=False, seed=4))


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()


def test_a_step_number_beyond_int64_fails_only_its_step(run, capsys):
    t = pq.read_table(run / "batches" / "step_5.parquet").drop(["step"])
    bad = run / "batches" / f"step_{HUGE}.parquet"
    pq.write_table(t, bad)
    assert main(["recompute", str(run), "--no-progress"]) == 1
    meta, table = read_scenario(run, "baseline")
    assert meta["steps_done"] == list(range(1, STEPS + 1))
    assert table.column("step").to_pylist() == list(range(1, STEPS + 1))
    want = (f"BatchError: file {bad}, step {HUGE}: the step number in the file name is larger than {MAX_STEP}, "
            "the largest step rldiag records")
    assert meta["steps_failed"] == {str(HUGE): want}
    assert f"  step {HUGE}: {want}" in _errors(capsys)
    assert main(["check", str(run)]) == 1
    assert f"  {want.removeprefix('BatchError: ')}" in _errors(capsys)


def test_a_uid_column_of_lists_fails_only_its_step(run, capsys):
    path = run / "batches" / "step_4.parquet"
    t = pq.read_table(path)
    uids = pa.array([[i, 1] for i in range(t.num_rows)], pa.list_(pa.int64()))
    pq.write_table(t.set_column(t.column_names.index("uid"), "uid", uids), path)
    assert main(["recompute", str(run), "--no-progress"]) == 1
    meta, table = read_scenario(run, "baseline")
    good = [s for s in range(1, STEPS + 1) if s != 4]
    assert meta["steps_done"] == good and table.column("step").to_pylist() == good
    want = f"file {path}, step 4, column 'uid': expected string or integer ids, found type list<element: int64>"
    assert meta["steps_failed"] == {"4": f"BatchError: {want}"}
    _errors(capsys)
    assert main(["check", str(run)]) == 1
    assert f"  {want}" in _errors(capsys)
    # compare reads the uids itself: the same one-line error, not an Arrow traceback
    assert main(["compare", str(run), "baseline", "logged", "--no-progress"]) == 1
    assert _errors(capsys)[-1] == f"BatchError: {want}"


HOSTILE_LINES = {
    '{"step": 1e400, "data": {"x": 1}}': "step inf is not a step number (an integer from 0 to 9223372036854775807)",
    '{"step": 1.5, "data": {"x": 1}}': "step 1.5 is not a step number (an integer from 0 to 9223372036854775807)",
    '{"step": true, "data": {"x": 1}}': "step True is not a step number (an integer from 0 to 9223372036854775807)",
    f'{{"step": {HUGE}, "data": {{"x": 1}}}}': f"step {HUGE} is not a step number (an integer from 0 to 9223372036854775807)",
    '{"step": 2, "data": ' + "[" * 100_000 + "]" * 100_000 + "}": "nested too deeply",
    "[1, 2]": "not a JSON object but list",
    '{"data": {"x": 1}}': 'no "step"',
}


def test_hostile_metrics_lines_are_skipped_and_named(tmp_path):
    p = tmp_path / "metrics.jsonl"
    lines = ['{"step": 1, "data": {"a": 1.0}}', *HOSTILE_LINES, '{"step": 3.0, "a": 3.0}', '{"step": "4", "a": 4}']
    p.write_text("\n".join(lines) + "\n")
    skipped: list[tuple[int, str]] = []
    assert [s for s, _ in iter_metrics_records(p, skipped)] == [1, 3, 4]
    assert skipped == [(i + 2, why) for i, why in enumerate(HOSTILE_LINES.values())]


def test_verify_doctor_compare_read_past_hostile_metrics_lines(run, capsys):
    with (run / "metrics.jsonl").open("a") as fh:
        for line in HOSTILE_LINES:
            fh.write(line + "\n")
    logged = sum(1 for _ in (run / "metrics.jsonl").open())
    assert main(["verify", str(run), "--no-progress"]) == 0
    assert main(["doctor", str(run), "--no-progress"]) in (0, 1)  # findings or none; 2 would be an error
    assert re.search(r"\n(1 finding|\d+ findings); ", capsys.readouterr().out)
    assert main(["compare", str(run), "baseline", "logged", "--no-progress"]) == 0
    _errors(capsys)
    assert main(["check", str(run)]) == 0  # the batches are fine; the skipped lines are named
    err = _errors(capsys)
    assert f"  metrics.jsonl: {len(HOSTILE_LINES)} line(s) skipped by every command (the first 5 below)" in err
    first = logged - len(HOSTILE_LINES) + 1
    assert f"    {run}/metrics.jsonl line {first}: {HOSTILE_LINES[next(iter(HOSTILE_LINES))]}" in err
    assert json.loads((run / "rldiag" / "scenarios" / "baseline" / "scenario.json").read_text())["steps_failed"] == {}
