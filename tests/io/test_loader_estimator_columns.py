"""Estimator-specific columns: read only when the chosen estimator needs (or optionally uses)
them, landing in ``Batch.extra`` (string ids as int64 codes, numbers, padded lists); precise
messages when one is missing; ``rldiag check`` reports what each estimator needs."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rldiag.analysis.check import check_run
from rldiag.config.settings import resolve_settings
from rldiag.engine.batch import pack
from rldiag.engine.requirements import recompute_columns
from rldiag.errors import BatchError, MissingInputError
from rldiag.io.loader import load_step
from rldiag.io.rundir import StepFile
from tests.engine.packing import to_padded


def _cols():
    return {
        "uid": ["a", "a", "b"],
        "response_mask": pa.array([[1, 1, 0, 1], [1], [1, 1]], pa.list_(pa.int8())),
        "token_level_scores": pa.array([[0, 0, 0, 1.0], [0.5], [0, 2.0]], pa.list_(pa.float32())),
        "values": pa.array([[0.1, 0.2, 0.3, 0.4], [0.5], [0.6, 0.7]], pa.list_(pa.float32())),
        "old_log_probs": pa.array([[-1.0, -1, -1, -1], [-1.0], [-1.0, -1]], pa.list_(pa.float32())),
        "sum_pi_squared": pa.array([[0.5, 0.4, 0.3, 0.2], [0.9], [0.8, 0.7]], pa.list_(pa.float32())),
        "traj_uid": ["t-x", "t-y", "t-x"],
        "step_index": pa.array([0, 0, 1], pa.int64()),
        "session_id": ["s1", "s1", "s2"],
        "output_index": pa.array([0, 1, 0], pa.int32()),
        "acc": pa.array([True, False, True]),
        "fmt": pa.array([1, 0, 2], pa.int64()),
        "reward_baselines": pa.array([0.1, 0.2, 0.3], pa.float64()),
    }


def _write(tmp_path, step, cols):
    d = tmp_path / "batches"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{step}.parquet"
    pq.write_table(pa.table(cols), path)
    return StepFile(step, path)


def _settings(name, **more):
    return resolve_settings(overrides={"algorithm.adv_estimator": name, **more})


def _load(sf, settings):
    return load_step(sf, settings, recompute_columns(settings))


def test_columns_follow_the_estimator():
    names = list(_cols())
    # values only where a critic is in use (none of these estimators has one unless enabled)
    base = {"uid", "response_mask", "token_level_scores", "old_log_probs"}

    def read(settings):
        return set(recompute_columns(settings).select(names))

    assert read(_settings("rloo")) == base
    assert read(_settings("remax")) == base | {"reward_baselines"}
    assert read(_settings("grpo")) == base | {"session_id", "output_index"}
    assert read(_settings("step_gae")) == base | {"traj_uid", "step_index", "values"}  # its critic's values
    assert read(_settings("tir_optimal_token_baseline")) == base | {"sum_pi_squared"}
    assert read(_settings("gdpo", **{"algorithm.gdpo_reward_keys": "acc,fmt"})) == base | {"acc", "fmt"}
    assert read(_settings("rloo", **{"critic.enable": True})) == base | {"values"}


def test_extra_columns_land_in_batch_extra(tmp_path):
    sf = _write(tmp_path, 1, _cols())
    b = _load(sf, _settings("step_gae")).batch
    assert b.extra["traj_uid"].tolist() == [0, 1, 0] and b.extra["traj_uid"].dtype == torch.int64
    assert b.extra["step_index"].tolist() == [0, 0, 1]
    b = _load(sf, _settings("grpo")).batch
    assert b.extra["session_id"].tolist() == [0, 0, 1] and b.extra["output_index"].tolist() == [0, 1, 0]
    b = _load(sf, _settings("optimal_token_baseline")).batch
    assert b.token_extra == ("sum_pi_squared",)
    spp = to_padded(b.extra["sum_pi_squared"], b.rows)
    assert spp.shape == (3, 4) and spp[1].tolist() == pytest.approx([0.9, 0, 0, 0])
    b = _load(sf, _settings("gdpo", **{"algorithm.gdpo_reward_keys": "acc,fmt"})).batch
    assert b.extra["acc"].tolist() == [1.0, 0.0, 1.0] and b.extra["acc"].dtype == torch.float32
    assert b.extra["fmt"].tolist() == [1.0, 0.0, 2.0]
    assert b.reward_baselines is None  # remax's column
    assert _load(sf, _settings("remax")).batch.reward_baselines.tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert "traj_uid" not in b.extra  # gdpo does not read the trajectory columns


def test_packed_steps_keep_trajectory_ids_apart(tmp_path):
    s = _settings("traj_grpo")
    b1 = _load(_write(tmp_path, 1, _cols()), s).batch
    b2 = _load(_write(tmp_path, 2, _cols()), s).batch
    p = pack([b1, b2])
    assert p.extra["traj_uid"].tolist() == [0, 1, 0, 2, 3, 2]


def test_missing_columns_are_named(tmp_path):
    cols = _cols()
    del cols["traj_uid"]
    sf = _write(tmp_path, 1, cols)
    with pytest.raises(MissingInputError, match="traj_uid"):
        _load(sf, _settings("token_gae_cross_step"))
    with pytest.raises(MissingInputError, match="correctness"):
        _load(sf, _settings("gdpo", **{"algorithm.gdpo_reward_keys": "acc,correctness"}))
    with pytest.raises(MissingInputError, match="gdpo_reward_keys"):
        _load(sf, _settings("gdpo"))
    _load(sf, _settings("grpo"))  # optional columns may be absent


def test_bad_extra_values_are_reported(tmp_path):
    cols = _cols()
    cols["acc"] = pa.array([1.0, None, 0.0])
    with pytest.raises(BatchError, match="row 1.*'acc'"):
        _load(_write(tmp_path, 1, cols), _settings("gdpo", **{"algorithm.gdpo_reward_keys": "acc"}))
    cols = _cols()
    cols["sum_pi_squared"] = pa.array([[0.5], [0.9], [0.8, 0.7]], pa.list_(pa.float32()))
    with pytest.raises(BatchError, match="row 0.*'sum_pi_squared'"):
        _load(_write(tmp_path, 2, cols), _settings("optimal_token_baseline"))


def test_check_reports_what_each_estimator_needs(tmp_path):
    cols = _cols()
    del cols["sum_pi_squared"], cols["step_index"]
    _write(tmp_path, 1, cols)
    rep = check_run(tmp_path)
    assert rep.algorithms["grpo"] == [] and rep.algorithms["traj_grpo"] == []
    assert rep.algorithms["optimal_token_baseline"] == ["sum_pi_squared"]
    assert rep.algorithms["step_gae"] == ["step_index"]
    assert rep.algorithms["gdpo"] and "gdpo_reward_keys" in rep.algorithms["gdpo"][0]
    (tmp_path / "run.yaml").write_text("algorithm:\n  gdpo_reward_keys: [acc, fmt]\n")
    assert check_run(tmp_path).algorithms["gdpo"] == []


def test_batch_position_is_read_for_the_layout_and_checked(tmp_path):
    cols = _cols()
    cols["batch_position"] = pa.array([0, 3, 1], pa.int64())
    b = _load(_write(tmp_path, 1, cols), _settings("grpo")).batch
    assert b.extra["batch_position"].tolist() == [0, 3, 1]
    cols["batch_position"] = pa.array([2, 0, 2], pa.int64())
    with pytest.raises(BatchError, match="row 2.*'batch_position'.*the place of row 0 too"):
        _load(_write(tmp_path, 2, cols), _settings("grpo"))
    cols["batch_position"] = pa.array([0, -1, 2], pa.int64())
    with pytest.raises(BatchError, match="row 1.*'batch_position'"):
        _load(_write(tmp_path, 3, cols), _settings("grpo"))
