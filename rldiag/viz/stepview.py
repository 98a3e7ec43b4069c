"""Small helpers of the step page: row labels and the settings a scenario was computed with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROLLOUT_N = "actor_rollout_ref.rollout.n"


def row_label(row: Mapping[str, Any]) -> str:
    """``row 3 · uid s1-p0 · score 1 · 24 tokens (5 tool)`` for a row of ``Store.step_rows``."""
    score = row.get("score_total")
    score_s = "–" if score is None else f"{score:.4g}"
    tool = row.get("tool_tokens") or 0
    return (f"row {row['row']} · uid {row['uid']} · score {score_s} · {row['length']} tokens"
            + (f" ({tool} tool)" if tool else ""))


def scenario_settings(meta: Mapping[str, Any] | None, run_values: Mapping[str, Any]) -> dict[str, Any]:
    """The run's settings (config keys included) under the scenario's resolved ones."""
    out = dict(run_values)
    out.update((meta or {}).get("settings", {}) or {})
    return out


def rollout_n(settings: Mapping[str, Any]) -> int | None:
    """``actor_rollout_ref.rollout.n`` when the run's config gives it."""
    v = settings.get(ROLLOUT_N)
    try:
        return int(v) if v is not None and not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None


def interesting_row(rows) -> int:
    """The row the step page opens on: one with a tool span and a nonzero score, else one with a
    tool span, else the first. ``rows`` is ``Store.step_rows`` (a polars frame)."""
    best = None
    for r in rows.iter_rows(named=True):
        if r["tool_tokens"] and r["score_total"]:
            return r["row"]
        if r["tool_tokens"] and best is None:
            best = r["row"]
    if best is not None:
        return best
    return rows["row"][0] if rows.height else 0
