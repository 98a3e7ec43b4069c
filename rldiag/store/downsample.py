"""Per-pixel min/max downsampling (M4) of ``step, metric, <source>...`` frames, in DuckDB.

Each metric's steps are cut into ``points`` equal buckets (about one per pixel of a panel's
width); in each bucket a row is kept when it holds, for some source column, the first or last
step that column has in the bucket, or the column's smallest or largest value there. A line
drawn through the kept rows is, pixel for pixel, the line through all of them (Jugel et al.,
"M4: a visualization-oriented time series data aggregation", VLDB 2014), with at most
``4 * columns * points`` rows per metric, however long the run. A bucket with four rows or
fewer keeps them all, so a step range of about ``points`` steps is drawn at full resolution.
"""

from __future__ import annotations

from collections.abc import Sequence

from rldiag.store.db import quote_ident

#: buckets per panel when the caller does not say (a panel is 600-900 px wide)
DEFAULT_POINTS = 800


def m4_sql(inner: str, columns: Sequence[str], points: int) -> str:
    """SQL selecting the M4 rows of ``inner`` (a query with ``step, metric`` and ``columns``),
    sorted by metric and step. ``points`` is inlined (an integer, never user text)."""
    n = max(1, int(points))
    keep = []
    for c in columns:
        q = quote_ident(c)
        finite = f"CASE WHEN isnan({q}) THEN NULL ELSE {q} END"  # NaN sorts above every number
        keep += [
            f"step = min(CASE WHEN {q} IS NOT NULL THEN step END) OVER w",
            f"step = max(CASE WHEN {q} IS NOT NULL THEN step END) OVER w",
            f"step = arg_min(step, {finite}) OVER w",  # one row per extreme, even on a flat line
            f"step = arg_max(step, {finite}) OVER w",
            f"step = min(CASE WHEN isnan({q}) THEN step END) OVER w",  # a NaN stays a gap in the line
        ]
    if not keep:
        keep = ["step = min(step) OVER w", "step = max(step) OVER w"]
    span = "(max(step) OVER m - min(step) OVER m + 1)"
    return f"""
        WITH _src AS ({inner}),
        _b AS (SELECT *, floor((step - min(step) OVER m) * {n} / {span})::BIGINT AS _bucket
               FROM _src WINDOW m AS (PARTITION BY metric))
        SELECT * EXCLUDE (_bucket) FROM _b
        WINDOW w AS (PARTITION BY metric, _bucket)
        QUALIFY {' OR '.join(keep)}
        ORDER BY metric, step
    """
