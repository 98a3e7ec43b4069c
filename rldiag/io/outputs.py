"""Scenario outputs (docs/run-directory.md, "A scenario"): ``metrics.parquet``, ``tokens/step_<N>.parquet``,
``rows/step_<N>.parquet``, ``scenario.json``; and reading them back."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from rldiag.errors import OutputError, RunDirError
from rldiag.io.arrays import floats_or_null, from_numpy, read_parquet
from rldiag.io.fs import RemotePath, is_remote
from rldiag.io.run_layout import RunLayout, ScenarioLayout

if TYPE_CHECKING:
    import torch

TOKEN_OUTPUTS = (
    "advantages",
    "returns",
    "token_level_rewards",
    "response_mask",
    "ratio",
    "pg_losses",
    "rollout_is_weights",
    "ref_kl",
    "turn",
)
#: token outputs written as int32 lists (the others: float32; response_mask: int8)
INT_TOKEN_OUTPUTS = frozenset({"turn"})
#: the per-row outputs of the engine (``Result.rows``) in the order ``rows_table`` writes them,
#: after ``step`` and ``row``
ROW_OUTPUTS = (
    "length",
    "actor_tokens",
    "turns",
    "score",
    "reward",
    "advantage_mean",
    "advantage_last",
    "is_weight_seq",
    "is_ratio_seq",
    "rollout_kl",
    "rollout_kl_k3",
    "clipped_tokens",
    "loss_weight",
    "group_has_signal",
    "group_size",
)
#: per-row outputs written as int64 (the others: float64)
INT_ROW_OUTPUTS = frozenset({"length", "actor_tokens", "turns", "group_has_signal", "group_size"})


def sha256_file(path: Path | RemotePath, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def tokens_table(tokens: dict[str, torch.Tensor], lengths: torch.Tensor, row_offset: int = 0) -> pa.Table:
    """Flat ``(tokens,)`` tensors of rows of ``lengths`` ``(rows,)`` (the packed layout) as list
    columns of length T_i: the values wrapped with the row offsets, nothing re-padded."""
    import torch  # here, not at the top: readers of scenarios (the app) never load torch

    lengths_np = lengths.cpu().numpy().astype(np.int64)
    total = int(lengths_np.sum())
    large = total >= 2**31
    offsets = np.zeros(len(lengths_np) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(lengths_np, out=offsets[1:])
    cols: dict[str, pa.Array] = {"row": from_numpy(np.arange(len(lengths_np), dtype=np.int64) + row_offset)}
    off = from_numpy(offsets)
    list_type = pa.LargeListArray if large else pa.ListArray
    for name in TOKEN_OUTPUTS:
        t = tokens.get(name)
        if t is None:
            continue
        flat = t.detach().cpu()
        if flat.shape != (total,):
            raise OutputError(f"token output {name!r} has shape {tuple(flat.shape)}, expected ({total},)")
        if name == "response_mask":
            values = from_numpy(flat.to(torch.int8).numpy())
        elif name in INT_TOKEN_OUTPUTS:
            values = from_numpy(flat.to(torch.int32).numpy())
        else:
            values = from_numpy(flat.to(torch.float32).numpy())
        cols[name] = list_type.from_arrays(off, values)
    return pa.table(cols)


def rows_table(rows: dict[str, torch.Tensor], step: int, row_offset: int = 0) -> pa.Table:
    """One step's per-row outputs ``(rows,)`` (the engine's ``Result.rows`` sliced to the step) as a
    table: ``step`` int64, ``row`` int64 (``row_offset`` + the row's index), then the outputs in
    :data:`ROW_OUTPUTS` order, those the step has (int64 counts and flags, float64 values)."""
    import torch  # here, not at the top: readers of scenarios (the app) never load torch

    present = [name for name in ROW_OUTPUTS if name in rows]
    n = int(rows[present[0]].shape[0]) if present else 0
    cols: dict[str, pa.Array] = {
        "step": from_numpy(np.full(n, int(step), dtype=np.int64)),
        "row": from_numpy(np.arange(n, dtype=np.int64) + row_offset),
    }
    for name in present:
        t = rows[name].detach().cpu()
        if t.shape != (n,):
            raise OutputError(f"row output {name!r} has shape {tuple(t.shape)}, expected ({n},)")
        dtype = torch.int64 if name in INT_ROW_OUTPUTS else torch.float64
        cols[name] = from_numpy(t.to(dtype).numpy())
    return pa.table(cols)


def metrics_table(rows: list[dict[str, float]]) -> pa.Table:
    """One row per step: ``step`` int64 and one float64 column per metric (null where absent)."""
    names = sorted({k for r in rows for k in r if k != "step"})
    rows = sorted(rows, key=lambda r: r["step"])
    cols = {"step": from_numpy(np.array([int(r["step"]) for r in rows], dtype=np.int64))}
    for name in names:
        cols[name] = floats_or_null([r.get(name) for r in rows])
    return pa.table(cols)


def json_safe(obj):
    """NaN/inf -> None so scenario.json stays standard JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def list_scenarios(run_path: Path | RemotePath | str) -> list[str]:
    """The run's complete scenarios (those with their ``scenario.json``), by name."""
    layout = RunLayout(run_path)
    root = layout.scenarios_dir
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and layout.scenario(p.name).meta.is_file())


def read_scenario(run_path: Path | RemotePath | str, name: str) -> tuple[dict, pa.Table]:
    """(scenario.json, metrics table) of one scenario."""
    sc = RunLayout(run_path).scenario(name)
    if not sc.meta.is_file():
        have = list_scenarios(run_path)
        raise RunDirError(f"no scenario {name!r} in {run_path}; have: {', '.join(have) or 'none'}")
    return read_scenario_at(sc)


def read_scenario_at(sc: ScenarioLayout) -> tuple[dict, pa.Table]:
    """(scenario.json, metrics table) of the scenario directory ``sc`` (one of ``scenarios/``, or
    of a sweep: ``RunLayout(run).layout_audit.scenario(name)``)."""
    if not sc.meta.is_file():
        raise RunDirError(f"no scenario in {sc.dir}")
    if is_remote(sc.dir):
        return _read_remote_scenario(sc)
    meta = json.loads(sc.meta.read_text())
    if sc.metrics.is_file():
        table = read_parquet(str(sc.metrics))
    else:
        table = pa.table({"step": from_numpy(np.zeros(0, dtype=np.int64))})
    return meta, table


def _read_remote_scenario(sc: ScenarioLayout, attempts: int = 3) -> tuple[dict, pa.Table]:
    """On an object store, objects are rewritten in place (:mod:`rldiag.io.staged`):
    ``metrics.parquet`` is checked against the size and SHA-256 that ``scenario.json`` lists for
    it, and read again after a pause if a rewrite got in between."""
    d = sc.dir
    for attempt in range(attempts):
        if attempt:
            time.sleep(0.5 * attempt)
        meta_path = sc.meta
        if not meta_path.exists():
            raise RunDirError(f"no complete scenario at {d} (it is being written, or a write was interrupted)")
        meta = json.loads(meta_path.read_text())
        record = (meta.get("outputs") or {}).get(sc.METRICS)
        mp = sc.metrics
        if record is None and not mp.exists():
            return meta, pa.table({"step": from_numpy(np.zeros(0, dtype=np.int64))})
        data = mp.read_bytes() if mp.exists() else b""
        if record is None or (len(data) == record.get("size") and hashlib.sha256(data).hexdigest() == record.get("sha256")):
            return meta, read_parquet(pa.BufferReader(data))
    raise OutputError(f"{d}: metrics.parquet does not match scenario.json; the scenario is being rewritten, try again")
