"""Short human durations for the live status line."""

from __future__ import annotations


def ago(seconds: float) -> str:
    """``3 s ago``, ``4 min ago``, ``2 h ago``, ``3 d ago``."""
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{s:.0f} s ago"
    if s < 3600:
        return f"{s / 60:.0f} min ago"
    if s < 86400:
        return f"{s / 3600:.1f} h ago"
    return f"{s / 86400:.1f} d ago"


def live_line(latest_step: int | None, steps: int, mtime: float | None, now: float) -> str:
    """The status line of the training-metrics page."""
    if latest_step is None or mtime is None:
        return "No logged metrics yet (metrics.jsonl is absent or has no complete line)."
    return f"Latest logged step **{latest_step}** ({steps} steps), written {ago(now - mtime)}."
