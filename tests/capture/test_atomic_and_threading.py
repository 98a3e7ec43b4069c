"""Batch files appear whole or not at all; the writer thread is bounded and off the training thread."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import rldiag.capture.diskio as diskio_mod
import rldiag.capture.table as table_mod
from rldiag.capture import RunWriter, unpad_batch, write_step_file
from rldiag.errors import CaptureError
from rldiag.io.rundir import STEP_FILE, RunDir


def _batch(rows: int = 4, width: int = 5, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    attn = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return {"response_mask": attn, "attention_mask": attn, "token_level_scores": torch.rand(rows, width, generator=g),
            "old_log_probs": -torch.rand(rows, width, generator=g), "uid": [f"u{i // 2}" for i in range(rows)]}


def test_no_partial_file_is_ever_visible(tmp_path, monkeypatch):
    """While the Parquet bytes are being written, only a hidden temporary name exists; a failure
    in the middle leaves nothing behind."""
    seen = {}
    real = pq.write_table

    def slow_then_fail(table, where, **kw):
        real(table, where, **kw)
        seen["tmp"] = where
        seen["final_exists"] = (tmp_path / "batches" / "step_000003.parquet").exists()
        seen["listing"] = sorted(p.name for p in (tmp_path / "batches").iterdir())
        raise OSError("disk full")

    monkeypatch.setattr(table_mod.pq, "write_table", slow_then_fail)
    payload = unpad_batch(_batch(), 3, tmp_path / "batches" / "step_000003.parquet")
    with pytest.raises(OSError, match="disk full"):
        write_step_file(payload)
    assert seen["final_exists"] is False
    assert seen["tmp"].name.startswith(".step_000003.parquet.") and seen["tmp"].name.endswith(".tmp")
    assert not any(STEP_FILE.match(n) for n in seen["listing"])  # readers never pick the temp name
    assert list((tmp_path / "batches").iterdir()) == []  # the temp file is cleaned up
    assert RunDir(tmp_path).step_files() == []


def test_a_step_written_twice_keeps_both_parts_in_one_file(tmp_path):
    with RunWriter(tmp_path) as run:
        assert run.write_batch(1, _batch(rows=4, seed=1)) == 0
        run.flush()
        assert run.write_batch(1, _batch(rows=6, seed=2)) == 1
    table = pq.read_table(tmp_path / "batches" / "step_000001.parquet")
    assert table.num_rows == 10 and table["part"].to_pylist() == [0] * 4 + [1] * 6
    assert [p.name for p in (tmp_path / "batches").iterdir()] == ["step_000001.parquet"]


def test_files_are_written_on_the_writer_thread_in_call_order(tmp_path, monkeypatch):
    threads, order = [], []
    real = diskio_mod.write_step_file

    def record(payload, compression, token_text=None):
        threads.append(threading.current_thread().name)
        order.append(payload.step)
        return real(payload, compression, token_text)

    monkeypatch.setattr(diskio_mod, "write_step_file", record)
    with RunWriter(tmp_path) as run:
        for step in (3, 1, 2):
            run.write_batch(step, _batch(seed=step))
            run.log_metrics(step, {"x": float(step)})
    assert set(threads) == {"rldiag-capture-writer"} and order == [3, 1, 2]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [3, 1, 2]


def test_the_queue_is_bounded_and_the_trainer_waits_for_a_slow_disk(tmp_path, monkeypatch):
    """With the writer thread held on step 1 and the queue (2 slots) full, the trainer's next
    write_batch waits: when the trainer is about to write step 4, exactly steps 1-3 have been
    handed over, and step 4 is handed over only once the disk moves again."""
    real = diskio_mod.write_step_file
    about_to_write_4 = threading.Event()
    returned: list[int] = []
    seen_when_released: list[list[int]] = []

    def slow(payload, compression, token_text=None):
        if payload.step == 1:
            about_to_write_4.wait()
            seen_when_released.append(list(returned))
        return real(payload, compression, token_text)

    monkeypatch.setattr(diskio_mod, "write_step_file", slow)
    run = RunWriter(tmp_path, queue_size=2, on_error="raise")

    def trainer():
        for step in range(1, 9):
            if step == 4:
                about_to_write_4.set()
            run.write_batch(step, _batch(seed=step))
            returned.append(step)

    t = threading.Thread(target=trainer)
    t.start()
    t.join()
    run.close()
    assert seen_when_released == [[1, 2, 3]]  # 1 on the writer thread, 2 and 3 queued, 4 waiting
    assert run.stats.max_queue <= 2 and run.stats.steps == 8
    assert [sf.step for sf in RunDir(tmp_path).step_files()] == list(range(1, 9))


def test_a_writer_failure_is_reported_once_then_writing_goes_on(tmp_path, monkeypatch):
    real = diskio_mod.write_step_file

    def flaky(payload, compression, token_text=None):
        if payload.step == 2:
            raise OSError("no space left on device")
        return real(payload, compression, token_text)

    monkeypatch.setattr(diskio_mod, "write_step_file", flaky)
    run = RunWriter(tmp_path, on_error="raise")
    run.write_batch(1, _batch())
    run.write_batch(2, _batch())
    with pytest.raises(CaptureError, match="step 2: OSError: no space left"):
        run.flush()
    run.write_batch(3, _batch())
    run.close()  # nothing further failed: no error
    assert [sf.step for sf in RunDir(tmp_path).step_files()] == [1, 3]


def test_unpadding_many_short_rows_keeps_each_rows_tokens(tmp_path):
    """100k rows, 12 columns: one gather per column (its speed is measured by
    rldiag/toy/capture_cost.py, not here); every row's tokens come out in order."""
    rows, width = 100_000, 16
    lengths = torch.randint(1, width + 1, (rows,), generator=torch.Generator().manual_seed(0))
    attn = (torch.arange(width)[None, :] < lengths[:, None]).long()
    batch = {"response_mask": attn, "attention_mask": attn, "uid": np.arange(rows).astype(str)}
    for name in ("token_level_scores", "old_log_probs", "log_probs", "ref_log_prob", "rollout_log_probs", "values",
                 "vpreds", "entropy", "token_level_rewards", "advantages", "returns"):
        batch[name] = torch.randn(rows, width)
    payload = unpad_batch(batch, 1, tmp_path / "step_1.parquet")
    flat = payload.tokens["old_log_probs"]
    assert flat.shape == (int(lengths.sum()),)
    ends = torch.cumsum(lengths, 0)
    for r in (0, 1, rows // 2, rows - 1):
        n = int(lengths[r])
        assert torch.equal(torch.as_tensor(flat[int(ends[r]) - n:int(ends[r])]), batch["old_log_probs"][r, :n])


@pytest.mark.slow
def test_a_writer_left_open_is_flushed_at_interpreter_exit(tmp_path):
    script = (
        "import sys, torch\n"
        "from rldiag.capture import RunWriter\n"
        "w = RunWriter(sys.argv[1])\n"
        "m = torch.ones(2, 3, dtype=torch.long)\n"
        "for s in range(1, 4):\n"
        "    w.write_batch(s, {'response_mask': m, 'token_level_scores': torch.zeros(2, 3), 'uid': ['a', 'b']})\n"
        "nan = torch.full((2, 3), float('nan'))\n"
        "w.write_batch(4, {'response_mask': m, 'token_level_scores': nan, 'uid': ['a', 'b']})\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [sf.step for sf in RunDir(tmp_path).step_files()] == [1, 2, 3]
    assert "step 4" in out.stderr and "token_level_scores" in out.stderr
