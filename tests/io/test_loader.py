"""The loader: Arrow list columns to padded tensors, and precise errors for bad input."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import torch

from rldiag.config.settings import resolve_settings
from rldiag.engine.requirements import recompute_columns
from rldiag.errors import BatchError, MissingInputError
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir, StepFile
from tests.engine.packing import to_padded


def write(tmp_path, step, cols, fmt="parquet", name=None):
    d = tmp_path / "batches"
    d.mkdir(parents=True, exist_ok=True)
    path = d / (name or f"step_{step}.{fmt}")
    table = pa.table(cols)
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        feather.write_feather(table, path, compression="uncompressed")
    return StepFile(step, path)


def base_cols():
    return {
        "uid": ["a", "a", "b"],
        "response_mask": pa.array([[1, 1, 0, 1], [1], [1, 1]], pa.list_(pa.int8())),
        "token_level_scores": pa.array([[0, 0, 0, 1.0], [0.5], [0, 2.0]], pa.list_(pa.float32())),
    }


S = resolve_settings(overrides={"algorithm.adv_estimator": "grpo"})
PLAN = recompute_columns(S)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_packs_rows_and_groups(tmp_path, fmt):
    sd = load_step(write(tmp_path, 3, base_cols(), fmt), S, PLAN)
    b = sd.batch
    assert b.lengths.tolist() == [4, 1, 2] and b.rows.offsets.tolist() == [0, 4, 5, 7]
    assert b.response_mask.tolist() == [1, 1, 0, 1, 1, 1, 1]  # flat, rows one after another
    assert to_padded(b.response_mask, b.rows).tolist() == [[1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert to_padded(b.token_level_scores, b.rows)[2].tolist() == [0, 2.0, 0, 0]
    assert b.group_ids.tolist() == [0, 0, 1] and b.n_groups == 2
    assert b.steps == [3] and sd.n_tokens == 7
    assert b.max_response_length.tolist() == [4]


def test_scalar_score_goes_to_the_last_position(tmp_path):
    cols = base_cols()
    del cols["token_level_scores"]
    cols["score"] = [1.0, 0.25, -1.0]
    b = load_step(write(tmp_path, 1, cols), S, PLAN).batch
    assert to_padded(b.token_level_scores, b.rows).tolist() == [[0, 0, 0, 1.0], [0.25, 0, 0, 0], [0, -1.0, 0, 0]]


def test_bool_masks_are_accepted(tmp_path):
    cols = base_cols()
    cols["response_mask"] = pa.array([[True, True, False, True], [True], [True, True]], pa.list_(pa.bool_()))
    b = load_step(write(tmp_path, 1, cols), S, PLAN).batch
    assert to_padded(b.response_mask, b.rows)[0].tolist() == [1, 1, 0, 1]


def test_length_mismatch_names_row_and_column(tmp_path):
    cols = base_cols()
    cols["old_log_probs"] = pa.array([[-1.0] * 4, [-1.0], [-1.0]], pa.list_(pa.float32()))
    with pytest.raises(BatchError) as exc:
        load_step(write(tmp_path, 5, cols), S, PLAN)
    e = exc.value
    assert (e.step, e.row, e.column) == (5, 2, "old_log_probs")
    assert "1 tokens but response_mask has 2" in str(e) and "step_5.parquet" in str(e)


def test_step_column_disagreeing_with_file_name(tmp_path):
    cols = base_cols()
    cols["step"] = [4, 4, 9]
    with pytest.raises(BatchError) as exc:
        load_step(write(tmp_path, 4, cols), S, PLAN)
    assert (exc.value.row, exc.value.column) == (2, "step") and "says 9" in str(exc.value)


def test_nan_in_log_probs_names_row_and_token(tmp_path):
    cols = base_cols()
    cols["log_probs"] = pa.array([[-1.0] * 4, [-1.0], [-1.0, float("nan")]], pa.list_(pa.float32()))
    cols["old_log_probs"] = pa.array([[-1.0] * 4, [-1.0], [-1.0, -1.0]], pa.list_(pa.float32()))
    with pytest.raises(BatchError) as exc:
        load_step(write(tmp_path, 2, cols), S, PLAN)
    assert (exc.value.row, exc.value.column) == (2, "log_probs") and "token 1" in str(exc.value)


def test_unknown_mask_value(tmp_path):
    cols = base_cols()
    cols["response_mask"] = pa.array([[1, 1, 2, 1], [1], [1, 1]], pa.list_(pa.int8()))
    with pytest.raises(BatchError) as exc:
        load_step(write(tmp_path, 1, cols), S, PLAN)
    assert (exc.value.row, exc.value.column) == (0, "response_mask") and "mask value 2 at token 2" in str(exc.value)


def test_empty_step(tmp_path):
    cols = {k: v.slice(0, 0) if isinstance(v, pa.Array) else [] for k, v in base_cols().items()}
    cols["uid"] = pa.array([], pa.string())
    with pytest.raises(BatchError, match="no rows"):
        load_step(write(tmp_path, 1, cols), S, PLAN)


def test_missing_required_column_and_estimator_needs(tmp_path):
    cols = base_cols()
    del cols["token_level_scores"]
    with pytest.raises(MissingInputError, match="token_level_scores or score"):
        load_step(write(tmp_path, 1, cols), S, PLAN)
    gae = resolve_settings(overrides={"algorithm.adv_estimator": "gae"})
    sf = write(tmp_path, 2, base_cols())
    with pytest.raises(MissingInputError, match="gae needs values, missing") as err:
        load_step(sf, gae, recompute_columns(gae))
    # the error names the file and the step, not only the column
    assert str(sf.path) in str(err.value) and "step 2" in str(err.value) and "'values'" in str(err.value)


def test_null_list_row(tmp_path):
    cols = base_cols()
    cols["token_level_scores"] = pa.array([[0, 0, 0, 1.0], None, [0, 2.0]], pa.list_(pa.float32()))
    with pytest.raises(BatchError) as exc:
        load_step(write(tmp_path, 1, cols), S, PLAN)
    assert (exc.value.row, exc.value.column) == (1, "token_level_scores")


def test_truncated_file_is_a_clear_error(tmp_path):
    sf = write(tmp_path, 1, base_cols())
    data = sf.path.read_bytes()
    sf.path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BatchError, match="incomplete or still being written"):
        load_step(sf, S, PLAN)


def test_large_random_step_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 50, 300)
    flat = rng.normal(size=int(lengths.sum())).astype(np.float32)
    offs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    lst = pa.ListArray.from_arrays(pa.array(offs), pa.array(flat))
    mask = pa.ListArray.from_arrays(pa.array(offs), pa.array(np.ones(len(flat), np.int8)))
    sf = write(tmp_path, 1, {"uid": [str(i % 7) for i in range(300)], "response_mask": mask, "token_level_scores": lst})
    b = load_step(sf, S, PLAN).batch
    assert b.token_level_scores.shape == (int(lengths.sum()),)  # as many values as tokens: no padding
    assert b.rows.offsets.tolist() == offs.tolist()
    scores = to_padded(b.token_level_scores, b.rows)
    for i in (0, 17, 299):
        assert scores[i, : lengths[i]].tolist() == pytest.approx(flat[offs[i]:offs[i + 1]].tolist())
        assert scores[i, lengths[i]:].abs().sum().item() == 0


def test_duplicate_step_files(tmp_path):
    write(tmp_path, 1, base_cols(), name="step_1.parquet")
    write(tmp_path, 1, base_cols(), name="step_001.parquet")
    from rldiag.errors import RunDirError

    with pytest.raises(RunDirError, match="two batch files"):
        RunDir(tmp_path).step_files()


# ---- the per-row policy version (verl's max_global_steps / min_global_steps) -----------------------

VERSION_COLUMNS = ["uid", "response_mask", "token_level_scores", "policy_version", "policy_version_min"]


def test_policy_versions_load_as_int64_extra_columns(tmp_path):
    cols = base_cols()
    cols["policy_version"] = pa.array([6, 5, 6], pa.int64())
    cols["policy_version_min"] = pa.array([6.0, 4.0, 6.0], pa.float64())  # whole numbers as floats: accepted
    b = load_step(write(tmp_path, 7, cols), S, VERSION_COLUMNS).batch
    assert b.extra["policy_version"].dtype == torch.int64 and b.extra["policy_version"].tolist() == [6, 5, 6]
    assert b.extra["policy_version_min"].dtype == torch.int64 and b.extra["policy_version_min"].tolist() == [6, 4, 6]
    # a recompute reads policy_version (the mismatch stage's policy lag), not policy_version_min
    extra = load_step(write(tmp_path, 8, cols), S, PLAN).batch.extra
    assert "policy_version" in extra and "policy_version_min" not in extra


@pytest.mark.parametrize("values, message", [
    (pa.array([6, None, 6], pa.int64()), "value is null"),
    (pa.array([6.0, 5.5, 6.0], pa.float64()), "value 5.5 is not an integer"),
    (pa.array([6.0, float("nan"), 6.0], pa.float64()), "value nan is not an integer"),
])
def test_a_non_integer_or_null_policy_version_names_file_step_row_and_column(tmp_path, values, message):
    cols = base_cols()
    cols["policy_version"] = values
    sf = write(tmp_path, 7, cols)
    with pytest.raises(BatchError) as exc:
        load_step(sf, S, VERSION_COLUMNS[:4])
    e = exc.value
    assert (e.file, e.step, e.row, e.column) == (str(sf.path), 7, 1, "policy_version")
    assert str(e) == f"file {sf.path}, step 7, row 1, column 'policy_version': {message}"


def test_a_policy_version_of_text_is_refused_naming_the_column(tmp_path):
    cols = base_cols()
    cols["policy_version"] = ["6", "5", "6"]
    with pytest.raises(BatchError, match=r"step 7, column 'policy_version': expected a number, found type string"):
        load_step(write(tmp_path, 7, cols), S, VERSION_COLUMNS[:4])


def test_a_large_file_read_column_by_column_loads_the_same_batch(tmp_path, monkeypatch):
    """Above ``BY_COLUMN_VALUES`` tokens a Parquet file is read one column at a time (less memory
    at the read's peak): the same table, schema metadata included, and the same batch."""
    import rldiag.io.loader as loader
    from rldiag.synth import SynthSpec, write_synth_run

    run = write_synth_run(tmp_path / "run", SynthSpec(steps=1, prompts=4, n=4, min_len=5, max_len=40, seed=3,
                                                       extra_columns=True))
    sf = RunDir(run).require_steps()[0]
    settings = resolve_settings(run)
    whole = loader.read_table(sf)
    whole_batch = load_step(sf, settings, recompute_columns(settings)).batch
    monkeypatch.setattr(loader, "BY_COLUMN_VALUES", 1)
    by_column = loader.read_table(sf)
    assert by_column.equals(whole) and by_column.schema.metadata == whole.schema.metadata
    assert by_column.schema == whole.schema
    batch = load_step(sf, settings, recompute_columns(settings)).batch
    for name in ("response_mask", "token_level_scores", "old_log_probs", "lengths", "group_ids"):
        a, b = getattr(batch, name), getattr(whole_batch, name)
        if a is not None:
            assert torch.equal(a, b), name
