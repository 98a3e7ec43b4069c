"""Queries over the rollout IS weights a scenario saved (``rollout_is_weights`` in its tokens)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from rldiag.io.run_layout import ScenarioLayout
from rldiag.store.db import Db
from rldiag.store.stepview import INT_MASK

#: quantiles of the per-token IS weight shown over steps
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def is_weights(db: Db, tokens_file: Path) -> pl.DataFrame:
    """The IS weight of every actor token (post-correction mask 1) of one step: ``row, weight``."""
    return db.frame(
        f"""
        SELECT row, w AS weight FROM (
            SELECT row, unnest(rollout_is_weights) AS w, unnest({INT_MASK}) AS m FROM read_parquet(?, hive_partitioning = false)
        ) WHERE m = 1
        """,
        [str(tokens_file)],
        where=str(tokens_file),
    )


def is_quantiles(db: Db, tokens_dir: Path) -> pl.DataFrame:
    """Per step: ``step, tokens, q05, q25, q50, q75, q95, max`` of the actor tokens' IS weights."""
    qs = ", ".join(f"quantile_cont(w, {q}) AS q{int(round(q * 100)):02d}" for q in QUANTILES)
    glob = str(Path(tokens_dir) / ScenarioLayout.TOKEN_GLOB)
    return db.frame(
        f"""
        SELECT step, count(*) AS tokens, {qs}, max(w) AS max FROM (
            SELECT CAST(regexp_extract(filename, '{ScenarioLayout.TOKEN_STEP_SQL}', 1) AS BIGINT) AS step,
                   unnest(rollout_is_weights) AS w, unnest({INT_MASK}) AS m
            FROM read_parquet(?, hive_partitioning = false, filename = true)
        ) WHERE m = 1 GROUP BY step ORDER BY step
        """,
        [glob],
        where=str(tokens_dir),
    )
