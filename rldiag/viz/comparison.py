"""The compare command seen from the app: its numbers laid out (:func:`rldiag.api.compare` runs it)."""

from __future__ import annotations

import polars as pl

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


def redraw_due(done: int, total: int, updates: int = 10) -> bool:
    """Whether the streamed view is redrawn after ``done`` of ``total`` steps: about ``updates``
    times over the compare (every step of a short one), not after the last (the saved result is
    drawn then)."""
    return 0 < done < total and done % max(1, total // updates) == 0


def partial_view(agreements: list) -> tuple[list[dict], pl.DataFrame]:
    """The summary rows and the per-step frame (as :func:`rldiag.viz.charts.agreement_figure`
    takes it) of the steps compared so far (:class:`rldiag.api.TokenAgreement`)."""
    from rldiag import api

    summary, frame = api.compare_so_far(agreements)
    return summary_rows(summary), frame


def summary_rows(summary: dict) -> list[dict]:
    """The comparison's summary as ``{"quantity", "value"}`` rows in a fixed order."""
    return [{"quantity": label, "value": summary.get(key)} for key, label in SUMMARY_LABELS.items() if key in summary]
