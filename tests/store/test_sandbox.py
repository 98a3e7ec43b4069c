"""Defence in depth: every DuckDB connection of the store and of ``rldiag rows`` reads only the
directories of the run it serves (and the run's mirror), with its settings locked, so a filter
that got past the checker still cannot read another file; files the run writes later stay
readable."""

from __future__ import annotations

import shutil

import pytest

import rldiag
from rldiag.errors import QueryError, StoreError
from rldiag.io.run_layout import mirror_dir
from rldiag.store import Db, Store
from rldiag.store import rows as rows_mod
from rldiag.store.sandbox import served_dirs
from rldiag.synth import SynthSpec, write_synth_run

#: filters the checker refuses, each reading a file outside the run
ESCAPES = [
    "(select count(*) from read_csv('{secret}')) > 0",
    "(select count(*) from read_text('{secret}')) > 0",
    "(select count(*) from read_parquet('{parquet}')) > 0",
    "(select count(*) from glob('{outside}/*')) > 0",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sandbox")
    path = write_synth_run(root / "run", SynthSpec(steps=2, prompts=2, n=4, min_len=4, max_len=12, seed=2))
    rldiag.recompute(path, device="cpu")
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret.csv").write_text("password\nhunter2\n")
    shutil.copy(path / "batches" / "step_1.parquet", outside / "copy.parquet")
    return path


def _escapes(run):
    outside = run.parent / "outside"
    return [e.format(secret=outside / "secret.csv", parquet=outside / "copy.parquet", outside=outside)
            for e in ESCAPES]


def test_the_checker_refuses_the_escapes(run):
    for where in _escapes(run):
        with pytest.raises(QueryError, match="is not allowed"):
            rldiag.rows_count(run, where=where)


def test_duckdb_itself_refuses_them_when_the_checker_is_bypassed(run, monkeypatch):
    monkeypatch.setattr(rows_mod, "check_expression", lambda expr, names, what="where": expr)
    assert rows_mod.count_rows(run, where="length > 0 AND (select count(*) from read_parquet("
                               f"'{run}/batches/step_2.parquet')) > 0") == 16  # the bypass works: the run is readable
    for where in _escapes(run):
        with pytest.raises(QueryError, match="Permission Error") as err:
            rows_mod.count_rows(run, where=where)
        assert "disabled by configuration" in str(err.value)
        with pytest.raises(QueryError, match="Permission Error"):
            rows_mod.query_rows(run, where=where)


def test_a_store_connection_reads_only_its_run_and_stays_locked(run, tmp_path):
    store = Store(run)
    assert store.step_rows(1).height == 8
    secret = run.parent / "outside" / "secret.csv"
    with pytest.raises(StoreError, match="Permission Error"):
        store.db.rows("SELECT * FROM read_csv(?)", [str(secret)])
    with pytest.raises(StoreError, match="Permission Error"):  # nor written
        store.db.execute(f"COPY (SELECT 1 AS x) TO '{tmp_path / 'out.csv'}'")
    assert not (tmp_path / "out.csv").exists()
    for setting in ("enable_external_access = true", "allowed_directories = ['/']", "lock_configuration = false"):
        with pytest.raises(StoreError, match="the configuration has been locked"):
            store.db.execute(f"SET {setting}")
    with pytest.raises(StoreError, match="Permission Error"):
        store.db.rows("SELECT * FROM read_csv(?)", [str(secret)])
    # another run is another connection, with its own directories
    other = Store(run.parent / "outside")
    assert other.db.rows("SELECT password FROM read_csv(?)", [str(secret)]) == [("hunter2",)]
    with pytest.raises(StoreError, match="Permission Error"):
        other.db.rows("SELECT count(*) FROM read_parquet(?)", [str(run / "batches" / "step_1.parquet")])


def test_files_written_after_the_connection_opened_stay_readable(tmp_path):
    run = write_synth_run(tmp_path / "live", SynthSpec(steps=3, prompts=2, n=4, min_len=4, max_len=12, seed=4))
    later = tmp_path / "step_3.parquet"
    (run / "batches" / "step_3.parquet").rename(later)
    store = Store(run)
    assert store.steps() == [1, 2] and store.step_rows(2).height == 8
    db = Db(served_dirs(run))
    # the trainer writes step 3, then rldiag recomputes: a new batch file and a new scenario directory
    later.rename(run / "batches" / "step_3.parquet")
    rldiag.recompute(run, device="cpu")
    assert store.steps() == [1, 2, 3] and store.step_rows(3).height == 8
    assert store.scenario_names() == ["baseline"] and store.scenarios.table("baseline") is not None
    assert db.rows("SELECT count(*) FROM read_parquet(?)", [str(run / "rldiag/scenarios/baseline/rows/*.parquet")]) == [(24,)]
    assert rldiag.rows_count(run) == 24
    (run / "metrics.jsonl").write_text('{"step": 1, "data": {"a": 1}}\n')
    assert store.logged_names() == ["a"]
    with (run / "metrics.jsonl").open("a") as fh:  # the new lines are staged in the connection's scratch directory
        fh.write('{"step": 2, "data": {"a": 2, "b": 3}}\n')
    assert store.logged_names() == ["a", "b"] and store.logged.appends == 1
    db.close()
    assert not db.scratch.exists()


def test_a_read_only_run_reads_its_mirror(tmp_path, monkeypatch):
    monkeypatch.setenv("RLDIAG_HOME", str(tmp_path / "home"))
    run = write_synth_run(tmp_path / "ro", SynthSpec(steps=2, prompts=2, n=4, min_len=4, max_len=12, seed=5))
    monkeypatch.setenv("RLDIAG_READ_ONLY", str(run))
    rldiag.recompute(run, device="cpu")
    mirror = mirror_dir(run)
    assert (mirror / "scenarios" / "baseline" / "rows").is_dir() and not (run / "rldiag").exists()
    assert str(mirror) in served_dirs(run)
    assert rldiag.rows_count(run) == 16
    assert "baseline" in Store(run).scenarios_with_rows()


def test_a_run_opened_through_a_link(run, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(run)
    assert rldiag.rows_count(link) == 16
    assert Store(link).step_rows(2).height == 8


def test_a_connection_without_directories_reads_arrow_only():
    import pyarrow as pa

    with Db() as db:
        assert db.rows("SELECT sum(x) FROM t", arrow={"t": pa.table({"x": [1, 2]})}) == [(3,)]
        with pytest.raises(StoreError, match="Permission Error"):
            db.rows("SELECT * FROM read_csv('/etc/passwd')")
