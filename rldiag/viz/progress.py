"""What a progress bar shows for rldiag's ``progress(done, total, what)`` callbacks (:mod:`rldiag.api`)."""

from __future__ import annotations


def progress_state(done: int, total: int, what: str, label: str) -> tuple[float, str]:
    """(fraction in [0, 1], text) for a progress bar: ``"label: step 12 (3/30)"``."""
    frac = min(1.0, max(0.0, done / total)) if total else 1.0
    return frac, f"{label}: {what} ({done}/{total})"
