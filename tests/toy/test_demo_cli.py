"""``rldiag demo``: trains into a fresh run directory and says how to watch it."""

from __future__ import annotations

import torch

from rldiag.cli.main import main
from rldiag.io.rundir import RunDir, iter_metrics_lines


def test_demo_trains_into_a_fresh_directory(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "2", "--live", "--pace", "0.01"]) == 0
    text = capsys.readouterr().out
    assert f"rldiag app {out}" in text  # a command a pip user has (the app ships in the package)
    assert "step   2/2" in text
    assert [sf.step for sf in RunDir(out).step_files()] == [1, 2]
    assert [s for s, _ in iter_metrics_lines(out / "metrics.jsonl")] == [1, 2]
    assert (out / "run.yaml").is_file()


def test_demo_refuses_a_directory_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "x").write_text("keep me")
    assert main(["demo", "--out", str(tmp_path), "--steps", "1"]) == 1
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "x").read_text() == "keep me"


def test_demo_honours_the_capture_policy_variables(tmp_path, capsys, monkeypatch):
    import json

    import pyarrow.parquet as pq

    torch.set_num_threads(1)
    monkeypatch.setenv("RLDIAG_CAPTURE_EVERY", "3")
    monkeypatch.setenv("RLDIAG_CAPTURE_GROUPS", "0.5")
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "4"]) == 0
    assert [sf.step for sf in RunDir(out).step_files()] == [1, 3, 4]  # every 3rd, the first, the last
    lines = dict(iter_metrics_lines(out / "metrics.jsonl"))
    assert sorted(lines) == [1, 2, 3, 4]
    assert lines[2]["rldiag/capture/rows"] == 0
    for sf in RunDir(out).step_files():
        table = pq.read_table(sf.path)
        record = json.loads(table.schema.metadata[b"rldiag.capture"])
        assert record["groups_kept"] * 2 == record["groups"] and table.num_rows == record["rows_kept"]
        assert lines[sf.step]["rldiag/capture/rows"] == table.num_rows == record["rows"] // 2


def test_demo_refuses_a_bad_capture_policy(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RLDIAG_CAPTURE_GROUPS", "1.0")
    assert main(["demo", "--out", str(tmp_path / "demo"), "--steps", "1"]) != 0
    assert "RLDIAG_CAPTURE_GROUPS" in capsys.readouterr().err
