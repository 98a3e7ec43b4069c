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
    sorted by metric and step. ``points`` is inlined (an integer, never user text).

    One ``GROUP BY metric, bucket`` names the steps to keep (first, last, arg-min, arg-max and
    the first NaN of each column); a semi-join then takes those rows whole."""
    n = max(1, int(points))
    picks = []
    for c in columns:
        q = quote_ident(c)
        finite = f"CASE WHEN isnan({q}) THEN NULL ELSE {q} END"  # NaN sorts above every number
        picks += [
            f"min(step) FILTER (WHERE {q} IS NOT NULL)",
            f"max(step) FILTER (WHERE {q} IS NOT NULL)",
            # one row per extreme, the earliest step among ties: without the step in the key,
            # DuckDB's parallel aggregation returns any of the tied rows (a flat line would keep
            # a different, and more, rows from one query to the next)
            f"arg_min(step, CASE WHEN {finite} IS NULL THEN NULL ELSE struct_pack(v := {finite}, s := step) END)",
            f"arg_max(step, CASE WHEN {finite} IS NULL THEN NULL ELSE struct_pack(v := {finite}, s := -step) END)",
            f"min(step) FILTER (WHERE isnan({q}))",  # a NaN stays a gap in the line
        ]
    if not picks:
        picks = ["min(step)", "max(step)"]
    return f"""
        WITH _src AS MATERIALIZED ({inner}),
        _r AS (SELECT metric, min(step) AS _lo, max(step) - min(step) + 1 AS _span FROM _src GROUP BY metric),
        _keep AS (
            SELECT DISTINCT metric, unnest([{', '.join(picks)}]) AS step
            FROM (SELECT _src.*, floor((step - _lo) * {n} / _span)::BIGINT AS _bucket FROM _src JOIN _r USING (metric))
            GROUP BY metric, _bucket
        )
        SELECT _src.* FROM _src SEMI JOIN _keep USING (metric, step)
        ORDER BY metric, step
    """
