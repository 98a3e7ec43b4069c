"""The capture's tensor code runs on the trainer's device: tensors arrive on the trainer's GPU, so
every tensor the capture makes is on its input's device (a CPU tensor mixed with CUDA ones
fails). Checked without a GPU as tests/engine/test_device_placement.py does: the capture runs
under torch's default-device context ``torch.device("meta")`` on CPU inputs, so a tensor made
without a device is a meta tensor and mixing it with the inputs raises."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from rldiag.capture import RunWriter
from rldiag.capture.unpad import unpad_batch
from rldiag.config.settings import resolve_settings
from rldiag.engine.requirements import recompute_columns
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir
from tests.capture.test_writer import LENGTHS, MASK, _dataproto, _padded

META = torch.device("meta")


def test_unpad_under_the_meta_default(tmp_path):
    batch = _dataproto()
    batch.batch["loss_mask"] = MASK.clone()
    with torch.device(META):
        payload = unpad_batch(batch, 1, tmp_path / "step_000001.parquet", extra_columns=["data_source"],
                              token_ids=True)
    assert payload.lengths.tolist() == LENGTHS
    assert payload.rows["prompt_length"].tolist() == [3, 2, 1]


@pytest.mark.parametrize("width", [6, 0])
def test_unpad_without_attention_mask_under_the_meta_default(tmp_path, width):
    """Rows end at their last sampled token (a response width of 0: no tokens at all)."""
    mask = MASK[:, :width]
    scores = _padded()["rm_scores"][:, :width]
    with torch.device(META):
        payload = unpad_batch({"response_mask": mask, "token_level_scores": scores, "uid": ["a", "b", "c"]},
                              1, tmp_path / "step_000001.parquet")
    assert payload.lengths.tolist() == ([6, 3, 2] if width else [0, 0, 0])


def test_run_writer_under_the_meta_default(tmp_path):
    """The training thread's part of the writer (``write_batch``, ``log_metrics``) under the meta
    default; the file it writes loads back."""
    batch = _dataproto()
    with RunWriter(tmp_path, config={"algorithm": {"adv_estimator": "grpo"}}) as run:
        with torch.device(META):
            run.write_batch(1, batch)
            run.log_metrics(1, {"actor/pg_clipfrac": torch.tensor(0.25, device="cpu")})
    (sf,) = RunDir(tmp_path).step_files()
    settings = resolve_settings(tmp_path)
    assert load_step(sf, settings, recompute_columns(settings)).batch.lengths.tolist() == LENGTHS


def _verl_capture(tmp_path):
    pytest.importorskip("verl")
    import rldiag.capture.verl as capture

    cap = capture.VerlCapture(tmp_path)
    cap.writer = RunWriter(tmp_path)
    cap.trainer = SimpleNamespace(global_steps=1)
    return cap


def test_verl_legacy_capture_under_the_meta_default(tmp_path):
    cap = _verl_capture(tmp_path)
    batch = _dataproto()
    with torch.device(META):
        cap.keep_mask_before_correction(batch)
        batch.batch["response_mask"] = MASK * torch.tensor([1, 0, 1, 1, 1, 1], device="cpu")  # a rejected token
        cap.capture_dataproto(batch)
    cap.finish()
    table = pq.read_table(tmp_path / "batches" / "step_000001.parquet").to_pydict()
    assert table["loss_mask"] == [MASK[i, :n].tolist() for i, n in enumerate(LENGTHS)]


def test_verl_v1_capture_under_the_meta_default(tmp_path, monkeypatch):
    from tests.capture import verl_steps

    verl_steps.import_v1(monkeypatch)  # skips where verl's V1 trainer does not import
    cap = _verl_capture(tmp_path)
    tq = verl_steps.FakeTQ()
    meta = verl_steps.v1_rows(tq, step=1, part=0, rows=8, n=4, padding=1)
    cap._pre_mask = torch.ones(8, verl_steps.R, dtype=torch.long)
    with torch.device(META):
        cap.capture_v1(tq, meta)
    cap.finish()
    table = pq.read_table(tmp_path / "batches" / "step_000001.parquet")
    assert table.num_rows == 7  # the padding row dropped
    assert np.concatenate(table["loss_mask"].to_numpy(zero_copy_only=False)).all()
