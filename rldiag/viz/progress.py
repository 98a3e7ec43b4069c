"""What a progress bar shows for rldiag's ``progress(done, total, step)`` callbacks."""

from __future__ import annotations


def progress_state(done: int, total: int, step: int, label: str) -> tuple[float, str]:
    """(fraction in [0, 1], text) for a progress bar."""
    frac = min(1.0, max(0.0, done / total)) if total else 1.0
    return frac, f"{label}: step {step} ({done}/{total})"
