"""rldiag.capture: what it writes loads back through rldiag.io.loader, as the trainer had it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from rldiag.capture import RunWriter
from rldiag.config.settings import resolve_settings
from rldiag.engine.requirements import recompute_columns
from rldiag.errors import BatchError, CaptureError, MissingInputError
from rldiag.io.loader import load_step, read_table
from rldiag.io.rundir import RunDir, iter_metrics_lines
from tests.engine.packing import to_packed

# Two prompts left-padded to width 3, responses right-padded to width 6.
# Row 0: a, CALL, obs, obs, b, EOS  (tool tokens at 2, 3), full width.
# Row 1: a, b, EOS then padding; prompt of 2 tokens.
# Row 2: a, CALL, obs (truncated inside the observation: the row ends with a mask-0 token).
ATTN = torch.tensor([
    [1, 1, 1, 1, 1, 1, 1, 1, 1],
    [0, 1, 1, 1, 1, 1, 0, 0, 0],
    [0, 0, 1, 1, 1, 1, 0, 0, 0],
])
MASK = torch.tensor([
    [1, 1, 0, 0, 1, 1],
    [1, 1, 1, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
])
LENGTHS = [6, 3, 3]


def _padded(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    valid = ATTN[:, 3:].bool()
    out = {}
    for name in ("old_log_probs", "ref_log_prob", "rollout_log_probs", "values", "advantages", "entropys"):
        t = -torch.rand((3, 6), generator=g)
        out[name] = torch.where(valid, t, torch.full_like(t, 99.0))  # garbage in the padding
    scores = torch.zeros(3, 6)
    scores[0, 5], scores[1, 2], scores[2, 2] = 1.0, 0.5, 0.0
    out["rm_scores"] = scores
    return out


def _dataproto(seed: int = 0) -> SimpleNamespace:
    tensors = dict(_padded(seed), attention_mask=ATTN, response_mask=MASK,
                   responses=torch.zeros(3, 6, dtype=torch.long), prompts=torch.zeros(3, 3, dtype=torch.long))
    non = {"uid": np.array(["p0", "p1", "p1"], dtype=object), "acc": np.array([1.0, 0.0, 0.0]),
           "data_source": np.array(["toy"] * 3, dtype=object), "note": np.array(["a", "b", "c"], dtype=object)}
    return SimpleNamespace(batch=tensors, non_tensor_batch=non, meta_info={})


def _unpadded(t: torch.Tensor) -> list[list[float]]:
    return [t[i, :n].tolist() for i, n in enumerate(LENGTHS)]


def test_dataproto_roundtrip_through_the_loader(tmp_path):
    batch = _dataproto()
    with RunWriter(tmp_path, config={"algorithm": {"adv_estimator": "grpo"}}) as run:
        run.write_batch(7, batch)
    (sf,) = RunDir(tmp_path).step_files()
    assert sf.step == 7 and sf.path.name == "step_000007.parquet"
    table = read_table(sf).to_pydict()
    assert table["step"] == [7, 7, 7]
    assert table["uid"] == ["p0", "p1", "p1"]
    assert table["prompt_length"] == [3, 2, 1]  # from the prompt part of attention_mask
    assert table["acc"] == [1.0, 0.0, 0.0]  # a numeric per-row field rides along
    assert "note" not in table  # strings only when asked for
    assert table["data_source"] == ["toy"] * 3  # but a reward function's input is always kept
    assert table["response_mask"] == _unpadded(MASK)  # tool tokens kept, with mask 0
    assert [len(x) for x in table["old_log_probs"]] == LENGTHS
    for col, src in (("token_level_scores", "rm_scores"), ("old_log_probs", "old_log_probs"),
                     ("entropy", "entropys"), ("values", "values")):
        np.testing.assert_allclose(np.concatenate(table[col]), np.concatenate(_unpadded(batch.batch[src])), rtol=0)
    settings = resolve_settings(tmp_path)
    step = load_step(sf, settings, recompute_columns(settings))
    assert step.batch.lengths.tolist() == LENGTHS
    # the loader's packed layout: each row's first LENGTHS[i] tokens, one row after another
    assert torch.equal(step.batch.response_mask, to_packed(MASK.float(), LENGTHS)[0])
    want_old = torch.where(ATTN[:, 3:].bool(), batch.batch["old_log_probs"], 0.0)
    assert torch.equal(step.batch.old_log_probs, to_packed(want_old, LENGTHS)[0])


def test_plain_mapping_with_response_attention_and_lists(tmp_path):
    b = _padded()
    batch = {"response_mask": MASK.numpy(), "attention_mask": ATTN[:, 3:], "token_level_scores": b["rm_scores"],
             "old_log_probs": b["old_log_probs"].numpy(), "uid": ["a", "b", "b"], "prompt_length": [4, 5, 6],
             "session": ["s0", "s1", "s2"]}
    with RunWriter(tmp_path, extra_columns=["session"]) as run:
        run.write_batch(1, batch)
    table = pq.read_table(tmp_path / "batches" / "step_000001.parquet").to_pydict()
    assert table["response_mask"] == _unpadded(MASK)
    assert table["prompt_length"] == [4, 5, 6] and table["session"] == ["s0", "s1", "s2"]


def test_without_attention_mask_rows_end_at_their_last_sampled_token(tmp_path):
    b = _padded()
    with RunWriter(tmp_path) as run:
        run.write_batch(1, {"response_mask": MASK, "token_level_scores": b["rm_scores"], "uid": ["a", "b", "c"]})
    table = pq.read_table(tmp_path / "batches" / "step_000001.parquet").to_pydict()
    assert [len(m) for m in table["response_mask"]] == [6, 3, 2]  # row 2's trailing observation is gone


def test_metrics_lines_are_verls_file_logger_form(tmp_path):
    with RunWriter(tmp_path) as run:
        run.log_metrics(1, {"actor/pg_clipfrac": torch.tensor(0.25), "critic/score/mean": np.float32(0.5), "n": 3})
        run.log_metrics(2, {"actor/pg_clipfrac": 0.125})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "data": {"actor/pg_clipfrac": 0.25, "critic/score/mean": 0.5, "n": 3}}
    assert [s for s, _ in iter_metrics_lines(tmp_path / "metrics.jsonl")] == [1, 2]


@dataclass
class _Optim:
    lr: float = 1e-3


@dataclass
class _Actor:
    clip_ratio: float = 0.2
    optim: _Optim = None


class _OmegaLike:
    """Duck-typed like an OmegaConf container: only ``to_container(resolve=...)``."""

    def to_container(self, resolve: bool = False):
        assert resolve
        return {"algorithm": {"adv_estimator": "gae", "lam": np.float64(0.95)}, "data": {"files": ("a", "b")}}


def test_config_goes_to_run_yaml_from_dicts_dataclasses_and_omegaconf_like(tmp_path):
    RunWriter(tmp_path / "a", config=_OmegaLike()).close()
    tree = yaml.safe_load((tmp_path / "a" / "run.yaml").read_text())
    assert tree == {"algorithm": {"adv_estimator": "gae", "lam": 0.95}, "data": {"files": ["a", "b"]}}
    assert resolve_settings(tmp_path / "a")["algorithm.lam"] == 0.95
    RunWriter(tmp_path / "b", config={"actor_rollout_ref": {"actor": _Actor(optim=_Optim())}}).close()
    tree = yaml.safe_load((tmp_path / "b" / "run.yaml").read_text())
    assert tree["actor_rollout_ref"]["actor"] == {"clip_ratio": 0.2, "optim": {"lr": 1e-3}}


def test_malformed_batches_fail_at_once_naming_row_and_column(tmp_path):
    b = _dataproto()
    with RunWriter(tmp_path, on_error="raise") as run:
        bad = _dataproto()
        bad.batch["response_mask"] = MASK.clone()
        bad.batch["response_mask"][1, 4] = 1  # inside the padding of row 1
        with pytest.raises(BatchError) as err:
            run.write_batch(3, bad)
        assert (err.value.step, err.value.row, err.value.column) == (3, 1, "response_mask")
        no_uid = SimpleNamespace(batch=b.batch, non_tensor_batch={})
        with pytest.raises(MissingInputError, match="uid"):
            run.write_batch(3, no_uid)
        short = _dataproto()
        short.batch["values"] = short.batch["values"][:, :4]
        with pytest.raises(BatchError, match="shape") as err:
            run.write_batch(3, short)
        assert err.value.column == "values"
    assert not (tmp_path / "batches" / "step_000003.parquet").exists()


def test_value_errors_surface_on_the_next_call_naming_step_row_column(tmp_path):
    run = RunWriter(tmp_path, on_error="raise")
    bad = _dataproto()
    bad.batch["ref_log_prob"] = bad.batch["ref_log_prob"].clone()
    bad.batch["ref_log_prob"][2, 1] = float("nan")
    run.write_batch(5, bad)
    with pytest.raises(CaptureError) as err:
        run.flush()
    msg = str(err.value)
    assert "step 5" in msg and "row 2" in msg and "'ref_log_prob'" in msg and "token 1" in msg
    (what, cause), = err.value.errors
    assert isinstance(cause, BatchError) and (cause.step, cause.row, cause.column) == (5, 2, "ref_log_prob")
    assert not (tmp_path / "batches" / "step_000005.parquet").exists()
    run.write_batch(6, _dataproto())  # the writer goes on after a failure
    run.close()
    assert [sf.step for sf in RunDir(tmp_path).step_files()] == [6]


def test_errors_are_never_lost_on_close(tmp_path):
    run = RunWriter(tmp_path, on_error="raise")
    bad = _dataproto()
    bad.batch["values"] = torch.full((3, 6), float("inf"))
    run.write_batch(1, bad)
    with pytest.raises(CaptureError, match="step 1"):
        run.close()
    with pytest.raises(CaptureError, match="closed"):
        run.write_batch(2, _dataproto())


def test_context_manager_does_not_hide_the_training_error(tmp_path):
    bad = _dataproto()
    bad.batch["values"] = torch.full((3, 6), float("nan"))
    with pytest.raises(KeyError):
        with RunWriter(tmp_path) as run:
            run.write_batch(1, bad)
            raise KeyError("training failed")


def test_the_writer_snapshot_is_taken_on_the_training_thread(tmp_path):
    batch = _dataproto()
    expected = _unpadded(batch.batch["old_log_probs"])
    with RunWriter(tmp_path) as run:
        run.write_batch(1, batch)
        batch.batch["old_log_probs"].fill_(-5.0)  # the trainer reuses its buffers at once
    table = pq.read_table(tmp_path / "batches" / "step_000001.parquet").to_pydict()
    np.testing.assert_allclose(np.concatenate(table["old_log_probs"]), np.concatenate(expected))


def test_a_mask_that_is_not_zero_or_one_is_refused_before_the_int8_cast(tmp_path):
    bad = _dataproto()
    bad.batch["response_mask"] = MASK.float()
    bad.batch["response_mask"][2, 1] = 0.5
    with RunWriter(tmp_path, on_error="raise") as run:
        with pytest.raises(BatchError) as err:
            run.write_batch(4, bad)
    assert (err.value.step, err.value.row, err.value.column) == (4, 2, "response_mask")


# ---- the rows' weight versions (verl's max_global_steps / min_global_steps) -----------------------


def _versioned(high, low) -> SimpleNamespace:
    """The batch with verl's per-row weight versions; a list as verl's agent loop leaves it (an
    object array in the non-tensor batch), an array or a tensor as it is."""
    batch = _dataproto()
    for key, values in (("max_global_steps", high), ("min_global_steps", low)):
        if values is not None:
            batch.non_tensor_batch[key] = np.array(values, dtype=object) if isinstance(values, list) else values
    return batch


def test_weight_versions_become_int64_policy_version_columns_that_load_back(tmp_path):
    with RunWriter(tmp_path) as run:
        run.write_batch(4, _versioned([3, 2, np.int64(3)], [3, 1, 2]))
    table = pq.read_table(tmp_path / "batches" / "step_000004.parquet")
    assert str(table.schema.field("policy_version").type) == "int64"
    assert str(table.schema.field("policy_version_min").type) == "int64"
    assert table["policy_version"].to_pylist() == [3, 2, 3] and table["policy_version_min"].to_pylist() == [3, 1, 2]
    assert "max_global_steps" not in table.column_names and "min_global_steps" not in table.column_names
    (sf,) = RunDir(tmp_path).step_files()
    step = load_step(sf, resolve_settings(tmp_path), ["uid", "response_mask", "token_level_scores", "policy_version"])
    assert step.batch.extra["policy_version"].tolist() == [3, 2, 3]


@pytest.mark.parametrize("high, low, written", [
    (None, None, set()),  # absent: no column
    ([3, None, 3], [3, 1, 2], {"policy_version_min"}),  # a row without a version: no column for the step
    ([None] * 3, [None] * 3, set()),  # a rollout server that reports none (verl's default extra fields)
    (np.array([3.0, np.nan, 3.0]), np.array([3.0, 1.0, 2.0]), {"policy_version_min"}),  # NaN: missing too
    (torch.tensor([3, 2, 3]), None, {"policy_version"}),
])
def test_a_weight_version_is_written_only_when_every_row_has_one(tmp_path, high, low, written):
    with RunWriter(tmp_path) as run:
        run.write_batch(1, _versioned(high, low))
    names = set(pq.read_table(tmp_path / "batches" / "step_000001.parquet").column_names)
    assert names & {"policy_version", "policy_version_min"} == written


@pytest.mark.parametrize("high, row, message", [
    ([3, 2.5, 3], 1, "value 2.5 is not a weight version"),
    ([3, "2", 3], None, "expected whole numbers"),
    (np.array([True, False, True]), None, "expected whole numbers"),
])
def test_a_weight_version_that_is_not_a_whole_number_is_refused(tmp_path, high, row, message):
    with RunWriter(tmp_path, on_error="raise") as run:
        with pytest.raises(BatchError, match=message) as err:
            run.write_batch(2, _versioned(high, None))
    assert (err.value.step, err.value.row, err.value.column) == (2, row, "max_global_steps")


def test_a_step_whose_parts_do_not_all_have_versions_gets_no_version_column(tmp_path):
    with RunWriter(tmp_path) as run:
        run.write_batch(1, _versioned([0, 0, 0], [0, 0, 0]))
        run.write_batch(1, _versioned([1, 0, 1], [0, 0, 1]))  # part 1: both columns kept
        run.write_batch(2, _versioned([1, 1, 1], [1, 1, 1]))
        run.write_batch(2, _versioned([1, None, 1], [1, 1, 1]))  # part 1 lacks policy_version
        run.write_batch(3, _versioned(None, None))
        run.write_batch(3, _versioned([2, 2, 2], [2, 2, 2]))  # part 0 lacked both
    one, two, three = (pq.read_table(tmp_path / "batches" / f"step_00000{s}.parquet") for s in (1, 2, 3))
    assert one["policy_version"].to_pylist() == [0, 0, 0, 1, 0, 1] and one["part"].to_pylist() == [0] * 3 + [1] * 3
    assert "policy_version" not in two.column_names and two["policy_version_min"].to_pylist() == [1] * 6
    assert not {"policy_version", "policy_version_min"} & set(three.column_names) and three.num_rows == 6


def test_run_on_writer_runs_after_what_was_queued_and_keeps_its_own_errors(tmp_path):
    with RunWriter(tmp_path / "run") as run:
        run.write_batch(1, _dataproto(1))
        seen = run.run_on_writer(lambda: pq.read_table(run.batch_path(1)).num_rows)

        def fails():
            raise ValueError("not the writer's")

        failed = run.run_on_writer(fails)
        run.write_batch(2, _dataproto(2))
        assert seen.result() == pq.read_table(run.batch_path(1)).num_rows > 0  # the step file was on disk
        with pytest.raises(ValueError, match="not the writer's"):
            failed.result()
        run.sync()  # the function's error is not the writer's: nothing raised here
    assert run.stats.steps == 2
