"""A finding's trend state: whether what it reports is still going on, over, or moving.

Every finding carries ``evidence.state`` in :data:`STATES` with ``evidence.state_since`` (the step
the state began), decided by :func:`trend_state` from the per-step series the rule read over its
window, which steps are outside the healthy side of its threshold, and which direction is worse:

- ``resolved``: the last :func:`settle_steps` steps (at least 3, and a fifth of the window) are all
  back inside, after at least one step outside; since the first step of that trailing stretch. A
  resolved finding still exists (its rule still fires on the window's statistic): ``rldiag doctor
  --follow`` reports it cleared only when the rule stops firing.
- ``worsening`` / ``improving``: the mean of the last ``k`` steps (``k`` = a fifth of the window,
  at least 3) moved by more than :data:`MOVE` (relative to the larger of the earlier mean and the
  threshold) against / towards the healthy side, compared with the ``k`` steps before; since the
  first of the last ``k`` steps.
- ``ongoing``: otherwise; since the first step of the current stretch outside (the window's first
  step when no step is outside, as for a rule on settings).

:func:`sparkline` keeps the series (at most :data:`SPARK_POINTS` points) and the threshold with
the finding, for the Health page's sparkline.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

STATES = ("ongoing", "resolved", "worsening", "improving")
#: a relative move of the recent mean beyond this counts as worsening / improving
MOVE = 0.25
#: a finding's sparkline keeps at most this many points (evenly spaced, the last one included)
SPARK_POINTS = 120


def settle_steps(n: int) -> int:
    """Steps back inside that make a finding ``resolved`` in a window of ``n`` steps."""
    return max(3, math.ceil(0.2 * n))


def trend_state(steps: np.ndarray, values: np.ndarray, outside: np.ndarray, worse_up: bool,
                threshold: float | None = None) -> tuple[str, int | None]:
    """``(state, state_since)`` of a series (see the module doc).

    Args:
        steps: ``(n,)`` increasing steps.
        values: ``(n,)`` the values the rule compared (absolute values when the rule takes them).
        outside: ``(n,)`` bool, the steps on the unhealthy side of the rule's threshold.
        worse_up: True when larger values are worse.
        threshold: the rule's per-step threshold, the scale of a relative move (None: the values').
    """
    n = len(values)
    if n == 0:
        return "ongoing", None
    steps = np.asarray(steps)
    out = np.asarray(outside, dtype=bool)
    inside_tail = int(np.argmax(out[::-1])) if out.any() else n
    if out.any() and inside_tail >= settle_steps(n):
        return "resolved", int(steps[n - inside_tail])
    k = settle_steps(n)
    if n >= 2 * k:
        late, prev = float(np.mean(values[-k:])), float(np.mean(values[-2 * k:-k]))
        scale = max(abs(prev), abs(threshold) if threshold is not None else 0.0, 1e-12)
        move = (late - prev) / scale * (1.0 if worse_up else -1.0)
        if move > MOVE:
            return "worsening", int(steps[-k])
        if move < -MOVE:
            return "improving", int(steps[-k])
    if not out.any():
        return "ongoing", int(steps[0])
    # the first step of the last stretch outside not broken by a settled stretch inside
    since = int(np.flatnonzero(out)[0])
    gap = 0
    for i in range(n):
        if out[i]:
            if gap >= settle_steps(n):
                since = i
            gap = 0
        else:
            gap += 1
    return "ongoing", int(steps[since])


def sparkline(steps: np.ndarray, values: np.ndarray, threshold: float | None, worse: str,
              metric: str | None) -> dict[str, Any]:
    """``{"metric", "steps", "values", "threshold", "worse"}`` (``worse``: ``above`` or ``below``
    the threshold), at most :data:`SPARK_POINTS` points of the series."""
    n = len(values)
    if n > SPARK_POINTS:
        keep = np.unique(np.linspace(0, n - 1, SPARK_POINTS).round().astype(np.int64))
        steps, values = np.asarray(steps)[keep], np.asarray(values)[keep]
    return {"metric": metric, "steps": [int(s) for s in steps], "values": [float(v) for v in values],
            "threshold": None if threshold is None else float(threshold), "worse": worse}


def state_text(state: str | None, since: int | None) -> str:
    """``resolved since step 16``; empty without a state."""
    if state is None:
        return ""
    return state if since is None else f"{state} since step {since}"
