"""The capture policy (rldiag.capture.policy): every N-th step, whole prompt groups, a byte
budget; recorded in run.yaml, in each batch file and in the logged metrics."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from rldiag.capture import RunWriter
from rldiag.capture.faults import CaptureWarning
from rldiag.capture.policy import CapturePolicy, parse_groups, read_record
from rldiag.errors import CaptureError

ROWS, WIDTH, N = 16, 5, 2  # 8 prompt groups of 2 rows


def _batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, WIDTH + 1, (ROWS,), generator=g)
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).long()
    return {
        "response_mask": mask,
        "attention_mask": mask,
        "old_log_probs": -torch.rand(ROWS, WIDTH, generator=g) * mask,
        "token_level_scores": torch.rand(ROWS, WIDTH, generator=g) * mask,
        "uid": np.array([f"s{step}-g{i // N}" for i in range(ROWS)], dtype=object),
        # a per-row marker: which row of the batch each written row was
        "row_id": np.arange(ROWS, dtype=np.int64),
    }


def _lines(run) -> dict[int, dict]:
    return {x["step"]: x["data"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _train(run, steps: int, **policy) -> RunWriter:
    with RunWriter(run, config={"data": {"seed": 7}}, max_wait_s=60.0, wait_share=None, **policy) as writer:
        for step in range(1, steps + 1):
            writer.write_batch(step, _batch(step))
            writer.log_metrics(step, {"loss": float(step)})
            writer.sync()
    return writer


def test_parse_groups_counts_shares_and_refusals():
    assert parse_groups("4") == 4 and isinstance(parse_groups("4"), int)
    assert parse_groups("0.25") == 0.25
    assert parse_groups(None) is None and parse_groups("") is None
    for bad in ("1.0", "0", "-2", "1.5", "abc", "nan"):
        with pytest.raises(CaptureError):
            parse_groups(bad)


def test_every_keeps_the_multiples_the_first_and_the_last_step(tmp_path):
    run = tmp_path / "run"
    writer = _train(run, 11, every=5, last_step=11)
    assert sorted(int(p.stem.split("_")[1]) for p in (run / "batches").glob("step_*.parquet")) == [1, 5, 10, 11]
    lines = _lines(run)
    assert sorted(lines) == list(range(1, 12))  # metrics of every step, always
    for step, data in lines.items():
        kept = step in (1, 5, 10, 11)
        assert data["rldiag/capture/rows"] == (ROWS if kept else 0)
        size = (run / "batches" / f"step_{step:06d}.parquet").stat().st_size if kept else 0
        assert data["rldiag/capture/bytes"] == size
    assert writer.skipped(2) and not writer.skipped(5) and writer.stats.dropped_steps == 0
    saved = yaml.safe_load((run / "run.yaml").read_text())
    assert saved["rldiag"]["capture"] == {"every": 5, "groups": None, "max_gb": None, "seed": 7}


def test_without_a_known_last_step_the_step_closed_on_is_written(tmp_path):
    run = tmp_path / "run"
    _train(run, 7, every=5)
    steps = sorted(int(p.stem.split("_")[1]) for p in (run / "batches").glob("step_*.parquet"))
    assert steps == [1, 5, 7]
    table = pq.read_table(run / "batches" / "step_000007.parquet")
    assert table["row_id"].to_pylist() == list(range(ROWS))


def test_groups_keeps_whole_groups_drawn_from_the_seed_and_step(tmp_path):
    run = tmp_path / "run"
    _train(run, 3, groups=0.25)
    for step in (1, 2, 3):
        table = pq.read_table(run / "batches" / f"step_{step:06d}.parquet")
        uid = table["uid"].to_pylist()
        assert len(set(uid)) == 2 and len(uid) == 4  # 2 of 8 groups, every row of each
        rows = table["row_id"].to_pylist()
        full = _batch(step)
        # each kept row's tokens are the batch's own
        keep, total, kept = CapturePolicy(groups=0.25, seed=7).keep_groups(full["uid"], step)
        assert (total, kept) == (8, 2) and rows == np.flatnonzero(keep).tolist()
        lengths = full["response_mask"].sum(1).numpy()
        got = table["old_log_probs"].to_pylist()
        for r, values in zip(rows, got):
            want = full["old_log_probs"][r, : lengths[r]].numpy()
            np.testing.assert_array_equal(np.asarray(values, dtype=np.float32), want)
        record = read_record(table.schema.metadata)
        assert record == {"policy": {"every": 1, "groups": 0.25, "max_gb": None, "seed": 7}, "groups": 8,
                          "groups_kept": 2, "rows": ROWS, "rows_kept": 4}
        assert _lines(run)[step]["rldiag/capture/rows"] == 4
    # another seed draws other groups on some step
    draws = {s: CapturePolicy(groups=2, seed=s).keep_groups(_batch(1)["uid"], 1)[0].tolist() for s in range(6)}
    assert len({tuple(v) for v in draws.values()}) > 1


def test_max_gb_stops_batches_once_warned_and_counts_a_resumed_runs_files(tmp_path):
    run = tmp_path / "run"
    _train(run, 2)
    on_disk = sum(p.stat().st_size for p in (run / "batches").glob("step_*.parquet"))
    limit = (on_disk + 1) / 1e9  # the next step's file passes it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RunWriter(run, max_gb=limit, max_wait_s=60.0, wait_share=None) as writer:
            for step in range(3, 7):
                writer.write_batch(step, _batch(step))
                writer.log_metrics(step, {"loss": 0.0})
                writer.sync()
    budget = [w for w in caught if issubclass(w.category, CaptureWarning) and "max_gb" in str(w.message)]
    assert len(budget) == 1
    assert (run / "batches" / "step_000003.parquet").exists()
    assert not any((run / "batches" / f"step_{s:06d}.parquet").exists() for s in (4, 5, 6))
    lines = _lines(run)
    assert "rldiag/capture/stopped_at_step" not in lines[3]
    assert [lines[s]["rldiag/capture/stopped_at_step"] for s in (4, 5, 6)] == [4, 4, 4]
    assert [lines[s]["rldiag/capture/rows"] for s in (3, 4, 5, 6)] == [ROWS, 0, 0, 0]
    assert writer.stats.dropped_steps == 0 and writer.stats.errors == 0


def test_without_a_policy_the_lines_and_files_are_as_before(tmp_path):
    run = tmp_path / "run"
    _train(run, 2)
    assert _lines(run)[1] == {"loss": 1.0}
    assert read_record(pq.read_schema(run / "batches" / "step_000001.parquet").metadata) is None


def test_a_large_run_seed_is_kept_modulo_2_31_and_recorded_as_a_valid_setting(tmp_path):
    from rldiag.config.settings import resolve_settings

    run = tmp_path / "run"
    with RunWriter(run, config={"data": {"seed": 2**40 + 5}}, groups=2) as writer:
        writer.write_batch(1, _batch(1))
    assert writer.policy.seed == 5
    settings = resolve_settings(run)  # the recorded policy reads back as settings
    assert (settings["rldiag.capture.seed"], settings["rldiag.capture.groups"], settings["rldiag.capture.every"]) == (
        5, 2.0, 1)
    with pytest.raises(CaptureError):
        CapturePolicy(seed=-1)
