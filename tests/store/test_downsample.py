"""Per-pixel min/max downsampling (M4) in DuckDB: the same extremes, first and last points, and
NaN gaps as the full series, in a bounded number of rows; a short range comes back whole."""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from rldiag.store import Db, Store
from rldiag.store.downsample import m4_sql


def _run(tmp_path, series: dict[str, list[float]]):
    (tmp_path / "batches").mkdir(parents=True, exist_ok=True)
    n = len(next(iter(series.values())))
    with (tmp_path / "metrics.jsonl").open("w") as fh:
        for s in range(n):
            fh.write(json.dumps({"step": s + 1, "data": {k: v[s] for k, v in series.items()}}) + "\n")
    return Store(tmp_path)


def _buckets(steps: np.ndarray, points: int) -> np.ndarray:
    lo, hi = steps.min(), steps.max()
    return np.floor((steps - lo) * points / (hi - lo + 1)).astype(int)


def test_every_bucket_keeps_its_extremes_and_ends(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.normal(size=5000)
    a[1234] = 1e4  # one spike
    store = _run(tmp_path, {"a": a.tolist(), "flat": [1.0] * 5000})
    full = store.joined(["a", "flat"]).filter(metric="a")
    ds = store.joined(["a", "flat"], points=100)
    da = ds.filter(metric="a")
    assert da.height <= 4 * 100 and ds.filter(metric="flat").height <= 2 * 100
    steps, vals = full["step"].to_numpy(), full["logged"].to_numpy()
    kept = dict(zip(da["step"].to_list(), da["logged"].to_list()))
    for b in np.unique(_buckets(steps, 100)):
        sel = _buckets(steps, 100) == b
        s, v = steps[sel], vals[sel]
        assert {s.min(), s.max(), s[v.argmin()], s[v.argmax()]} <= set(kept)
    assert kept[1235] == 1e4 and max(kept.values()) == vals.max() and min(kept.values()) == vals.min()
    # a flat line: its extremes tie on every step, and the earliest step stands for them, so each
    # bucket keeps exactly its first and last step (whatever order DuckDB's threads see the rows in)
    flat = ds.filter(metric="flat")["step"].to_list()
    want = sorted({int(x) for b in np.unique(_buckets(steps, 100))
                   for x in (steps[_buckets(steps, 100) == b].min(), steps[_buckets(steps, 100) == b].max())})
    assert flat == want


def test_a_short_range_is_full_resolution(tmp_path):
    store = _run(tmp_path, {"a": [float(i % 7) for i in range(3000)]})
    got = store.joined(["a"], lo=101, hi=600, points=800)
    assert got["step"].to_list() == list(range(101, 601))
    assert got["logged"].to_list() == store.joined(["a"], lo=101, hi=600)["logged"].to_list()


def test_nan_stays_a_gap_and_does_not_hide_the_maximum(tmp_path):
    v = [0.0] * 1000
    v[10], v[11] = math.nan, 5.0
    store = _run(tmp_path, {"a": v})
    ds = store.joined(["a"], points=10)
    assert ds["logged"].is_nan().sum() == 1 and ds["logged"].fill_nan(None).max() == 5.0


def test_smoothed_frames_downsample_through_duckdb(tmp_path):
    store = _run(tmp_path, {"a": list(np.sin(np.arange(4000) / 50.0))})
    full = store.joined(["a"])
    ds = store.downsample(full, ["logged"], points=50)
    assert ds.height <= 200 and ds["logged"].max() == full["logged"].max()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300), st.integers(1, 40))
def test_m4_keeps_the_envelope_of_any_series(values, points):
    db = Db()
    frame = pl.DataFrame({"step": list(range(len(values))), "metric": ["m"] * len(values), "v": values})
    got = db.frame(m4_sql("SELECT * FROM f", ["v"], points), arrow={"f": frame.to_arrow()})
    assert got.height <= min(len(values), 4 * points)
    assert got["v"].max() == max(values) and got["v"].min() == min(values)
    assert got["step"].min() == 0 and got["step"].max() == len(values) - 1
    assert got["step"].to_list() == sorted(got["step"].to_list())
