"""An independent, loop-by-loop reference of what a verl trainer logs for a batch, used to write
runs whose logged columns and metrics.jsonl are "what the trainer logged".

Plain Python over rows and tokens (no rldiag code): outcome GRPO / RLOO advantages, the
token-level rewards of an outcome score, and a handful of metrics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from rldiag.synth import SynthSpec, write_synth_run


def _rows(table: pa.Table) -> list[dict]:
    return table.to_pylist()


def outcome_advantages(rows: list[dict], estimator: str, norm_by_std: bool) -> list[float]:
    """One scalar per row: GRPO (sample std, + 1e-6; singleton: mean 0, std 1) or RLOO
    (mean of the others; a singleton keeps its score)."""
    scores = [float(r["score"]) for r in rows]
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r["uid"], []).append(i)
    out = [0.0] * len(rows)
    for idx in groups.values():
        vals = [scores[i] for i in idx]
        n = len(vals)
        for i in idx:
            if estimator == "grpo":
                if n == 1:
                    mean, std = 0.0, 1.0
                else:
                    mean = sum(vals) / n
                    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
                out[i] = (scores[i] - mean) / (std + 1e-6) if norm_by_std else scores[i] - mean
            elif estimator == "rloo":
                out[i] = scores[i] if n == 1 else scores[i] - (sum(vals) - scores[i]) / (n - 1)
            else:
                raise ValueError(estimator)
    return out


def _agg(losses: list[list[float]], masks: list[list[int]], mode: str) -> float:
    if mode == "token-mean":
        num = sum(x * m for row, mrow in zip(losses, masks) for x, m in zip(row, mrow))
        return num / sum(sum(m) for m in masks)
    if mode == "seq-mean-token-mean":
        per = []
        for row, mrow in zip(losses, masks):
            cnt = sum(mrow)
            per.append(sum(x * m for x, m in zip(row, mrow)) / cnt if cnt else 0.0)
        return sum(per) / len(per)
    raise ValueError(mode)


def logged_step(table: pa.Table, estimator: str = "grpo", norm_by_std: bool = True, agg: str = "token-mean",
                clip: float = 0.2, clip_c: float = 3.0) -> tuple[dict[str, list[list[float]]], dict[str, float]]:
    """The per-token columns and metrics a trainer would log for one step."""
    rows = _rows(table)
    scalar = outcome_advantages(rows, estimator, norm_by_std)
    cols = {"token_level_rewards": [], "advantages": [], "returns": []}
    pg, masks, ent, kl, clipped = [], [], [], [], []
    for r, a in zip(rows, scalar):
        mask = [int(m) for m in r["response_mask"]]
        n = len(mask)
        rew = [0.0] * n
        if n:
            rew[-1] = float(r["score"])
        adv = [a * m for m in mask]
        cols["token_level_rewards"].append(rew)
        cols["advantages"].append(adv)
        cols["returns"].append(list(adv))
        row_pg = []
        for t in range(n):
            ratio = math.exp(max(-20.0, min(20.0, r["log_probs"][t] - r["old_log_probs"][t])))
            l1 = -adv[t] * ratio
            l2 = -adv[t] * min(max(ratio, 1 - clip), 1 + clip)
            c1 = max(l1, l2)
            row_pg.append(min(c1, -adv[t] * clip_c) if adv[t] < 0 else c1)
            if mask[t]:
                kl.append(r["old_log_probs"][t] - r["log_probs"][t])
                clipped.append(1.0 if l2 > l1 else 0.0)
        pg.append(row_pg)
        ent.append(list(r["entropy"]))
        masks.append(mask)
    masked_adv = [v for a_row, m_row in zip(cols["advantages"], masks) for v, m in zip(a_row, m_row) if m]
    metrics = {
        "critic/score/mean": sum(float(r["score"]) for r in rows) / len(rows),
        "critic/advantages/mean": sum(masked_adv) / len(masked_adv),
        "critic/advantages/max": max(masked_adv),
        "critic/advantages/min": min(masked_adv),
        "response_length/mean": sum(len(m) for m in masks) / len(masks),
        "actor/ppo_kl": sum(kl) / len(kl),
        "actor/pg_clipfrac": sum(clipped) / len(clipped),
        "actor/pg_loss": _agg(pg, masks, agg),
        "actor/entropy_loss": _agg(ent, masks, agg),
        "timing/step": 12.5,  # a metric rldiag does not compute
    }
    return cols, metrics


def write_logged_run(path: Path, steps: int = 3, seed: int = 0, run_settings: dict | None = None,
                     logged: dict | None = None, columns: tuple[str, ...] = ("token_level_rewards", "advantages", "returns"),
                     metrics: bool = True, **spec) -> Path:
    """A synthetic run whose run.yaml says ``run_settings`` (nested verl keys) and whose logged
    columns and metrics.jsonl were produced by the reference with ``logged`` (keyword arguments
    of :func:`logged_step`)."""
    cfg = run_settings or {"algorithm": {"adv_estimator": "grpo"}}
    root = write_synth_run(path, SynthSpec(steps=steps, seed=seed, config=cfg, write_metrics=False, **spec))
    lines = []
    for f in sorted((root / "batches").iterdir()):
        step = int(f.stem.split("_")[1])
        table = pq.read_table(f)
        cols, m = logged_step(table, **(logged or {}))
        for name in columns:
            table = table.append_column(name, pa.array(cols[name], pa.list_(pa.float32())))
        pq.write_table(table, f)
        lines.append(json.dumps({"step": step, "data": m}))
    if metrics:
        (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    return root


def rewrite_column(root: Path, name: str, fn) -> None:
    """Replace list column ``name`` of every batch by ``fn(step, list of rows)``."""
    for f in sorted((root / "batches").iterdir()):
        step = int(f.stem.split("_")[1])
        table = pq.read_table(f)
        new = fn(step, table[name].to_pylist(), table)
        i = table.column_names.index(name)
        table = table.set_column(i, name, pa.array(new, table.schema.field(name).type))
        pq.write_table(table, f)


def as_array(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)
