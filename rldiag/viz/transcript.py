"""The Rollouts page's pieces: one row's transcript as HTML, the filter its widgets make, and
the tables beside it.

Pure layout, no I/O: the transcript is the prompt, then the response cut into its turns (runs of
actor tokens, ``response_mask`` 1) and tool observations (mask 0, on grey), one ``<span>`` per
token with its text escaped, each actor token coloured by the quantity picked: the app's one
diverging convention for signed quantities (:mod:`rldiag.viz.colours`: blue above the neutral
value, red below), one hue from 0 for a non-negative one (the loss weight).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rldiag.viz.colours import legend, signed_rgba

if TYPE_CHECKING:
    import polars as pl


@dataclass(frozen=True)
class Quantity:
    """A per-token quantity the transcript is coloured by."""

    label: str
    column: str  # the step's per-token column (``rldiag.api.step_tokens``), or GAP for the mismatch gap
    centre: float  # the neutral value
    signed: bool  # diverging around ``centre`` (else one hue from ``centre`` up)
    help: str


#: the rollout-vs-trainer log-prob gap (``rldiag.api.mismatch_tokens``' ``gap``), not a tokens column
GAP = "gap"
QUANTITIES: dict[str, Quantity] = {
    "advantage": Quantity("advantage", "advantages", 0.0, True, "the token's advantage"),
    "ratio": Quantity("ratio π/π_old", "ratio", 1.0, True, "the PPO ratio the policy loss uses"),
    "is_weight": Quantity("IS weight", "rollout_is_weights", 1.0, True,
                          "the rollout importance weight (a scenario with algorithm.rollout_correction.rollout_is)"),
    "rollout_kl": Quantity("rollout KL (gap)", GAP, 0.0, True,
                           "old_log_probs - rollout_log_probs: the trainer's log-prob minus the rollout engine's"),
    "loss_weight": Quantity("loss weight", "loss_weight", 0.0, False, "the token's weight in actor/pg_loss"),
}
#: the table's column of each row's response text (``rldiag.api.rows(..., preview=N)``)
PREVIEW = "response"
PREVIEW_COLUMN = PREVIEW
ONE = (230, 120, 20)  # orange: one hue from 0 (a non-negative quantity)
#: the Rollouts table's columns, first those that say most about a row (then the others in their order)
LEAD_COLUMNS = ("step", "row", "uid", "response", "length", "turns", "score", "score_captured", "rescore_failed",
                "reward", "advantage_mean",
                "other_advantage_mean", "is_weight_seq", "rollout_kl", "loss_weight", "group_has_signal")
#: the group table's columns (the rows of one uid at one step)
GROUP_COLUMNS = ("row", "score", "score_captured", "reward", "advantage_mean", "other_advantage_mean", "length", "is_weight_seq",
                 "response")
#: the trajectory table's columns (the rows of one traj_uid, in step_index order)
TRAJECTORY_COLUMNS = ("step_index", "row", "uid", "score", "advantage_mean", "other_advantage_mean", "length",
                      "turns", "response")


def colour(v: float | None, centre: float, span: float, signed: bool = True) -> str:
    """A token's background: transparent at ``centre`` (or without a value), full colour at
    ``span`` from it; when ``signed`` the app's convention (blue above, red below:
    :func:`rldiag.viz.colours.signed_rgba`), else orange above only."""
    if v is None or not math.isfinite(v) or span <= 0:
        return "transparent"
    t = max(-1.0, min(1.0, (v - centre) / span))
    if t == 0 or (not signed and t < 0):
        return "transparent"
    if signed:
        return signed_rgba(v, centre, span)
    r, g, b = ONE
    return f"rgba({r},{g},{b},{t * 0.85:.3f})"


def _show(tok: str) -> str:
    """A token's text for the page: escaped, newlines and tabs kept visible."""
    return html.escape(tok).replace("\n", "⏎<br>").replace("\t", "⇥")


def segments(mask: Sequence[int]) -> list[tuple[str, int, int]]:
    """The response cut into ``(kind, start, end)`` runs: ``"turn"`` (mask 1) or ``"tool"`` (mask 0)."""
    out: list[tuple[str, int, int]] = []
    for i, m in enumerate(mask):
        kind = "tool" if m == 0 else "turn"
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1], i + 1)
        else:
            out.append((kind, i, i + 1))
    return out


def values_at(length: int, positions: Sequence[int], values: Sequence[float | None]) -> list[float | None]:
    """Values known at some positions (the mismatch gap, actor tokens only) as a row's list."""
    out: list[float | None] = [None] * length
    for p, v in zip(positions, values):
        if 0 <= int(p) < length:
            out[int(p)] = v
    return out


_BOX = ("font-family: monospace; line-height: 1.9; white-space: pre-wrap; border-left: 3px solid {c}; "
        "padding: 2px 8px; margin: 4px 0")
_HEAD = "font-size: 0.75em; color: #555; font-family: sans-serif"


def transcript_html(prompt: Sequence[str] | None, tokens: Sequence[str] | None, mask: Sequence[int],
                    values: Sequence[float | None] | None = None, quantity: str | None = None) -> str:
    """One row as HTML: the prompt (its text, or "no prompt text"), then the response turn by turn,
    one ``<span class="tok">`` per token (``tokens`` None: the response has no text, each token a
    ``·``), coloured by ``values`` (``quantity`` a key of :data:`QUANTITIES`); tool observations
    (mask 0) on grey, ``class="tok tool"``, uncoloured."""
    q = QUANTITIES.get(quantity or "")
    n = len(mask)
    text = list(tokens) if tokens is not None else ["·"] * n
    text += ["·"] * (n - len(text))
    vals = list(values) if values is not None else []
    vals += [None] * (n - len(vals))
    finite = [abs(v - q.centre) for v, m in zip(vals, mask) if m and v is not None and math.isfinite(v)] if q else []
    span = max(finite, default=0.0)
    out = ['<div class="rldiag-transcript">',
           f'<div style="{_HEAD}">prompt</div><div class="prompt" style="{_BOX.format(c="#888")}">']
    out.append("".join(_show(t) for t in prompt) if prompt else '<i style="color: #777">no prompt text</i>')
    out.append("</div>")
    turn = 0
    for kind, a, b in segments(mask):
        if kind == "turn":
            turn += 1
            out.append(f'<div style="{_HEAD}">turn {turn}</div><div class="turn" style="{_BOX.format(c="#1f77b4")}">')
        else:
            out.append(f'<div style="{_HEAD}">tool observation (not trained on)</div>'
                       f'<div class="tool-obs" style="{_BOX.format(c="#bbb")}; background: #f0f0f0; color: #666">')
        for i in range(a, b):
            v = vals[i]
            tip = f"token {i}"
            if kind == "tool":
                out.append(f'<span class="tok tool" title="{tip} · tool (mask 0)" style="color: #777">{_show(text[i])}</span>')
                continue
            if q is not None and v is not None:
                tip += f" · {q.label} {v:.4g}"
            bg = colour(v, q.centre, span, q.signed) if q is not None else "transparent"
            out.append(f'<span class="tok" title="{html.escape(tip)}" style="background: {bg}">{_show(text[i])}</span>')
        out.append("</div>")
    if not n:
        out.append('<i style="color: #777">an empty response</i>')
    out.append("</div>")
    if q is not None and span > 0:
        scale = legend(q.label, q.centre) if q.signed else f"{q.label}: orange above {q.centre:g}"
        out.append(f'<div style="{_HEAD}">{html.escape(scale)}; full colour at {span:.3g} from '
                   f"{q.centre:g}; grey: tool observation</div>")
    return "".join(out)


# ---- the filter --------------------------------------------------------------------------------


def sql_string(value: Any) -> str:
    """A SQL string literal of ``value`` (quotes doubled)."""
    return "'" + str(value).replace("'", "''") + "'"


def filter_expression(ranges: Mapping[str, tuple[float | None, float | None]] | None = None, *,
                      cap: int | None = None, no_signal: bool = False, sign_differs: str | None = None,
                      where: str | None = None) -> str | None:
    """The ``where`` of :func:`rldiag.rows` the page's widgets make: each column's ``(min, max)``
    range (None: open), the rows at the length cap ``cap``, those of groups without signal, the
    expression ``sign_differs`` (:data:`rldiag.store.rows.SIGN_DIFFERS` through the page), and
    the typed ``where``, joined by AND (None: no filter)."""
    parts = []
    for col, (lo, hi) in (ranges or {}).items():
        name = '"' + col.replace('"', '""') + '"'
        if lo is not None:
            parts.append(f"{name} >= {float(lo)!r}")
        if hi is not None:
            parts.append(f"{name} <= {float(hi)!r}")
    if cap is not None:
        parts.append(f"length = {int(cap)}")
    if no_signal:
        parts.append("group_has_signal = 0")
    if sign_differs:
        parts.append(f"({sign_differs})")
    if where and where.strip():
        parts.append(f"({where.strip()})")
    return " AND ".join(parts) or None


# ---- tables ------------------------------------------------------------------------------------


#: the Rollouts table's columns shown by default (they fit a 1,400 px page); the others on demand
DEFAULT_TABLE_COLUMNS = ("step", "row", "uid", "response", "length", "score", "advantage_mean",
                         "other_advantage_mean", "is_weight_seq", "rollout_kl", "group_has_signal")
#: the Groups table's columns shown by default (``rldiag.api.rows(..., group_by=...)``)
GROUP_TABLE_COLUMNS = ("step", "uid", "data_source", "rows", "response", "clipped_tokens_sum", "length_sum",
                       "score_mean", "advantage_mean_mean", "group_has_signal_mean")


def visible_columns(columns: Sequence[str], default: Sequence[str], more: Sequence[str], sort: str | None) -> list[str]:
    """The columns a table shows: ``default``'s it has, then ``more`` (picked on demand), then the
    sort column (``-col`` too; a group's ``col_sum`` / ``col_mean`` for a plain name), always shown."""
    cols = pick(columns, default) + [c for c in more if c in columns and c not in default]
    if sort:
        key = sort.lstrip("-")
        hit = next((c for c in (key, f"{key}_sum", f"{key}_mean") if c in columns), None)
        if hit is not None and hit not in cols:
            cols.append(hit)
    return cols


def table_columns(columns: Sequence[str]) -> list[str]:
    """The Rollouts table's column order: :data:`LEAD_COLUMNS` first, then the others."""
    lead = [c for c in LEAD_COLUMNS if c in columns]
    return lead + [c for c in columns if c not in lead]


def pick(columns: Sequence[str], wanted: Sequence[str]) -> list[str]:
    """The ``wanted`` columns a frame has, in ``wanted``'s order."""
    return [c for c in wanted if c in columns]


def shown(frame: pl.DataFrame, wanted: Sequence[str] | None = None) -> pl.DataFrame:
    """A table to show: ``wanted``'s columns (None: every column, :func:`table_columns`' order),
    the response preview left out when no row has text."""
    cols = table_columns(frame.columns) if wanted is None else pick(frame.columns, wanted)
    if PREVIEW in cols and frame[PREVIEW].null_count() == frame.height:
        cols.remove(PREVIEW)
    return frame.select(cols)


def row_label(r: Mapping[str, Any]) -> str:
    """A row in the picker: ``step 3 · row 5 · uid … · score 1 · adv 0.41``."""
    parts = [f"step {r.get('step')}", f"row {r.get('row')}"]
    if r.get("uid") is not None:
        parts.append(f"uid {r['uid']}")
    for key, short in (("score", "score"), ("advantage_mean", "adv")):
        v = r.get(key)
        if isinstance(v, (int, float)) and v is not None:
            parts.append(f"{short} {v:.3g}")
    return " · ".join(parts)


def pages(count: int, size: int) -> int:
    """How many pages of ``size`` rows ``count`` rows fill (at least one)."""
    return max(1, -(-int(count) // int(size)))
