"""Synthetic run directories: random but well-formed batches in the batch schema (``rldiag.io.schema``).

Used by the tests, by ``bench/`` (runs of a given size) and by ``rldiag demo``-style smoke runs
(re-exported by :mod:`rldiag.synth`).
The numbers are drawn from simple generative rules (outcome scores per group, tool-observation
spans with mask 0, log-probs of four policies that drift apart), vectorised with numpy.

Response lengths are uniform in ``[min_len, max_len]`` by default; ``lengths="lognormal"`` draws
them long-tailed as reasoning runs have them: lognormal around ``median_len`` (``sigma``), clipped
to ``[min_len, max_len]``, and a share ``capped`` of the rows cut at ``max_len`` (the
``data.max_response_length`` cap).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from rldiag.errors import ConfigError
from rldiag.io.run_layout import RunLayout
from rldiag.io.staged import replace_file


@dataclass
class SynthSpec:
    steps: int = 4
    prompts: int = 4
    n: int = 4  # responses per prompt
    min_len: int = 4
    max_len: int = 32
    tool_prob: float = 0.3  # share of rows with a tool-observation span
    drift: float = 0.05  # scale of old/current/rollout log-prob differences
    critic: bool = True
    seed: int = 0
    first_step: int = 1
    config: dict | None = None
    write_metrics: bool = True
    lengths: str = "uniform"  # or "lognormal"
    median_len: int = 600  # lognormal: the median length
    sigma: float = 0.8  # lognormal: the spread of log length
    capped: float = 0.0  # lognormal: share of rows at max_len
    capped_rows: int = 0  # lognormal: this many rows of each step (drawn at random) at max_len, besides
    #: the estimator-specific columns too (traj_uid, step_index, session_id, output_index,
    #: reward_baselines, sum_pi_squared, reward components acc and fmt), so every estimator runs
    extra_columns: bool = False
    #: ``response_tokens`` and ``prompt_tokens`` (one word per token), drawn from their own random
    #: stream, so a run with text has the same numbers as the run without
    text: bool = False


def draw_lengths(spec: SynthSpec, rows: int, rng: np.random.Generator) -> np.ndarray:
    """``(rows,)`` int64 response lengths under ``spec.lengths``."""
    if spec.lengths == "uniform":
        return rng.integers(spec.min_len, spec.max_len + 1, size=rows)
    if spec.lengths != "lognormal":
        raise ConfigError(f"SynthSpec.lengths: unknown length distribution {spec.lengths!r}; use uniform or lognormal")
    lengths = np.exp(rng.normal(np.log(spec.median_len), spec.sigma, rows)).astype(np.int64)
    lengths = np.clip(lengths, spec.min_len, spec.max_len)
    lengths[rng.random(rows) < spec.capped] = spec.max_len
    if spec.capped_rows:
        lengths[rng.choice(rows, size=min(spec.capped_rows, rows), replace=False)] = spec.max_len
    return lengths


def list_array(values: np.ndarray | pa.Array, lengths: np.ndarray, dtype: pa.DataType) -> pa.ListArray:
    """A list column of ``dtype`` from flat ``values`` ``(sum(lengths),)`` (numpy, or an arrow
    array of that type) and per-row ``lengths``."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = values if isinstance(values, pa.Array) else pa.array(values, type=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat)


def synth_step_table(spec: SynthSpec, step: int, rng: np.random.Generator) -> pa.Table:
    rows = spec.prompts * spec.n
    lengths = draw_lengths(spec, rows, rng)
    total = int(lengths.sum())
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    row_of = np.repeat(np.arange(rows), lengths)
    pos = np.arange(total) - offsets[:-1][row_of]
    # tool span: positions [a, a + w) of some rows get mask 0
    has_tool = rng.random(rows) < spec.tool_prob
    a = (lengths * rng.uniform(0.2, 0.5, rows)).astype(np.int64)
    w = np.maximum(1, (lengths * rng.uniform(0.1, 0.3, rows)).astype(np.int64))
    in_tool = has_tool[row_of] & (pos >= a[row_of]) & (pos < (a + w)[row_of])
    mask = (~in_tool).astype(np.int8)
    # outcome score per row: group difficulty decides success probability
    p_success = np.repeat(rng.uniform(0, 1, spec.prompts), spec.n)
    score = (rng.random(rows) < p_success).astype(np.float32)
    old = (-np.abs(rng.normal(0.8, 0.6, total))).astype(np.float32)
    cur = (old + rng.normal(0, spec.drift, total)).astype(np.float32)
    rollout = (old + rng.normal(0, spec.drift / 2, total)).astype(np.float32)
    ref = (old + rng.normal(0, spec.drift * 2, total)).astype(np.float32)
    entropy = np.abs(rng.normal(1.0, 0.3, total)).astype(np.float32)
    uid = np.repeat([f"s{step}-p{i}" for i in range(spec.prompts)], spec.n)
    cols = {
        "uid": pa.array(uid, pa.string()),
        "step": pa.array(np.full(rows, step, dtype=np.int64)),
        "score": pa.array(score, pa.float32()),
        "prompt_length": pa.array(rng.integers(8, 64, rows).astype(np.int64)),
        "response_mask": list_array(mask, lengths, pa.int8()),
        "old_log_probs": list_array(old, lengths, pa.float32()),
        "log_probs": list_array(cur, lengths, pa.float32()),
        "ref_log_prob": list_array(ref, lengths, pa.float32()),
        "rollout_log_probs": list_array(rollout, lengths, pa.float32()),
        "entropy": list_array(entropy, lengths, pa.float32()),
    }
    if spec.critic:
        values = (score[row_of] * 0.3 + rng.normal(0.3, 0.2, total)).astype(np.float32)
        vpreds = (values + rng.normal(0, 0.1, total)).astype(np.float32)
        cols["values"] = list_array(values, lengths, pa.float32())
        cols["vpreds"] = list_array(vpreds, lengths, pa.float32())
    if spec.extra_columns:
        i = np.arange(rows)
        pi = np.exp(old)
        cols.update({
            "traj_uid": pa.array([f"{u}-t{k % 2}" for k, u in zip(i, uid)], pa.string()),
            "step_index": pa.array((i // 2) % 2, pa.int64()),
            "session_id": pa.array([f"{u}-s{k}" for k, u in zip((i // 2) % 2, uid)], pa.string()),
            "output_index": pa.array(i % 2, pa.int64()),
            "reward_baselines": pa.array(rng.uniform(0, 1, rows).astype(np.float32)),
            "acc": pa.array(rng.integers(0, 2, rows).astype(np.float32)),
            "fmt": pa.array(rng.integers(0, 2, rows).astype(bool)),
            "sum_pi_squared": list_array((pi**2 + rng.uniform(0, 1, total) * (1 - pi**2)).astype(np.float32),
                                         lengths, pa.float32()),
        })
    if spec.text:
        cols.update(synth_text(spec, step, lengths, np.asarray(cols["prompt_length"])))
    return pa.table(cols)


#: the words of the synthetic text: a small vocabulary with a long-tailed (Zipf-like) frequency
WORDS = pa.array([" " + w for w in "the a of to and is in that it for on with as this by be are at from or an we "
                  "x y z let so then sum value answer step check case call tool result find prove number".split()]
                 + [f" w{i}" for i in range(2000)], pa.string())


def synth_text(spec: SynthSpec, step: int, lengths: np.ndarray, prompt_lengths: np.ndarray) -> dict[str, pa.Array]:
    """``response_tokens`` ``(rows, length)`` and ``prompt_tokens`` ``(rows, prompt_length)``
    list<string> columns: one word (with its leading space) per token, Zipf-distributed."""
    rng = np.random.default_rng([spec.seed, step, 7])
    rank = np.arange(1, len(WORDS) + 1, dtype=np.float64)
    p = 1.0 / rank
    p /= p.sum()
    out = {}
    for name, lens in (("response_tokens", lengths), ("prompt_tokens", prompt_lengths)):
        words = WORDS.take(pa.array(rng.choice(len(WORDS), size=int(lens.sum()), p=p)))
        out[name] = list_array(words, lens, pa.string())
    return out


def write_synth_run(path: str | Path, spec: SynthSpec | None = None) -> Path:
    """Write a synthetic run directory and return its path."""
    spec = spec or SynthSpec()
    root = Path(path)
    layout = RunLayout(root)
    layout.batches_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    config = spec.config or {
        "algorithm": {"adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0},
        "actor_rollout_ref": {"actor": {"loss_agg_mode": "token-mean", "clip_ratio": 0.2}},
        "data": {"max_response_length": spec.max_len},
    }
    layout.run_config.write_text(yaml.safe_dump(config, sort_keys=False))
    lines = []
    for step in range(spec.first_step, spec.first_step + spec.steps):
        table = synth_step_table(spec, step, rng)
        replace_file(layout.batch_file(step, width=1), functools.partial(pq.write_table, table))
        lines.append(json.dumps({"step": step, "data": {"critic/score/mean": float(np.mean(table["score"]))}}))
    if spec.write_metrics:
        layout.metrics_file.write_text("\n".join(lines) + "\n")
    return root
