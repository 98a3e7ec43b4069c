"""The compare command seen from the app: run it, and lay out its numbers."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

#: the summary keys of a comparison, with the words the app shows for them
SUMMARY_LABELS = {
    "steps": "steps compared",
    "tokens": "tokens compared",
    "sign_agreement": "sign agreement",
    "sign_flip_fraction": "sign flips",
    "pearson_mean": "Pearson (mean over steps)",
    "spearman_mean": "Spearman (mean over steps)",
    "adv_mean_abs_change": "mean |Δ advantage|",
    "weight_mean_abs_change": "mean |Δ effective weight|",
    "groups": "groups",
    "groups_signal_only_a": "groups with signal only in A",
    "groups_signal_only_b": "groups with signal only in B",
}


def available() -> bool:
    """Whether this rldiag has the compare command."""
    return importlib.util.find_spec("rldiag.analysis.compare") is not None


def run_compare(run: str | Path, a: str, b: str, steps: str | None = None,
                progress: Callable[[int, int, int], None] | None = None):
    """``rldiag compare RUN A B [--steps STEPS]`` (both scenarios must exist; nothing is recomputed)."""
    from rldiag.analysis.compare import compare

    return compare(run, a, b, steps=steps, recompute_missing=False, progress=progress)


def summary_rows(summary: dict) -> list[dict]:
    """The comparison's summary as ``{"quantity", "value"}`` rows in a fixed order."""
    return [{"quantity": label, "value": summary.get(key)} for key, label in SUMMARY_LABELS.items() if key in summary]
