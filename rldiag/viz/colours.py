"""The app's one colour convention for quantities with a neutral value, declared once.

A quantity with a sign (advantages, rewards, the per-token reference KL; ratios and IS weights
around 1) is drawn on one diverging scale centred on its neutral value, and one direction means one
sign everywhere: **blue above the neutral value (positive), red below (negative)**, white at it. The
heat strips and heatmaps (plotly's ``RdBu``: red at the low end, blue at the high end), the token
text (:func:`signed_rgba`), the ECharts panels (:data:`ECHARTS_DIVERGING`) and the sweep's heatmap
(centred on the run's own value: blue above it, red below) all read it from here; so do the words
that explain them (:func:`legend`).
"""

from __future__ import annotations

import math

#: RGB of the positive end (above the neutral value) and of the negative end
POSITIVE_RGB = (33, 102, 172)  # #2166ac, RdBu's blue end
NEGATIVE_RGB = (178, 24, 43)  # #b2182b, RdBu's red end
POSITIVE = "#2166ac"
NEGATIVE = "#b2182b"
#: plotly's name of the scale: red at zmin, white at the middle, blue at zmax (never reversed)
DIVERGING = "RdBu"
#: the same three stops for ECharts' visualMap (low -> high)
ECHARTS_DIVERGING = [NEGATIVE, "#f7f7f7", POSITIVE]

#: per-token quantity (a scenario's tokens column) -> (label, neutral value): every one on DIVERGING
QUANTITIES: dict[str, tuple[str, float]] = {
    "advantages": ("advantage", 0.0),
    "ratio": ("ratio π/π_old", 1.0),
    "rollout_is_weights": ("IS weight", 1.0),
    "ref_kl": ("ref KL", 0.0),
    "token_level_rewards": ("reward", 0.0),
}


def signed_rgba(v: float | None, centre: float, span: float, alpha: float = 0.85) -> str:
    """A CSS colour for ``v``: blue above ``centre``, red below, full strength (``alpha``) at
    ``span`` from it, transparent at it or for a missing value."""
    if v is None or not math.isfinite(v) or span <= 0:
        return "transparent"
    t = max(-1.0, min(1.0, (v - centre) / span))
    r, g, b = POSITIVE_RGB if t >= 0 else NEGATIVE_RGB
    return f"rgba({r},{g},{b},{abs(t) * alpha:.3f})"


def legend(label: str, centre: float) -> str:
    """The words under a coloured view: ``advantage: blue above 0, red below``."""
    return f"{label}: blue above {centre:g}, red below"
