"""Scenario outputs through DuckDB, joined with the logged values by step and metric name."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest

from rldiag.scenario.recompute import recompute
from rldiag.store import Store

RLOO = "adv_estimator=rloo"


def test_scenario_long_table_is_the_parquet_unpivoted(run):
    store = Store(run)
    assert store.scenario_names() == [RLOO, "baseline"]
    table = pq.read_table(run / "rldiag" / "scenarios" / RLOO / "metrics.parquet").to_pydict()
    frame = store.scenarios.frame(RLOO)
    got = {(r["step"], r["metric"]): r["value"] for r in frame.iter_rows(named=True)}
    # a NaN stays (a gap in a chart: a step whose gradient weight is 0 has no share of it); a null goes
    want = {(s, k): v for k, col in table.items() if k != "step" for s, v in zip(table["step"], col) if v is not None}
    assert got.keys() == want.keys()  # the "key=value" directory adds no partition column
    assert any(math.isnan(v) for v in want.values())
    assert all(got[k] == pytest.approx(want[k], nan_ok=True) for k in want)


def test_logged_and_recomputed_joined_by_step_and_metric(run):
    store = Store(run)
    j = store.joined(["critic/score/mean", "actor/pg_loss", "perf/throughput"], ["baseline", RLOO])
    assert j.columns == ["step", "metric", "logged", "baseline", RLOO]
    rows = {(r["step"], r["metric"]): r for r in j.iter_rows(named=True)}
    base = pq.read_table(run / "rldiag" / "scenarios" / "baseline" / "metrics.parquet").to_pydict()
    for i, s in enumerate(base["step"]):
        r = rows[(s, "critic/score/mean")]
        assert r["baseline"] == pytest.approx(base["critic/score/mean"][i])
        assert r["logged"] == (pytest.approx(0.1 * s) if s <= 3 else None)
        assert rows[(s, "actor/pg_loss")]["logged"] is None  # recomputed only
    assert rows[(2, "perf/throughput")]["logged"] == 102.0 and rows[(2, "perf/throughput")]["baseline"] is None
    # the same score under both estimators; different losses
    assert rows[(1, "critic/score/mean")]["baseline"] == rows[(1, "critic/score/mean")][RLOO]
    assert rows[(1, "actor/pg_loss")]["baseline"] != rows[(1, "actor/pg_loss")][RLOO]
    sub = store.joined(["critic/score/mean"], ["baseline"], 2, 3)
    assert sub["step"].to_list() == [2, 3]


def test_summary_means_and_delta(run):
    store = Store(run)
    s = store.summary(["actor/pg_loss", "critic/score/mean"], ["baseline", RLOO])
    j = store.joined(["actor/pg_loss"], ["baseline", RLOO])
    row = s.filter(s["metric"] == "actor/pg_loss").row(0, named=True)
    assert row["baseline"] == pytest.approx(sum(j["baseline"]) / j.height)
    assert row[f"{RLOO} - baseline"] == pytest.approx(row[RLOO] - row["baseline"])
    assert row["steps logged"] == 0 and row["steps baseline"] == 4


def test_recomputing_a_scenario_invalidates_cached_results(run):
    store = Store(run)
    before = store.joined(["actor/pg_loss"], ["what"]) if "what" in store.scenario_names() else None
    assert before is None
    recompute(run, {"algorithm.adv_estimator": "grpo"}, name="what", save_tokens=True, device="cpu")
    a = store.joined(["actor/pg_loss"], ["what"])["what"].to_list()
    recompute(run, {"algorithm.adv_estimator": "rloo"}, name="what", save_tokens=True, device="cpu", reuse=False)
    b = store.joined(["actor/pg_loss"], ["what"])["what"].to_list()
    assert a != b
    assert b == store.joined(["actor/pg_loss"], [RLOO])[RLOO].to_list()


def test_metric_names_and_bounds(run):
    store = Store(run)
    assert "perf/throughput" in store.metric_names([]) and "actor/pg_loss" not in store.metric_names([])
    assert "actor/pg_loss" in store.metric_names(["baseline"])
    assert store.step_bounds([]) == (1, 3)
    assert store.step_bounds(["baseline"]) == (1, 4)


def test_saved_comparison(run):
    from rldiag.analysis.compare import compare

    store = Store(run)
    assert store.comparison("baseline", RLOO) is None
    report = compare(run, "baseline", RLOO, recompute_missing=False, device="cpu")
    saved = store.comparison("baseline", RLOO)
    assert saved is not None and not saved.stale
    assert saved.tokens["step"].to_list() == report.token_steps
    assert saved.meta["summary"]["tokens"] == report.summary["tokens"]
    delta = {m.metric: m.mean_delta for m in report.metrics}
    got = dict(zip(saved.metrics["metric"].to_list(), saved.metrics["mean_delta"].to_list()))
    assert got["actor/pg_loss"] == pytest.approx(delta["actor/pg_loss"])
    recompute(run, {"algorithm.adv_estimator": "rloo"}, save_tokens=True, device="cpu", reuse=False)
    assert store.comparison("baseline", RLOO).stale
