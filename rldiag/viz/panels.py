"""What the metric panels show besides the lines: runs overlaid, lines that hide each other,
a panel's data as CSV. Pure functions over the store's ``step, metric, <source>...`` frames."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import polars as pl

KEYS = ("step", "metric")


def run_labels(paths: list[str]) -> dict[str, str]:
    """A short, distinct label per run directory (its name; with its parent when names repeat)."""
    names = {p: Path(p).name or p for p in paths}
    out = {}
    for p, n in names.items():
        clash = sum(1 for q in names.values() if q == n) > 1
        out[p] = f"{Path(p).parent.name}/{n}" if clash else n
    return out


def merge_runs(main: pl.DataFrame, main_sources: dict[str, str],
               others: Mapping[str, tuple[pl.DataFrame, dict[str, str]]]) -> tuple[pl.DataFrame, dict[str, str]]:
    """The main run's joined frame with other runs' joined frames beside it, by step and metric.

    ``others``: run label -> (its joined frame, its legend name -> column). Their columns are
    renamed ``<label> · <name>``; returns the merged frame and the legend of every source.
    """
    frame, sources = main.select([c for c in main.columns if c in KEYS or c in main_sources.values()]), dict(main_sources)
    for label, (f, cols) in others.items():
        if f.is_empty():
            continue
        renamed = {col: f"{label} · {name}" for name, col in cols.items() if col in f.columns}
        part = f.select([*KEYS, *renamed]).rename(renamed)
        frame = frame.join(part, on=list(KEYS), how="full", coalesce=True)
        sources.update({v: v for v in renamed.values()})
    return frame.sort(list(KEYS)), sources


def identical_sources(joined: pl.DataFrame, sources: dict[str, str]) -> list[tuple[str, str, list[str]]]:
    """Pairs of sources whose lines coincide: ``(a, b, metrics)`` where, on every step both
    have, their values are equal (NaN equal to NaN) -- one line hides the other there."""
    if joined.is_empty():
        return []
    labels = [(n, c) for n, c in sources.items() if c in joined.columns]
    out = []
    for i, (na, ca) in enumerate(labels):
        for nb, cb in labels[i + 1:]:
            both = joined.filter(pl.col(ca).is_not_null() & pl.col(cb).is_not_null())
            if both.is_empty():
                continue
            same = (pl.col(ca) == pl.col(cb)) | (pl.col(ca).is_nan() & pl.col(cb).is_nan())
            per = both.group_by("metric").agg(same.all().alias("same")).filter("same")
            if not per.is_empty():
                out.append((na, nb, sorted(per["metric"].to_list())))
    return out


def overlap_note(pairs: list[tuple[str, str, list[str]]], limit: int = 3) -> str | None:
    """A sentence naming the lines drawn on top of each other (None: none are)."""
    if not pairs:
        return None
    parts = []
    for a, b, metrics in pairs:
        more = f" and {len(metrics) - limit} more" if len(metrics) > limit else ""
        shown = ", ".join(f"`{m}`" for m in metrics[:limit]) + more
        parts.append(f"**{a}** and **{b}** are identical on {shown}")
    return "; ".join(parts) + ": one line lies exactly on the other."


def panel_csv(joined: pl.DataFrame, metric: str, sources: dict[str, str]) -> bytes:
    """One panel's data (full resolution) as CSV: ``step, <source>...``."""
    f = joined.filter(pl.col("metric") == metric)
    cols = {c: n for n, c in sources.items() if c in f.columns}
    extra = [c for c in ("wall_time",) if c in f.columns]
    return f.select("step", *extra, *cols).rename(cols).sort("step").write_csv().encode()
