"""The batch files' Parquet layouts (rldiag.capture.table.LAYOUTS) are lossless: the same batch
written under each loads to the same tensors and recomputes to the same bits."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rldiag.capture.table import LAYOUTS, SPLIT_FLOAT_COLUMNS, parquet_options, write_step_file
from rldiag.capture.unpad import unpad_batch
from rldiag.config.settings import resolve_settings
from rldiag.engine.pipeline import initial_kl_state, recompute_batch
from rldiag.engine.requirements import recompute_columns
from rldiag.errors import CaptureError
from rldiag.io.loader import load_step
from rldiag.io.rundir import StepFile


def _batch(rows: int = 24, width: int = 48, vocab: int = 64, seed: int = 0) -> dict:
    """A padded GRPO step with log-probs of sampled tokens from a real softmax (bf16 logits)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    lengths = torch.from_numpy(rng.integers(1, width + 1, rows))
    live = torch.arange(width).expand(rows, width) < lengths[:, None]
    z = (torch.randn(rows, width, vocab, generator=gen) * 3).to(torch.bfloat16).float()
    tok = torch.multinomial(torch.softmax(z, -1).view(-1, vocab), 1, generator=gen).view(rows, width, 1)

    def lp(logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, -1).gather(2, tok).squeeze(2) * live

    mask = live & (torch.rand(rows, width, generator=gen) > 0.1)
    score = torch.zeros(rows, width)
    score[torch.arange(rows), lengths - 1] = torch.from_numpy(rng.integers(0, 2, rows).astype(np.float32))
    return {
        "response_mask": mask.long(), "attention_mask": live.long(), "responses": tok.squeeze(2),
        "old_log_probs": lp(z), "rollout_log_probs": lp((z + 1e-3 * torch.randn(z.shape, generator=gen)).bfloat16().float()),
        "ref_log_prob": lp(z + 0.05 * torch.randn(z.shape, generator=gen)), "token_level_scores": score,
        "values": torch.randn(rows, width, generator=gen) * live,
        "uid": np.array([f"p{i // 4}" for i in range(rows)], dtype=object),
    }


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "legacy"])
def test_every_layout_loads_and_recomputes_to_the_legacy_files_bits(tmp_path, layout):
    batch = _batch()
    settings = resolve_settings(None, {"algorithm.adv_estimator": "grpo"})
    results, tables = [], []
    for name in ("legacy", layout):
        path = tmp_path / name / "step_1.parquet"
        path.parent.mkdir()
        write_step_file(unpad_batch(batch, 1, path), layout=name)
        tables.append(pq.read_table(path))
        loaded = load_step(StepFile(1, path), settings, recompute_columns(settings)).batch
        results.append(recompute_batch(loaded, settings, initial_kl_state(settings)))
    assert tables[0].equals(tables[1])
    old, new = results
    assert "rldiag/mismatch/gap_abs_p99" in old.metrics  # the log-prob columns were read and used
    for got, want in ((new.metrics, old.metrics), (new.tokens, old.tokens), (new.rows, old.rows)):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype, k
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, equal_nan=True, msg=k)


def test_the_tuned_layout_splits_the_log_prob_bytes_and_keeps_dictionaries_elsewhere(tmp_path):
    path = tmp_path / "step_1.parquet"
    write_step_file(unpad_batch(_batch(), 1, path))  # the default layout
    md = pq.ParquetFile(path).metadata.row_group(0)
    enc = {md.column(i).path_in_schema.split(".")[0]: md.column(i).encodings for i in range(md.num_columns)}
    for name in ("old_log_probs", "rollout_log_probs", "ref_log_prob", "values"):
        assert name in SPLIT_FLOAT_COLUMNS and "BYTE_STREAM_SPLIT" in enc[name], (name, enc[name])
    for name in ("uid", "response_mask", "token_level_scores"):
        assert "RLE_DICTIONARY" in enc[name], (name, enc[name])


def test_an_unknown_layout_is_refused():
    with pytest.raises(CaptureError, match="unknown Parquet layout 'fast'"):
        parquet_options(pa.table({"x": [1.0]}), layout="fast")
