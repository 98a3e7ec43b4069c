"""A response as text, each token coloured by a per-token quantity (advantage, ratio, IS weight,
reference KL), tool observations marked; and the context lines of the step's top tokens.

Pure layout: HTML with every token's text escaped, colours on a diverging scale around the
quantity's neutral value (0 for advantages and KL, 1 for ratios and IS weights).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from rldiag.viz.colours import QUANTITIES, legend, signed_rgba

#: quantity (the scenario's tokens column) -> (label, neutral value): the app's one convention
#: (:mod:`rldiag.viz.colours`), less the reward (a scalar per row, not a token colouring here)
COLOURINGS = {k: v for k, v in QUANTITIES.items() if k != "token_level_rewards"}


def _show(tok: str) -> str:
    """A token's text for the page: escaped, newlines kept visible."""
    return html.escape(tok).replace("\n", "⏎<br>").replace("\t", "⇥")


def token_html(tokens: Sequence[str], mask: Sequence[int], values: Sequence[float | None] | None = None,
               kind: str | None = None) -> str:
    """The response as HTML: one ``<span>`` per token, coloured by ``values`` (``kind`` a key of
    :data:`COLOURINGS`), with tool observations (mask 0) on grey, underlined and labelled."""
    label, centre = COLOURINGS.get(kind or "", ("", 0.0))
    n = len(tokens)
    vals = list(values) if values is not None else [None] * n
    finite = [abs(v - centre) for v in vals if v is not None and math.isfinite(v)]
    span = max(finite, default=0.0)
    out = ['<div class="rldiag-text" style="font-family: monospace; line-height: 1.9; white-space: pre-wrap">']
    in_tool = False
    for i, tok in enumerate(tokens):
        m = mask[i] if i < len(mask) else 1
        tool = m == 0
        if tool and not in_tool:
            out.append('<span style="font-size: 0.7em; color: #555; border: 1px solid #999; border-radius: 3px; '
                       'padding: 0 2px; margin-right: 2px">tool</span>')
        in_tool = tool
        v = vals[i] if i < len(vals) else None
        tip = f"token {i}" + (f" · {label} {v:.4g}" if v is not None and label else "") + (" · tool (mask 0)" if tool else "")
        style = ("background: #e6e6e6; color: #555; text-decoration: underline dotted" if tool
                 else f"background: {signed_rgba(v, centre, span)}")
        out.append(f'<span title="{html.escape(tip)}" style="{style}">{_show(tok)}</span>')
    out.append("</div>")
    if label and span > 0:
        out.append(f'<div style="font-size: 0.8em; color: #555">{legend(label, centre)}; '
                   f"full colour at ±{span:.3g} from {centre:g}; grey: tool observation (not trained on)</div>")
    return "".join(out)


def context_line(before: Sequence[str], token: str, after: Sequence[str]) -> str:
    """``…before [token] after…`` as plain text, for a table."""
    return f"…{''.join(before or [])}[{token}]{''.join(after or [])}…".replace("\n", "⏎")


def top_rows(frame) -> list[dict]:
    """:meth:`Store.top_tokens` as table rows: row, position, token, value, the token in context."""
    return [{"row": r["row"], "position": r["position"], "token": r["token"], "value": r["value"],
             "in context": context_line(r["before"], r["token"] or "", r["after"])}
            for r in frame.iter_rows(named=True)]
