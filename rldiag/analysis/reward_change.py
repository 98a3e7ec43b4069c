"""What a re-scored run changed (``rldiag compare RUN baseline reward=<NAME>``): the rows whose score
changed (count, share, by data source), the groups that gained or lost signal, the rows whose
advantage changed sign, and the tokens whose gradient weight changed most, with their text.

Read from the two scenarios' per-row tables (``score``, ``advantage_mean``,
``group_has_signal``; the rescore's ``score_captured``) and, for the tokens, their per-token
outputs where both have them (a rescore with ``--save-tokens``; the baseline recomputed with
them by ``compare``): the gradient weight is the one definition of
:mod:`rldiag.engine.gradient_weight`, ``|A| x w``, from the saved ``advantages`` and
``loss_weight`` (the clip indicator is not among the saved outputs, so it is the weight before
the clip).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rldiag.engine.gradient_weight import gradient_weight
from rldiag.errors import RunDirError
from rldiag.io.arrays import read_parquet, to_numpy
from rldiag.io.fs import RemotePath
from rldiag.io.loader import read_schema, read_table
from rldiag.io.rundir import RunDir, Steps, parse_steps
from rldiag.scenario.tokens import RESCORED_KEY, read_meta

__all__ = ["RewardChange", "reward_changes"]

#: tokens listed, at most
TOP_TOKENS = 10


@dataclass
class RewardChange:
    """Side ``b`` against side ``a`` (one of them a rescore)."""

    a: str
    b: str
    rows: int = 0
    score_changed: int = 0
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)  # data source -> rows, changed
    groups: int = 0
    gained_signal: int = 0  # groups with signal in b, none in a
    lost_signal: int = 0
    sign_flips: int = 0  # rows whose mean advantage has the other sign (both non-zero)
    #: the tokens whose gradient weight changed most: step, row, position, token text, weights a and b
    top_tokens: list[dict[str, Any]] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # steps whose tokens both sides have

    @property
    def share_changed(self) -> float:
        return self.score_changed / self.rows if self.rows else 0.0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {**asdict(self), "share_changed": self.share_changed}


def _rows(run: Path | RemotePath, name: str, step: int) -> pa.Table | None:
    path = RunDir(run).layout.scenario(name).rows_file(step)
    return read_parquet(path) if path.is_file() else None


def _tokens(run: Path | RemotePath, name: str, step: int) -> pa.Table | None:
    path = RunDir(run).layout.scenario(name).tokens_file(step)
    return read_parquet(path, ["advantages", "loss_weight"]) if path.is_file() else None


def _weights(t: pa.Table) -> np.ndarray:
    import pyarrow.compute as pc

    adv = to_numpy(pc.list_flatten(t["advantages"].combine_chunks())).astype(np.float32)
    w = to_numpy(pc.list_flatten(t["loss_weight"].combine_chunks())).astype(np.float32)
    return gradient_weight(torch.from_numpy(adv), torch.from_numpy(w)).numpy()


def reward_changes(run: str | Path | RemotePath, a: str, b: str, steps: Steps = None, top: int = TOP_TOKENS
                   ) -> RewardChange | None:
    """What ``b`` changed against ``a`` when either is a rescored scenario (None otherwise)."""
    rd = RunDir(run)
    metas = {n: read_meta(rd.path, n) for n in (a, b)}
    if not any(m is not None and RESCORED_KEY in m for m in metas.values()):
        return None
    for n, m in metas.items():
        if m is None:
            raise RunDirError(f"no scenario {n!r} in {rd.path}")
    files = {sf.step: sf for sf in rd.require_steps()}
    out = RewardChange(a, b)
    candidates: list[tuple[float, dict[str, Any]]] = []
    for step in parse_steps(steps, sorted(files)):
        ra, rb = _rows(rd.path, a, step), _rows(rd.path, b, step)
        if ra is None or rb is None or ra.num_rows != rb.num_rows:
            continue
        sa, sb = (to_numpy(t["score"].combine_chunks()) for t in (ra, rb))
        changed = np.float32(sa) != np.float32(sb)
        sf = files[step]
        names = set(read_schema(sf).names)
        cols = [c for c in ("data_source", "uid", "response_tokens") if c in names]
        batch = read_table(sf, cols)
        sources = batch["data_source"].to_pylist() if "data_source" in names else ["(none)"] * ra.num_rows
        out.rows += ra.num_rows
        out.score_changed += int(changed.sum())
        for src, ch in zip(sources, changed.tolist()):
            rec = out.by_source.setdefault(str(src), {"rows": 0, "changed": 0})
            rec["rows"] += 1
            rec["changed"] += int(ch)
        ga, gb = (to_numpy(t["group_has_signal"].combine_chunks()).astype(bool) for t in (ra, rb))
        uids = batch["uid"].to_pylist()
        first = {u: i for i, u in reversed(list(enumerate(uids)))}  # each group's first row
        idx = np.array(sorted(first.values()), dtype=np.int64)
        out.groups += len(idx)
        out.gained_signal += int((~ga[idx] & gb[idx]).sum())
        out.lost_signal += int((ga[idx] & ~gb[idx]).sum())
        aa, ab = (to_numpy(t["advantage_mean"].combine_chunks()) for t in (ra, rb))
        out.sign_flips += int((np.sign(aa) * np.sign(ab) < 0).sum())
        ta, tb = _tokens(rd.path, a, step), _tokens(rd.path, b, step)
        if ta is None or tb is None or "response_tokens" not in names:
            continue
        out.token_steps.append(step)
        wa, wb = _weights(ta), _weights(tb)
        delta = np.abs(wb - wa)
        lengths = to_numpy(ra["length"].combine_chunks()).astype(np.int64) if "length" in ra.column_names else None
        texts = batch["response_tokens"].to_pylist()
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in texts])])
        if lengths is not None and int(offsets[-1]) != delta.shape[0]:
            continue
        for k in np.argsort(-delta, kind="stable")[:top].tolist():
            row = int(np.searchsorted(offsets, k, side="right") - 1)
            pos = k - int(offsets[row])
            candidates.append((float(delta[k]), {"step": step, "row": row, "position": pos,
                                                  "token": texts[row][pos], "weight_a": float(wa[k]),
                                                  "weight_b": float(wb[k])}))
    candidates.sort(key=lambda c: -c[0])
    out.top_tokens = [c[1] for c in candidates[:top]]
    return out
