"""Runs and settings for the adaptive KL controller's tests (tests/scenario/test_recompute_kl_replay.py,
tests/executors/): a controller that moves at every step, batches captured after rejection,
malformed step files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

#: adaptive KL in the reward; on the synthetic runs the statistic is far above target_kl, so
#: every update is clipped to -0.2
KL = {
    "algorithm.use_kl_in_reward": True,
    "algorithm.kl_ctrl.type": "adaptive",
    "algorithm.kl_ctrl.kl_coef": 0.05,
    "algorithm.kl_ctrl.target_kl": 0.001,
    "algorithm.kl_ctrl.horizon": 100,
}
#: one that does not saturate (low_var_kl near its target, a short horizon): every step's
#: statistic moves the coefficient, so reading a different statistic shows in every later step
KL_LIVE = {**KL, "algorithm.kl_penalty": "low_var_kl", "algorithm.kl_ctrl.target_kl": 0.005,
           "algorithm.kl_ctrl.horizon": 50}


def rejected_after_capture(run: Path, share: float = 0.4) -> None:
    """Rewrite the run's batches as captured after rollout correction rejected rows:
    ``loss_mask`` the rollout's mask, ``response_mask`` with the rejected rows zeroed."""
    rng = np.random.default_rng(0)
    for p in sorted((run / "batches").glob("step_*.parquet")):
        t = pq.read_table(p)
        m = t["response_mask"].combine_chunks()
        flat = m.values.to_numpy(zero_copy_only=False).copy()
        flat[np.repeat(rng.random(len(m)) < share, np.diff(m.offsets.to_numpy()))] = 0
        post = pa.ListArray.from_arrays(m.offsets, pa.array(flat, pa.int8()))
        t = t.set_column(t.schema.get_field_index("response_mask"), "response_mask", post)
        pq.write_table(t.append_column("loss_mask", m), p)


def poison(run: Path, step: int, column: str, row: int = 3) -> None:
    """A NaN at the first token of ``row`` in one column of one step: the step fails to load."""
    p = run / "batches" / f"step_{step}.parquet"
    t = pq.read_table(p)
    col = t[column].to_pylist()
    col[row][0] = float("nan")
    pq.write_table(t.set_column(t.schema.get_field_index(column), column, pa.array(col, t.schema.field(column).type)), p)
