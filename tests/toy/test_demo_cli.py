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
