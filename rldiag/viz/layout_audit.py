"""The layout audit seen from the Health page: its tables and the key it is cached on
(:func:`rldiag.api.layout_audit` computes it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def fmt_number(v: float | None) -> str:
    """``0.1079``, ``5.14e-08``; ``-`` for none or NaN."""
    return "-" if v is None or v != v else f"{v:.4g}"

#: what the section says the audit is
ABOUT = ("verl averages or sums its actor and critic metrics over micro-batches, DP ranks and mini-batches, so the "
         "same data logs different numbers under another layout. The run is recomputed under the layouts users "
         "change (its own, one batch per step, micro-batch halved and doubled, DP 1/2/4, dynamic batches on and off, "
         "mini-batch halved, balancing off for the legacy trainer); a metric is layout-dependent when they spread it "
         "by more than 1e-5 of its own value (median over steps).")


def batch_key(files: Iterable[Any]) -> tuple[tuple[str, int, int], ...]:
    """The batch files as ``(name, size, mtime_ns)``: the audit is computed again when one changes.
    ``files``: :class:`~rldiag.io.rundir.StepFile` (``store.batches.files()``)."""
    out = []
    for sf in files:
        st = sf.path.stat()
        out.append((sf.path.name, int(st.st_size), int(st.st_mtime_ns)))
    return tuple(out)


def dependent_rows(result) -> list[dict[str, str]]:
    """One row per layout-dependent metric, largest spread first: its spread, the layouts that
    move it, the layout closest to the log, and why."""
    rows = []
    for m in result.dependent:
        best = "-" if m.best_match is None else f"{m.best_match} ({fmt_number(m.best_match_error)})"
        rows.append({"metric": m.metric, "relative spread": fmt_number(m.relative_spread),
                     "differs under": ", ".join(m.differs_in) or "-", "best match (log)": best, "why": m.why})
    return rows


def layout_rows(result) -> list[dict[str, str]]:
    """One row per layout recomputed: its name, the batch layout in words, the duplicates folded into it."""
    return [{"layout": x.name, "batch layout": x.layout, "same as": ", ".join(x.folded) or "-",
             "failed steps": str(len(x.steps_failed))} for x in result.ran]


def skipped_rows(result) -> list[dict[str, str]]:
    """One row per layout not recomputed, with the reason."""
    return [{"layout": x.name, "why skipped": x.skipped or ""} for x in result.skipped]


def summary_line(result) -> str:
    n_dep = len(result.dependent)
    return (f"{n_dep} of {len(result.metrics)} metrics depend on the layout; {len(result.ran)} layouts recomputed "
            f"over {len(result.steps)} steps, {len(result.skipped)} skipped.")
