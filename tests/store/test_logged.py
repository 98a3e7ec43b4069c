"""metrics.jsonl through DuckDB: both forms, a half-written last line, growth, rewrites."""

from __future__ import annotations

import json
import math
import os

import pytest

from rldiag.io.rundir import iter_metrics_lines
from rldiag.store import Store


def _lines(path, objs, end="\n"):
    with path.open("a") as fh:
        fh.write("\n".join(json.dumps(o) for o in objs) + end)


def _as_set(frame):
    return {(r["step"], r["metric"], None if math.isnan(r["value"]) else r["value"]) for r in frame.iter_rows(named=True)}


@pytest.fixture
def run(tmp_path):
    (tmp_path / "batches").mkdir()
    return tmp_path


def test_nested_and_flat_forms_match_the_reference_reader(run):
    m = run / "metrics.jsonl"
    m.write_text(
        '{"step": 1, "data": {"actor/pg_loss": 0.5, "critic/score/mean": 1, "flag": true, "name": "x", '
        '"nested": {"a": 1}, "nan": NaN}}\n'
        '{"step": 2, "actor/pg_loss": 0.25, "val/acc": 3, "s": "str"}\n'
        "training log noise, not JSON\n"
        "\n"
        '{"no_step": 1, "a": 2}\n'
        '{"step": 4, "data": {"actor/pg_loss": -1e-3}, "timestamp": "now"}\n'
    )
    store = Store(run)
    names = store.logged_names()
    got = _as_set(store.logged_long(names))
    want = {(s, k, None if isinstance(v, float) and math.isnan(v) else float(v))
            for s, d in iter_metrics_lines(m) for k, v in d.items()}
    assert got == want
    assert (1, "flag", 1.0) not in got  # booleans are not metrics
    assert (1, "critic/score/mean", 1.0) in got and (2, "val/acc", 3.0) in got
    assert store.logged.lines == 3


def test_half_written_last_line_is_skipped_then_picked_up(run):
    m = run / "metrics.jsonl"
    _lines(m, [{"step": 1, "data": {"a/x": 1.0}}, {"step": 2, "data": {"a/x": 2.0}}])
    with m.open("a") as fh:
        fh.write('{"step": 3, "data": {"a/x": 3.')
    store = Store(run)
    assert store.status().latest_step == 2
    assert store.logged_long(["a/x"])["value"].to_list() == [1.0, 2.0]
    with m.open("a") as fh:
        fh.write('5, "a/y": 7}}\n')
    assert store.logged_long(["a/x"])["value"].to_list() == [1.0, 2.0, 3.5]
    assert store.status().latest_step == 3
    assert store.logged.reloads == 1 and store.logged.appends == 1


def test_complete_line_without_newline_waits_for_it(run):
    m = run / "metrics.jsonl"
    _lines(m, [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}], end="")  # flat form, last line unterminated
    store = Store(run)
    assert store.logged_long(["a"])["step"].to_list() == [1]
    with m.open("a") as fh:
        fh.write("\n")
    assert store.logged_long(["a"])["step"].to_list() == [1, 2]


def test_growth_invalidates_the_cache_and_reads_only_new_lines(run):
    m = run / "metrics.jsonl"
    _lines(m, [{"step": s, "data": {"actor/pg_loss": s / 10}} for s in range(1, 6)])
    store = Store(run)
    before = store.logged_long(["actor/pg_loss"])
    assert before.height == 5
    assert store.logged_long(["actor/pg_loss"]) is before  # unchanged file: served from the cache
    _lines(m, [{"step": s, "data": {"actor/pg_loss": s / 10, "critic/new": 1.0}} for s in range(6, 9)])
    after = store.logged_long(["actor/pg_loss"])
    assert after["step"].to_list() == list(range(1, 9))
    assert "critic/new" in store.logged_names()
    assert store.logged.reloads == 1 and store.logged.appends == 1


def test_resumed_run_keeps_the_last_value_of_a_step(run):
    m = run / "metrics.jsonl"
    _lines(m, [{"step": 1, "data": {"a": 1.0}}, {"step": 2, "data": {"a": 2.0}}, {"step": 2, "data": {"a": 20.0}}])
    store = Store(run)
    assert store.logged_long(["a"])["value"].to_list() == [1.0, 20.0]
    _lines(m, [{"step": 1, "data": {"a": 10.0}}, {"step": 3, "data": {"a": 3.0}}])  # resumed from step 1
    assert store.logged_long(["a"])["value"].to_list() == [10.0, 20.0, 3.0]


def test_rewritten_file_of_the_same_size_is_read_again(run):
    m = run / "metrics.jsonl"
    _lines(m, [{"step": 1, "data": {"a": 1.0}}])
    store = Store(run)
    assert store.logged_long(["a"])["value"].to_list() == [1.0]
    m.write_text(json.dumps({"step": 1, "data": {"a": 9.0}}) + "\n")
    st = m.stat()
    os.utime(m, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert store.logged_long(["a"])["value"].to_list() == [9.0]
    assert store.logged.reloads == 2


def test_truncated_or_removed_file(run):
    m = run / "metrics.jsonl"
    _lines(m, [{"step": s, "a": float(s)} for s in range(1, 4)])
    store = Store(run)
    assert store.status().steps == 3
    m.write_text(json.dumps({"step": 7, "a": 7.0}) + "\n")
    assert store.logged_long(["a"])["step"].to_list() == [7]
    m.unlink()
    assert store.status().latest_step is None and store.logged_names() == []


def test_hundreds_of_metric_names_long_and_wide(run):
    names = [f"g{i % 9}/sub{i % 4}/metric_{i:03d}" for i in range(300)]
    _lines(run / "metrics.jsonl", [{"step": s, "data": {n: s + i / 1000 for i, n in enumerate(names)}} for s in range(1, 21)])
    store = Store(run)
    assert store.logged_names() == sorted(names)
    pick = [names[7], names[250], names[3]]
    wide = store.logged_wide(pick, 5, 9)
    assert wide.columns == ["step", *pick]
    assert wide["step"].to_list() == [5, 6, 7, 8, 9]
    assert wide[names[250]].to_list() == pytest.approx([s + 250 / 1000 for s in range(5, 10)])
    long = store.logged_long(pick, 5, 9)
    assert long.height == 15
    assert set(long["metric"]) == set(pick)


def test_no_metrics_file_until_it_appears(run):
    store = Store(run)
    assert store.status().latest_step is None
    assert store.logged_names() == []
    _lines(run / "metrics.jsonl", [{"step": 3, "data": {"x": 1.0}}])
    assert store.status().latest_step == 3
