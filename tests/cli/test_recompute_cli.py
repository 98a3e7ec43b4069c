"""`rldiag recompute` and `rldiag check` on real files, through the CLI entry point."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rldiag.cli.main import main
from rldiag.io.outputs import read_scenario


def test_baseline_recompute_writes_a_complete_scenario(synth_run, capsys):
    assert main(["recompute", str(synth_run), "--no-progress"]) == 0
    meta, table = read_scenario(synth_run, "baseline")
    assert meta["steps_done"] == [1, 2, 3, 4, 5] and meta["steps_failed"] == {}
    assert meta["settings"]["algorithm.adv_estimator"] == "grpo"  # from run.yaml
    assert meta["overrides"] == {}
    assert len(meta["inputs"]) == 5 and all(len(i["sha256"]) == 64 and i["size"] > 0 for i in meta["inputs"])
    assert table.column("step").to_pylist() == [1, 2, 3, 4, 5]
    assert table.schema.field("step").type == pa.int64()
    assert table.schema.field("actor/pg_clipfrac").type == pa.float64()
    assert "critic/advantages/mean" in table.column_names
    out = capsys.readouterr().out
    assert "scenario baseline" in out and "actor/pg_clipfrac" in out


def test_estimator_rloo_with_save_tokens(synth_run):
    assert main(["recompute", str(synth_run), "--estimator", "rloo", "--save-tokens", "--no-progress"]) == 0
    d = synth_run / "rldiag" / "scenarios" / "adv_estimator=rloo"
    meta = json.loads((d / "scenario.json").read_text())
    assert meta["settings"]["algorithm.adv_estimator"] == "rloo"
    files = sorted(p.name for p in (d / "tokens").iterdir())
    assert files == [f"step_{s:06d}.parquet" for s in range(1, 6)]
    t = pq.read_table(d / "tokens" / "step_000003.parquet")
    batch = pq.read_table(synth_run / "batches" / "step_3.parquet")
    assert t.column("row").to_pylist() == list(range(batch.num_rows))
    assert pa.compute.list_value_length(t["advantages"]).equals(pa.compute.list_value_length(batch["response_mask"]))
    for col in ("advantages", "returns", "token_level_rewards", "response_mask", "ratio", "pg_losses", "ref_kl"):
        assert col in t.column_names, col
    assert t.schema.field("response_mask").type == pa.list_(pa.int8())
    assert t.schema.field("advantages").type == pa.list_(pa.float32())
    # the recomputed mask is the input mask (no rejection configured)
    assert t["response_mask"].to_pylist() == batch["response_mask"].to_pylist()


def test_set_and_steps_and_name(synth_run):
    rc = main(["recompute", str(synth_run), "--set", "algorithm.adv_estimator=gae", "--set", "algorithm.lam=0.95",
               "--steps", "2:3", "--name", "gae95", "--no-progress"])
    assert rc == 0
    meta, table = read_scenario(synth_run, "gae95")
    assert meta["overrides"] == {"algorithm.adv_estimator": "gae", "algorithm.lam": 0.95}
    assert meta["steps_done"] == [2, 3]
    assert table.column("step").to_pylist() == [2, 3]
    # GAE advantages are whitened per step: mean ~ 0
    assert all(abs(v) < 1e-5 for v in table.column("critic/advantages/mean").to_pylist())


def test_rerun_replaces_scenario_atomically(synth_run):
    assert main(["recompute", str(synth_run), "--name", "s", "--no-progress"]) == 0
    assert main(["recompute", str(synth_run), "--name", "s", "--steps", "1", "--no-progress"]) == 0
    meta, _ = read_scenario(synth_run, "s")
    assert meta["steps_done"] == [1]
    leftovers = [p.name for p in (synth_run / "rldiag" / "scenarios").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_bad_step_fails_alone_and_the_rest_is_written(synth_run, capsys):
    p = synth_run / "batches" / "step_4.parquet"
    t = pq.read_table(p)
    t = t.set_column(t.column_names.index("step"), "step", pa.array([99] * t.num_rows, pa.int64()))
    pq.write_table(t, p)
    rc = main(["recompute", str(synth_run), "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "step 4" in err and "step column says 99" in err
    meta, table = read_scenario(synth_run, "baseline")
    assert meta["steps_done"] == [1, 2, 3, 5]
    assert "step_4.parquet" in meta["steps_failed"]["4"]
    assert table.column("step").to_pylist() == [1, 2, 3, 5]


def test_errors_are_type_colon_message_and_exit_1(tmp_path, capsys):
    assert main(["recompute", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.startswith("RunDirError: run directory")
    (tmp_path / "empty").mkdir()
    assert main(["recompute", str(tmp_path / "empty")]) == 1
    assert "has no batch files" in capsys.readouterr().err


def test_unknown_estimator_and_setting(synth_run, capsys):
    assert main(["recompute", str(synth_run), "--estimator", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("UnknownKeyError: unknown advantage estimator 'nope'; valid:") and "rloo" in err
    assert main(["recompute", str(synth_run), "--set", "algorithm.gama=1"]) == 1
    assert "ConfigError: unknown setting 'algorithm.gama'" in capsys.readouterr().err
    assert not (synth_run / "rldiag" / "scenarios" / "adv_estimator=nope").exists()


def test_cuda_without_gpu_is_a_clear_error(synth_run, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["recompute", str(synth_run), "--device", "cuda"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_check_reports_needs_and_problems(synth_run, capsys):
    assert main(["check", str(synth_run), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "steps: 5 (1..5)" in out and "gae" in out and "no problems found" in out
    # drop `values`: gae needs it
    for p in (synth_run / "batches").iterdir():
        t = pq.read_table(p)
        pq.write_table(t.drop(["values", "vpreds"]), p)
    t = pq.read_table(synth_run / "batches" / "step_2.parquet")
    lp = t["log_probs"].to_pylist()
    lp[3] = lp[3][:-1]
    t = t.set_column(t.column_names.index("log_probs"), "log_probs", pa.array(lp, pa.list_(pa.float32())))
    pq.write_table(t, synth_run / "batches" / "step_2.parquet")
    assert main(["check", str(synth_run), "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "needs `values`, missing" in captured.out
    assert "step 2, row 3, column 'log_probs'" in captured.err
