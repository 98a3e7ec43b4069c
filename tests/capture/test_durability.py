"""Nothing captured is lost: repeated writes of a step are kept as parts, each step is on disk
when its barrier returns (a SIGKILL loses at most the step in flight), a torn metrics line is
never merged with the next one, and token text is optional."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rldiag.capture import RunWriter
from rldiag.config.settings import resolve_settings
from rldiag.engine.requirements import recompute_columns
from rldiag.errors import CaptureError, MissingInputError
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir, iter_metrics_lines

GRPO = resolve_settings(overrides={"algorithm.adv_estimator": "grpo"})


def _batch(rows: int, width: int = 5, seed: int = 0, uid_prefix: str = "u") -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    attn = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return {"response_mask": attn, "attention_mask": attn, "token_level_scores": torch.rand(rows, width, generator=g),
            "old_log_probs": -torch.rand(rows, width, generator=g),
            "responses": torch.randint(0, 50, (rows, width), generator=g),
            "uid": [f"{uid_prefix}{i // 2}" for i in range(rows)]}


def test_separate_async_parts_are_all_kept_and_load_as_one_batch_in_order(tmp_path):
    parts = [_batch(4, seed=s, uid_prefix=f"s{s}-") for s in range(4)]  # parameter_sync_step = 4
    with RunWriter(tmp_path) as run:
        assert [run.write_batch(7, b) for b in parts] == [0, 1, 2, 3]
        run.write_batch(8, _batch(4, seed=9))
        assert run.parts(7) == 4 and run.parts(8) == 1 and run.parts(9) == 0
    assert run.stats.steps == 2 and run.stats.parts == 5
    files = RunDir(tmp_path).step_files()
    assert [sf.step for sf in files] == [7, 8]
    table = pq.read_table(files[0].path)
    assert table["part"].to_pylist() == [k for k in range(4) for _ in range(4)]
    assert "part" not in pq.read_table(files[1].path).column_names  # a one-write step stays plain
    step = load_step(files[0], GRPO, recompute_columns(GRPO))
    assert step.n_rows == 16
    expected = torch.cat([b["old_log_probs"] * b["response_mask"] for b in parts])
    got = step.batch.rows.pad(step.batch.old_log_probs, expected.shape[1])  # flat (tokens,) -> (rows, R)
    assert torch.equal(got, expected)
    assert step.uids.to_pylist() == [u for b in parts for u in b["uid"]]


def test_a_part_with_other_fields_is_refused_loudly(tmp_path):
    run = RunWriter(tmp_path, on_error="raise")
    run.write_batch(1, _batch(4, seed=1))
    other = _batch(4, seed=2)
    other["ref_log_prob"] = -torch.rand(4, 5)
    run.write_batch(1, other)
    with pytest.raises(CaptureError, match=r"step 1 part 1.*differing: ref_log_prob"):
        run.close()
    assert pq.read_table(tmp_path / "batches" / "step_000001.parquet").num_rows == 4  # part 0 intact


def test_a_step_left_by_an_earlier_run_is_replaced_with_a_warning(tmp_path):
    with RunWriter(tmp_path) as run:
        run.write_batch(3, _batch(4, seed=1))
    with pytest.warns(UserWarning, match="step 3 is written again"), RunWriter(tmp_path) as run:
        run.write_batch(3, _batch(6, seed=2))
    assert run.stats.replaced_steps == 1
    assert pq.read_table(tmp_path / "batches" / "step_000003.parquet").num_rows == 6


def test_a_resumed_writer_ends_a_torn_metrics_line_instead_of_merging_it(tmp_path):
    good = json.dumps({"step": 1, "data": {"x": 1.0}})
    (tmp_path / "metrics.jsonl").write_text(good + "\n" + '{"step": 2, "data": {"x": 2.')  # killed mid-line
    with RunWriter(tmp_path) as run:
        run.log_metrics(2, {"x": 2.5})
        run.log_metrics(3, {"x": 3.0})
    lines = (tmp_path / "metrics.jsonl").read_text().split("\n")
    assert lines == [good, '{"step": 2, "data": {"x": 2.', json.dumps({"step": 2, "data": {"x": 2.5}}),
                     json.dumps({"step": 3, "data": {"x": 3.0}}), ""]
    assert list(iter_metrics_lines(tmp_path / "metrics.jsonl")) == [(1, {"x": 1.0}), (2, {"x": 2.5}), (3, {"x": 3.0})]


def test_a_whole_last_record_missing_only_its_newline_is_kept(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {"x": 1.0}}))
    with RunWriter(tmp_path) as run:
        run.log_metrics(2, {"x": 2.0})
    assert [s for s, _ in iter_metrics_lines(tmp_path / "metrics.jsonl")] == [1, 2]


_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_durability import _batch
    from rldiag.capture import RunWriter
    run = RunWriter({run!r}, queue_size=4, max_wait_s=600, wait_share=None)  # the barrier waits for the disk
    for step in (1, 2, 3):
        run.write_batch(step, _batch(4, seed=step))
        run.log_metrics(step, {{"x": float(step)}})
        run.sync()
        print("done", step, flush=True)
    run.write_batch(4, _batch(4, seed=4))          # the step in flight: queued, no barrier yet
    run.log_metrics(4, {{"x": 4.0}})
    print("in flight", 4, flush=True)
    sys.stdin.read()                                # wait here until killed
""")


def test_a_trainer_killed_by_sigkill_loses_at_most_the_step_in_flight(tmp_path):
    run_dir = tmp_path / "run"
    code = _CHILD.format(tests=os.path.dirname(__file__), run=str(run_dir))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stdout:  # synchronised on the child's own messages, not on time
            seen.append(line.strip())
            if line.startswith("in flight"):
                break
        assert seen == ["done 1", "done 2", "done 3", "in flight 4"]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    steps = {sf.step: sf for sf in RunDir(run_dir).step_files()}
    assert {1, 2, 3} <= set(steps) <= {1, 2, 3, 4}
    for step in (1, 2, 3):
        assert load_step(steps[step], GRPO, recompute_columns(GRPO)).n_rows == 4
    logged = [s for s, _ in iter_metrics_lines(run_dir / "metrics.jsonl")]
    assert logged[:3] == [1, 2, 3] and set(logged) <= {1, 2, 3, 4}


class _Vocab:
    """A tokenizer with the one method the writer uses (Hugging Face's name)."""

    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]


class _DecodeOnly:
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("tokenizer,text", [(_Vocab(), lambda i: f"t{i}"), (_DecodeOnly(), lambda i: chr(97 + i % 26))])
def test_token_text_is_stored_per_response_token(tmp_path, tokenizer, text):
    batch = _batch(4, seed=3)
    with RunWriter(tmp_path, tokenizer=tokenizer) as run:
        run.write_batch(1, batch)
    table = pq.read_table(tmp_path / "batches" / "step_000001.parquet")
    lengths = batch["attention_mask"].sum(-1).tolist()
    expected = [[text(int(i)) for i in batch["responses"][r, :n]] for r, n in enumerate(lengths)]
    assert table["response_tokens"].to_pylist() == expected
    field_type = table.schema.field("response_tokens").type
    assert pa.types.is_list(field_type) and pa.types.is_string(field_type.value_type)


def test_token_text_needs_the_response_ids(tmp_path):
    batch = _batch(2)
    del batch["responses"]
    run = RunWriter(tmp_path, tokenizer=_Vocab(), on_error="raise")
    with pytest.raises(MissingInputError, match="responses"):
        run.write_batch(1, batch)
    run.close()
