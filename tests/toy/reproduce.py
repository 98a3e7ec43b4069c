"""Helpers: recompute a toy run with rldiag and compare with what the trainer logged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from rldiag.io.rundir import RunDir, iter_metrics_lines
from rldiag.scenario.recompute import recompute

TOKEN_COLUMNS = ("advantages", "returns", "token_level_rewards")
#: float32 tolerance: both sides compute in float32, in different orders.
RTOL, ATOL = 1e-5, 1e-6
#: what the trainer logs that rldiag does not recompute (optimizer state, the task's own counters)
NOT_RECOMPUTED_PREFIXES = ("task/", "actor/grad_norm", "actor/lr", "critic/grad_norm", "critic/lr")


def recompute_scenario(run: Path, overrides: dict | None = None, name: str = "repro") -> Path:
    report = recompute(run, overrides=overrides or {}, name=name, device="cpu", save_tokens=True, reuse=False)
    assert report.ok, report.steps_failed
    return report.path


def token_mismatches(run: Path, scenario: Path) -> dict[str, float]:
    """Largest ``|logged - recomputed| - rtol * |logged|`` per token column (<= atol passes)."""
    worst = {c: 0.0 for c in TOKEN_COLUMNS}
    for sf in RunDir(run).step_files():
        logged = pq.read_table(sf.path, columns=list(TOKEN_COLUMNS)).to_pydict()
        mine = pq.read_table(scenario / "tokens" / f"step_{sf.step:06d}.parquet").to_pydict()
        for col in TOKEN_COLUMNS:
            a = np.concatenate([np.asarray(x, np.float64) for x in logged[col]])
            b = np.concatenate([np.asarray(x, np.float64) for x in mine[col]])
            assert a.shape == b.shape, (sf.step, col)
            worst[col] = max(worst[col], float(np.max(np.abs(a - b) - RTOL * np.abs(a))))
    return worst


def metric_mismatches(run: Path, scenario: Path) -> tuple[dict[str, float], set[str]]:
    """``({metric: worst excess over tolerance}, logged metrics rldiag did not produce)``."""
    logged = dict(iter_metrics_lines(run / "metrics.jsonl"))
    excess: dict[str, float] = {}
    missing: set[str] = set()
    for row in pq.read_table(scenario / "metrics.parquet").to_pylist():
        step = row["step"]
        for name, value in logged[step].items():
            if name.startswith(NOT_RECOMPUTED_PREFIXES):
                continue
            mine = row.get(name)
            if mine is None:
                missing.add(name)
                continue
            if np.isnan(value) and np.isnan(mine):
                continue
            excess[name] = max(excess.get(name, -np.inf), abs(mine - value) - RTOL * abs(value))
    return excess, missing
