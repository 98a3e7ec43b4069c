"""Every writer of a run directory goes through the staged writer (rldiag.io.staged), and a write
interrupted part way leaves the previous state, on local disk and in an object store: a
recompute's scenario, a compare's comparison, the capture's step files (which a trainer writes
on local disk: an object store cannot take its metrics appends). The W&B import's are in
tests/importers (test_wandb_online, test_import_object_store)."""

from __future__ import annotations

import importlib
import uuid
from pathlib import Path

import pytest
import torch

import rldiag.analysis.compare as compare_mod
import rldiag.capture.table as table_mod
from rldiag.analysis.compare import compare
from rldiag.capture import RunWriter
from rldiag.capture.faults import CaptureWarning
from rldiag.errors import CaptureError, OutputError
from rldiag.io.fs import RemotePath, as_path
from rldiag.io.outputs import read_scenario
from rldiag.io.run_layout import RunLayout
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run

#: the scenario writer's module (it writes metrics.parquet after every step's tables are staged)
write_mod = importlib.import_module("rldiag.scenario.write")


@pytest.fixture(params=["local", "store"])
def run(request, tmp_path):
    local = write_synth_run(tmp_path / "run", SynthSpec(steps=3, seed=5))
    if request.param == "local":
        return local
    s3 = request.getfixturevalue("s3")
    return s3.upload_dir(local, f"runs/{uuid.uuid4().hex[:8]}")


def snapshot(d) -> dict[str, bytes]:
    d = as_path(d)
    if isinstance(d, RemotePath):
        return {str(p.relative_to(d)): p.read_bytes() for p in d.files()}
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def boom(*a, **kw):
    raise OutputError("interrupted")


def test_an_interrupted_recompute_leaves_the_previous_scenario(run, monkeypatch):
    recompute(run, name="s", save_tokens=True, device="cpu")
    sc = RunLayout(run).scenario("s")
    before = snapshot(sc.dir)
    # metrics, scenario.json, and per step its per-row table and its tokens
    assert {"metrics.parquet", "scenario.json"} <= set(before) and len(before) == 2 + 2 * 3
    monkeypatch.setattr(write_mod, "metrics_table", boom)  # after every step's tokens are staged
    with pytest.raises(OutputError, match="interrupted"):
        recompute(run, name="s", save_tokens=True, reuse=False, device="cpu")
    assert snapshot(sc.dir) == before
    assert read_scenario(run, "s")[0]["steps_done"] == [1, 2, 3]
    if isinstance(sc.dir, Path):
        assert not [p for p in sc.dir.parent.iterdir() if p.name.startswith(".")]  # no staging left


def test_an_interrupted_compare_leaves_the_previous_comparison(run, monkeypatch):
    recompute(run, name="a", save_tokens=True, device="cpu")
    recompute(run, {"algorithm.norm_adv_by_std_in_grpo": False}, name="b", save_tokens=True, device="cpu")
    compare(run, "a", "b", device="cpu")
    target = RunLayout(run).comparison("a", "b")
    before = snapshot(target.dir)
    assert sorted(before) == ["comparison.json", "groups.parquet", "metrics.parquet", "tokens.parquet"]
    real = compare_mod.open_staged

    def failing(*args, **kwargs):
        writer = real(*args, **kwargs)
        write_table = writer.write_table

        def write(rel, table, **kw):
            if rel == target.GROUPS:
                raise OutputError("interrupted")
            write_table(rel, table, **kw)

        writer.write_table = write  # type: ignore[method-assign]
        return writer

    monkeypatch.setattr(compare_mod, "open_staged", failing)
    with pytest.raises(OutputError, match="interrupted"):
        compare(run, "a", "b", steps="1", device="cpu")
    assert snapshot(target.dir) == before


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (4,), generator=g)
    attn = (torch.arange(5)[None, :] < lengths[:, None]).long()
    return {"response_mask": attn, "attention_mask": attn, "token_level_scores": torch.rand(4, 5, generator=g),
            "old_log_probs": -torch.rand(4, 5, generator=g), "uid": [f"u{i // 2}" for i in range(4)]}


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_an_interrupted_step_write_of_the_capture_leaves_the_previous_file(tmp_path, monkeypatch, on_error):
    """A write that fails half way leaves the previous file whole, whether the writer raises the
    error (``on_error="raise"``) or warns and goes on (the default, as inside a trainer)."""
    with RunWriter(tmp_path) as w:
        w.write_batch(1, _batch(1))
        w.log_metrics(1, {"x": 1.0})
    before = snapshot(tmp_path)
    real = table_mod.pq.write_table

    def half_then_fail(table, where, **kw):
        real(table, where, **kw)
        raise OSError("disk full")

    monkeypatch.setattr(table_mod.pq, "write_table", half_then_fail)
    with pytest.warns(UserWarning, match="written by an earlier run"):  # a resumed run writes step 1 again
        w = RunWriter(tmp_path, on_error=on_error)
        w.write_batch(1, _batch(2))
    if on_error == "raise":
        with pytest.raises(CaptureError, match="disk full"):
            w.close()
    else:
        with pytest.warns(CaptureWarning, match="disk full"):
            w.close()
    assert snapshot(tmp_path) == before  # step 1's file whole, no temporary name left


def test_the_capture_writes_local_disk_only():
    with pytest.raises(CaptureError, match="cannot append to metrics.jsonl"):
        RunWriter("s3://bucket/run")
