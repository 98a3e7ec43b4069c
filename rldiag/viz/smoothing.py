"""EMA smoothing for display, TensorBoard's way: weight ``w`` in [0, 1), debiased."""

from __future__ import annotations

import polars as pl


def ema(frame: pl.DataFrame, columns: list[str], weight: float, by: str = "metric", order: str = "step") -> pl.DataFrame:
    """``frame`` with each of ``columns`` replaced by its EMA along ``order`` within each ``by``.

    ``weight`` 0 returns the frame unchanged; nulls (a source without that step) stay null and
    do not take part in the average.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    if weight == 0.0 or frame.is_empty():
        return frame
    frame = frame.sort([by, order])
    alpha = 1.0 - weight
    exprs = []
    for c in columns:
        smoothed = pl.col(c).ewm_mean(alpha=alpha, adjust=True, ignore_nulls=True).over(by)
        exprs.append(pl.when(pl.col(c).is_null()).then(None).otherwise(smoothed).alias(c))
    return frame.with_columns(exprs)
