"""Saved comparisons (``RUN/rldiag/comparisons/<A>__vs__<B>/``, written by ``rldiag compare``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from rldiag.io.run_layout import ComparisonLayout, RunLayout
from rldiag.store.cache import SigCache, file_sig, local_path
from rldiag.store.db import Db


@dataclass
class SavedComparison:
    a: str
    b: str
    meta: dict  # comparison.json
    metrics: pl.DataFrame  # per metric: steps, mean_a, mean_b, mean_delta, max_abs_delta
    tokens: pl.DataFrame  # per step: the advantages' agreement
    stale: bool  # a side's scenario changed after the comparison was written


def saved_comparison(db: Db, cache: SigCache, run: Path, a: str, b: str) -> SavedComparison | None:
    layout = RunLayout(run)
    c = ComparisonLayout(local_path(layout.comparison(a, b).dir))
    d = c.dir
    meta_sig = file_sig(c.meta)
    if meta_sig is None:
        return None
    sides = [file_sig(local_path(layout.scenario(s).meta)) for s in (a, b) if s != "logged"]
    stale = any(s is None or s.mtime_ns > meta_sig.mtime_ns for s in sides)

    def load() -> SavedComparison:
        meta = json.loads(c.meta.read_text())
        metrics = db.frame(
            "SELECT metric, count(*) AS steps, avg(a) AS mean_a, avg(b) AS mean_b, avg(delta) AS mean_delta, "
            "max(abs(delta)) AS max_abs_delta FROM read_parquet(?, hive_partitioning = false) "
            "GROUP BY metric ORDER BY metric",
            [str(c.metrics)], where=str(d),
        )
        tokens = db.frame("SELECT * FROM read_parquet(?, hive_partitioning = false) ORDER BY step",
                          [str(c.tokens)], where=str(d))
        return SavedComparison(a, b, meta, metrics, tokens, stale=False)

    got = cache.get(("comparison", a, b), meta_sig, load)
    return SavedComparison(got.a, got.b, got.meta, got.metrics, got.tokens, stale)
