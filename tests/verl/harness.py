"""Differential tests against verl itself: run directories in, verl's functions beside rldiag's.

Both sides see the same batch through layout-independent paths: rldiag through a run directory
and ``rldiag.scenario.recompute.recompute(..., save_tokens=True)`` (per-row token lists read back from the
scenario), verl through right-padded ``(rows, T)`` tensors built from the same Arrow tables.
Batches have groups (``uid``), tool-observation spans (mask-0 runs inside a row) and long-tailed
lengths (most rows short, a few at the cap).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from rldiag.scenario.recompute import recompute
from rldiag.synth import list_array as _list

verl = pytest.importorskip("verl")


def long_tail_table(
    rng: np.random.Generator,
    step: int,
    prompts: int = 6,
    n: int = 4,
    cap: int = 96,
    tool_prob: float = 0.4,
    dense: bool = False,
    drift: float = 0.3,
) -> pa.Table:
    """One step's batch: ``prompts * n`` rows in groups of ``n``; lengths mostly in [1, 12], one row
    in eight at ``cap``; tool spans of mask 0 inside some rows; the outcome score on each row's last
    token (and, with ``dense``, small rewards on random tokens, mask-0 ones included)."""
    rows = prompts * n
    lengths = rng.integers(1, 13, size=rows)
    lengths[rng.random(rows) < 0.125] = cap
    total = int(lengths.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    row_of = np.repeat(np.arange(rows), lengths)
    pos = np.arange(total) - offsets[:-1][row_of]
    has_tool = (rng.random(rows) < tool_prob) & (lengths >= 3)
    a = np.maximum(1, (lengths * rng.uniform(0.2, 0.5, rows)).astype(np.int64))
    w = np.maximum(1, (lengths * rng.uniform(0.1, 0.3, rows)).astype(np.int64))
    in_tool = has_tool[row_of] & (pos >= a[row_of]) & (pos < (a + w)[row_of]) & (pos < lengths[row_of] - 1)
    mask = (~in_tool).astype(np.int8)
    p = np.repeat(rng.uniform(0, 1, prompts), n)
    score = (rng.random(rows) < p).astype(np.float32) + rng.normal(0, 0.1, rows).astype(np.float32)
    scores = np.zeros(total, dtype=np.float32)
    scores[offsets[1:] - 1] = score
    if dense:
        hit = rng.random(total) < 0.2
        scores[hit] += rng.normal(0, 0.3, int(hit.sum())).astype(np.float32)
    old = (-np.abs(rng.normal(0.8, 0.6, total))).astype(np.float32)
    # current, rollout and reference policies: the old one plus independent noise of scale drift
    cur, rollout, ref = ((old + rng.normal(0, drift, total)).astype(np.float32) for _ in range(3))
    values = rng.normal(0.3, 0.3, total).astype(np.float32)
    vpreds = (values + rng.normal(0, 0.3, total)).astype(np.float32)
    cols = {
        "uid": pa.array(np.repeat([f"s{step}-p{i}" for i in range(prompts)], n), pa.string()),
        "step": pa.array(np.full(rows, step, dtype=np.int64)),
    }
    token_columns = dict(
        token_level_scores=scores, old_log_probs=old, log_probs=cur, ref_log_prob=ref, rollout_log_probs=rollout,
        entropy=np.abs(rng.normal(1.0, 0.3, total)).astype(np.float32), values=values, vpreds=vpreds,
        sum_pi_squared=rng.uniform(0.1, 0.9, total).astype(np.float32),
    )
    cols.update({name: _list(v, lengths, pa.float32()) for name, v in token_columns.items()})
    cols["response_mask"] = _list(mask, lengths, pa.int8())
    cols.update({
        # gdpo's reward components (scalar per row, verl's non_tensor_batch keys)
        "format_reward": pa.array((rng.random(rows) < 0.7).astype(np.float32)),
        "accuracy_reward": pa.array((rng.random(rows) < p).astype(np.float32)),
        "reward_baselines": pa.array(rng.uniform(0, 1, rows).astype(np.float32)),
        "prompt_length": pa.array(rng.integers(4, 40, rows).astype(np.int64)),
        # the agent loop's per-row counts (verl's __num_turns__, tool_call_counts)
        "num_turns": pa.array((2 + 2 * has_tool).astype(np.int64)),
        "tool_call_counts": pa.array(has_tool.astype(np.int64) * rng.integers(1, 4, rows)),
    })
    return pa.table(cols)


def write_run(root: Path, tables: list[pa.Table], config: dict | None = None) -> Path:
    """A run directory: ``run.yaml`` (``config``, recording the installed verl's version as a
    capture does, so rldiag reproduces that release) and ``batches/step_<N>.parquet``."""
    (root / "batches").mkdir(parents=True, exist_ok=True)
    (root / "run.yaml").write_text(yaml.safe_dump({"verl_version": verl.__version__, **(config or {})}))
    for t in tables:
        step = int(t["step"][0].as_py())
        pq.write_table(t, root / "batches" / f"step_{step}.parquet")
    return root


def padded(table: pa.Table, column: str, dtype=torch.float32) -> torch.Tensor:
    """A list column as a right-padded ``(rows, T)`` tensor (T = the longest row), zeros after."""
    col = table[column].combine_chunks()
    lengths = np.diff(col.offsets.to_numpy())
    flat = col.values.to_numpy(zero_copy_only=False)
    rows, width = len(lengths), int(lengths.max()) if len(lengths) else 0
    out = np.zeros((rows, width), dtype=np.float64)
    valid = np.arange(width)[None, :] < lengths[:, None]
    out[valid] = flat
    return torch.tensor(out, dtype=dtype)


def scalar(table: pa.Table, column: str) -> np.ndarray:
    return table[column].to_numpy(zero_copy_only=False)


def run_rldiag(run: Path, overrides: dict, name: str = "diff") -> tuple[dict[int, dict], dict[int, pa.Table]]:
    """``recompute`` with ``save_tokens``: (step -> metrics, step -> tokens table)."""
    report = recompute(run, overrides, name=name, save_tokens=True, reuse=False)
    assert not report.steps_failed, report.steps_failed
    d = run / "rldiag" / "scenarios" / name
    metrics = {int(r["step"]): r for r in pq.read_table(d / "metrics.parquet").to_pylist()}
    tokens = {int(p.stem.split("_")[1]): pq.read_table(p) for p in (d / "tokens").glob("step_*.parquet")}
    json.loads((d / "scenario.json").read_text())
    return metrics, tokens


def call_with(fn, available: dict):
    """Call a verl function with the keyword arguments it declares, as verl's ``compute_advantage``
    passes them (``adv_kwargs``)."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in available.items() if k in params})


def in_rows(table: pa.Table, column: str = "response_mask") -> torch.Tensor:
    """``(rows, T)`` bool: the positions inside each row (padding after a row is not data)."""
    lengths = torch.tensor(np.diff(table[column].combine_chunks().offsets.to_numpy()))
    width = int(lengths.max())
    return torch.arange(width)[None, :] < lengths[:, None]


def assert_close(got, want, what: str, where: torch.Tensor | None = None, atol: float = 2e-5, rtol: float = 2e-5) -> None:
    """``got`` and ``want`` equal within float32 tolerance (at ``where`` only, when given)."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    if where is not None:
        got, want = got[where], want[where]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
