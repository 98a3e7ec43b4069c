"""Generated runs for the doctor: a healthy GRPO (or GAE) run, and the same run with one planted
problem. Each step is drawn from simple rules (per-prompt success rates, tool spans, four
policies whose log-probs differ by small noise); a ``plant(step, s)`` hook edits a step's
arrays before it is written."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

MAX_LEN = 32


@dataclass
class StepArrays:
    """One step, row by row (lists of numpy arrays for the token columns)."""

    uid: list[str]
    score: np.ndarray
    mask: list[np.ndarray]
    old: list[np.ndarray]
    cur: list[np.ndarray]
    rollout: list[np.ndarray]
    ref: list[np.ndarray]
    entropy: list[np.ndarray]
    values: list[np.ndarray] = field(default_factory=list)
    rng: np.random.Generator | None = None
    text: list[list[str] | None] = field(default_factory=list)  # a row's token strings (None: random words)
    columns: dict[str, np.ndarray] = field(default_factory=dict)  # more per-row columns (reward components)

    @property
    def rows(self) -> int:
        return len(self.uid)

    def set_length(self, i: int, n: int) -> None:
        """Give row ``i`` length ``n`` (tokens drawn as for the others; no tool span)."""
        rng = self.rng
        self.mask[i] = np.ones(n, np.int8)
        self.old[i] = -np.abs(rng.normal(0.8, 0.6, n)).astype(np.float32)
        self.cur[i] = (self.old[i] + rng.normal(-0.01, 0.03, n)).astype(np.float32)
        self.rollout[i] = (self.old[i] + rng.normal(0.0002, 0.02, n)).astype(np.float32)
        self.ref[i] = (self.old[i] + rng.normal(0, 0.05, n)).astype(np.float32)
        self.entropy[i] = np.abs(rng.normal(1.0, 0.2, n)).astype(np.float32)
        if self.values:
            self.values[i] = (self.score[i] * 0.8 + rng.normal(0.1, 0.05, n)).astype(np.float32)


def _step(rng: np.random.Generator, step: int, prompts: int, n: int, tool_prob: float, critic: bool) -> StepArrays:
    rows = prompts * n
    p = np.repeat(rng.uniform(0.2, 0.8, prompts), n)
    score = (rng.random(rows) < p).astype(np.float32)
    s = StepArrays(uid=[f"s{step}-p{i // n}" for i in range(rows)], score=score, mask=[], old=[], cur=[], rollout=[],
                   ref=[], entropy=[], values=[None] * rows if critic else [], rng=rng)
    for name in ("mask", "old", "cur", "rollout", "ref", "entropy"):
        getattr(s, name).extend([None] * rows)
    for i in range(rows):
        s.text.append(None)
        s.set_length(i, int(rng.integers(8, 25)))
        if rng.random() < tool_prob:  # a tool observation in the middle of the row
            L = len(s.mask[i])
            a = int(L * rng.uniform(0.3, 0.5))
            s.mask[i][a:a + max(1, L // 5)] = 0
    return s


def _list(rows: list[np.ndarray], t: pa.DataType) -> pa.Array:
    return pa.array([r.tolist() for r in rows], pa.list_(t))


def write_run(path: Path, steps: int = 9, prompts: int = 8, n: int = 8, seed: int = 0, config: dict | None = None,
              plant: Callable[[int, StepArrays], None] | None = None, tool_prob: float = 0.3,
              logged: Callable[[int, StepArrays], dict] | None = None, critic: bool = False, max_len: int = MAX_LEN,
              text: bool = False) -> Path:
    """Write a run; ``logged(step, arrays)`` gives the metrics.jsonl entry of a step. ``text``: write
    ``response_tokens`` too (a row's ``text`` where the plant set it, else random words)."""
    root = Path(path)
    (root / "batches").mkdir(parents=True)
    cfg = config or {"algorithm": {"adv_estimator": "grpo"}}
    cfg = {**cfg, "data": {"max_response_length": max_len}}
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    rng = np.random.default_rng(seed)
    lines = []
    for step in range(1, steps + 1):
        s = _step(rng, step, prompts, n, tool_prob, critic)
        if plant is not None:
            plant(step, s)
        cols = {
            "uid": pa.array(s.uid, pa.string()),
            "score": pa.array(s.score, pa.float32()),
            "prompt_length": pa.array(rng.integers(16, 64, s.rows)),
            "response_mask": _list(s.mask, pa.int8()),
            "old_log_probs": _list(s.old, pa.float32()),
            "log_probs": _list(s.cur, pa.float32()),
            "rollout_log_probs": _list(s.rollout, pa.float32()),
            "ref_log_prob": _list(s.ref, pa.float32()),
            "entropy": _list(s.entropy, pa.float32()),
        }
        if critic:
            cols["values"] = _list(s.values, pa.float32())
        if text:
            cols["response_tokens"] = pa.array([t if t is not None and len(t) == len(m) else _words(rng, len(m))
                                                for t, m in zip(s.text, s.mask, strict=True)], pa.list_(pa.string()))
        cols.update({k: pa.array(v) for k, v in s.columns.items()})
        pq.write_table(pa.table(cols), root / "batches" / f"step_{step}.parquet")
        if logged is not None:
            lines.append(json.dumps({"step": step, "data": logged(step, s)}))
    if lines:
        (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root


_VOCAB = np.array(["".join(chr(97 + c) for c in np.random.default_rng(k).integers(0, 26, 2 + k % 6)) for k in range(400)])


def _words(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` tokens of random words (each with its leading space): text that does not repeat."""
    return [" " + w for w in rng.choice(_VOCAB, n)]


def healthy_logs(step: int, s: StepArrays) -> dict:
    """What a healthy trainer with rollout IS enabled logs besides the batch."""
    return {"rollout_corr/rollout_is_eff_sample_size": 0.97 + 0.005 * np.sin(step), "timing/step": 30.0 + step}
