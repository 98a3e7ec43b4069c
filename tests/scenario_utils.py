"""Comparing two scenario directories written by different executors or stores."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

#: scenario.json fields that say how and when a scenario was made, not what it holds
RUN_FIELDS = {"name", "created", "seconds", "device", "executor", "outputs"}


def scenario_files(d: Path) -> tuple[dict, dict[str, object]]:
    meta = json.loads((d / "scenario.json").read_text())
    tokens = {p.name: pq.read_table(p) for p in sorted((d / "tokens").glob("step_*.parquet"))} if (d / "tokens").is_dir() else {}
    return meta, tokens


def assert_same_scenario(a: Path, b: Path) -> dict:
    """metrics.parquet identical (every value, bit for bit), the same tokens files with identical
    tables, scenario.json equal but for :data:`RUN_FIELDS`. Returns scenario.json of ``a``."""
    ma, ta = scenario_files(a)
    mb, tb = scenario_files(b)
    metrics_a, metrics_b = pq.read_table(a / "metrics.parquet"), pq.read_table(b / "metrics.parquet")
    assert metrics_a.column_names == metrics_b.column_names
    assert metrics_a.num_rows == metrics_b.num_rows == len(ma["steps_done"])
    for name in metrics_a.column_names:
        assert metrics_a[name].to_pylist() == metrics_b[name].to_pylist(), name
    assert metrics_a.equals(metrics_b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].equals(tb[name]), name
    assert {k: v for k, v in ma.items() if k not in RUN_FIELDS} == {k: v for k, v in mb.items() if k not in RUN_FIELDS}
    return ma
