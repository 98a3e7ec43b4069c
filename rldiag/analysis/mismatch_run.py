"""The mismatch diagnosis of a run directory: the per-step fingerprints from a recompute's
metrics, the causes (:func:`rldiag.analysis.mismatch.diagnose_mismatch`), and the tokens a person
can check, read back from the batch files (a step at a time).

:func:`step_tokens` gives one step's actor tokens with both log-probs, the gap, its k2 KL, the
row's policy lag and the token's text (when the batch has ``response_tokens``): what the app's
Off-policy page draws.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rldiag.analysis.mismatch import PREFIX, Cause, MismatchDiagnosis, diagnose_mismatch
from rldiag.engine.mismatch import actor_tokens, top_gap_tokens
from rldiag.engine.requirements import mismatch_columns
from rldiag.engine.settings import EngineSettings
from rldiag.engine.stages.mismatch import trainer_column
from rldiag.io.loader import load_step, read_schema, read_table
from rldiag.io.rundir import StepFile

TEXT_COLUMN = "response_tokens"
#: tokens listed per cause as examples
EXAMPLES = 10


def stats_from_rows(rows: Iterable[Mapping[str, Any]]) -> tuple[list[int], dict[str, np.ndarray]]:
    """The steps and ``statistic -> (n_steps,)`` of the ``rldiag/mismatch/*`` values in per-step
    metric rows (``{"step": N, name: value, ...}``, a recompute's ``metrics``); steps without
    them are left out."""
    rows = sorted((r for r in rows if r.get(PREFIX + "tokens") is not None), key=lambda r: int(r["step"]))
    names = sorted({k for r in rows for k in r if k.startswith(PREFIX)})
    stats = {k.removeprefix(PREFIX): np.array([np.nan if r.get(k) is None else float(r[k]) for r in rows])
             for k in names}
    return [int(r["step"]) for r in rows], stats


def _texts(sf: StepFile, rows: np.ndarray, positions: np.ndarray) -> list[str | None]:
    """The text of the tokens at ``(rows[i], positions[i])`` (None without ``response_tokens``)."""
    if TEXT_COLUMN not in read_schema(sf).names or not len(rows):
        return [None] * len(rows)
    col = read_table(sf, [TEXT_COLUMN])[TEXT_COLUMN].combine_chunks()
    out: list[str | None] = []
    for r, p in zip(rows.tolist(), positions.tolist(), strict=True):
        value = col[r].values[p].as_py() if col[r].is_valid else None
        out.append(value)
    return out


def _trainer(batch: Any, settings: EngineSettings) -> torch.Tensor:
    out = getattr(batch, trainer_column(settings))
    assert out is not None  # required by mismatch_columns
    return out


def _lag_of(batch: Any) -> torch.Tensor | None:
    version = batch.extra.get("policy_version")
    if version is None:
        return None
    return torch.full_like(version, batch.steps[0] - 1) - version.to(torch.long)


def top_tokens(sf: StepFile, settings: EngineSettings, k: int = EXAMPLES) -> list[dict[str, Any]]:
    """The ``k`` actor tokens of step ``sf`` with the largest gap (by ``d^2 / 2``): step, row,
    position, both log-probs, the gap, the token's share of the step's summed KL, its text."""
    data = load_step(sf, settings, mismatch_columns(settings))
    b = data.batch
    assert b.rollout_log_probs is not None  # required by the plan
    mask = b.loss_mask if b.loss_mask is not None else b.response_mask
    top = top_gap_tokens(_trainer(b, settings), b.rollout_log_probs, mask, b.rows, b.step_ids, 1, k)
    rows, pos = top.row.numpy(), top.pos.numpy()
    texts = _texts(sf, rows, pos)
    lag = _lag_of(b)
    return [{"step": sf.step, "row": int(r), "position": int(p), "token": t, "old_log_prob": float(o),
             "rollout_log_prob": float(y), "gap": float(o - y), "kl_share": round(float(s), 4),
             **({"policy_lag": int(lag[int(r)])} if lag is not None else {})}
            for r, p, t, o, y, s in zip(rows, pos, texts, top.old.numpy(), top.rollout.numpy(), top.share.numpy(),
                                        strict=True)]


def _example_steps(cause: Cause, steps: Sequence[int], stats: Mapping[str, np.ndarray]) -> list[int]:
    """The steps whose tokens illustrate ``cause``: its most confident steps (by the share of
    the KL in the top tokens for outlier_tokens, else by the k2 KL), at most two."""
    chosen = cause.steps or list(steps)
    key = "top_kl_share" if cause.cause == "outlier_tokens" else "kl_k2"
    values = dict(zip(steps, stats.get(key, np.zeros(len(steps))), strict=True))
    return sorted(chosen, key=lambda s: -np.nan_to_num(values.get(s, 0.0)))[:2]


def add_examples(diag: MismatchDiagnosis, files: Mapping[int, StepFile], settings: EngineSettings,
                 stats: Mapping[str, np.ndarray], k: int = EXAMPLES) -> MismatchDiagnosis:
    """Each cause's example tokens, read from its illustrating steps' batch files."""
    cache: dict[int, list[dict[str, Any]]] = {}
    for cause in diag.causes:
        tokens: list[dict[str, Any]] = []
        for step in _example_steps(cause, diag.steps, stats):
            if step in files:
                if step not in cache:
                    cache[step] = top_tokens(files[step], settings, k)
                tokens += cache[step]
        cause.examples = sorted(tokens, key=lambda t: -t["kl_share"])[:k]
    return diag


def diagnose_rows(rows: Iterable[Mapping[str, Any]], settings: Mapping[str, Any],
                  files: Mapping[int, StepFile] | None = None, engine_settings: EngineSettings | None = None,
                  k: int = EXAMPLES) -> MismatchDiagnosis:
    """The diagnosis of a recompute's per-step metric rows; with ``files`` (step -> batch file)
    and ``engine_settings``, each cause lists example tokens."""
    steps, stats = stats_from_rows(rows)
    diag = diagnose_mismatch(steps, stats, settings)
    if files is not None and engine_settings is not None:
        add_examples(diag, files, engine_settings, stats, k)
    return diag


def step_tokens(sf: StepFile, settings: EngineSettings) -> pa.Table:
    """One step's actor tokens: ``row``, ``position``, ``old_log_prob``, ``rollout_log_prob``,
    ``gap`` (old - rollout), ``kl`` (``gap^2 / 2``), ``kl_share`` (of the step's sum), the next
    and previous trainer log-probs in the row (``old_next`` / ``old_prev``, NaN at a row's end or
    next to a masked token), ``policy_lag`` (with ``policy_version``) and ``token`` (with text)."""
    data = load_step(sf, settings, mismatch_columns(settings))
    b = data.batch
    assert b.rollout_log_probs is not None
    mask = b.loss_mask if b.loss_mask is not None else b.response_mask
    t = actor_tokens(_trainer(b, settings), b.rollout_log_probs, mask, b.rows, b.step_ids)
    kl = 0.5 * t.d * t.d
    total = float(kl.sum())
    adj = (t.row[1:] == t.row[:-1]) & (t.pos[1:] == t.pos[:-1] + 1)
    nan = torch.full((1,), float("nan"), dtype=torch.float64)
    old_next = torch.cat([torch.where(adj, t.x[1:], nan), nan])
    old_prev = torch.cat([nan, torch.where(adj, t.x[:-1], nan)])
    cols: dict[str, Any] = {
        "row": t.row.numpy(), "position": t.pos.numpy(), "old_log_prob": t.x.numpy(), "rollout_log_prob": t.y.numpy(),
        "gap": t.d.numpy(), "kl": kl.numpy(), "kl_share": (kl / total).numpy() if total > 0 else np.zeros(len(kl)),
        "old_next": old_next.numpy(), "old_prev": old_prev.numpy(),
    }
    lag = _lag_of(b)
    if lag is not None:
        cols["policy_lag"] = lag.index_select(0, t.row).numpy()
    if TEXT_COLUMN in read_schema(sf).names:
        text = read_table(sf, [TEXT_COLUMN])[TEXT_COLUMN].combine_chunks()
        flat = text.flatten()
        offsets = np.asarray(text.offsets)
        index = offsets[t.row.numpy()] + t.pos.numpy()
        cols["token"] = flat.take(pa.array(index))
    return pa.table(cols)
