"""rldiag.rows / rldiag.rows_count: the per-row tables of a recomputed synthetic run, filtered,
sorted, paged, searched and joined with a second scenario, in DuckDB; bad filters refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rldiag
from rldiag.errors import QueryError, RunDirError
from rldiag.store import rows as rows_mod
from rldiag.store.rows import SIGN_DIFFERS, check_expression
from rldiag.synth import SynthSpec, write_synth_run

RLOO = "adv_estimator=rloo"


def add_text(run: Path, skip_step: int | None = None) -> None:
    """Give the batch files a ``response_tokens`` column: row r of step s says ``s<s>r<r>`` and,
    on rows r % 5 == 0, ``The ANSWER``; step ``skip_step`` keeps no text."""
    for f in sorted((run / "batches").glob("step_*.parquet")):
        t = pq.read_table(f)
        step = int(t["step"][0].as_py())
        if step == skip_step:
            continue
        texts = [[f"s{step}r{r} "] + (["The ", "ANS", "WER"] if r % 5 == 0 else ["no"]) + ["."] * (len(m) - 2 - 3 * (r % 5 == 0))
                 for r, m in enumerate(t["response_mask"].to_pylist())]
        texts = [x[: len(m)] + ["."] * (len(m) - len(x)) for x, m in zip(texts, t["response_mask"].to_pylist())]
        pq.write_table(t.append_column("response_tokens", pa.array(texts, pa.list_(pa.string()))), f)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = write_synth_run(tmp_path_factory.mktemp("rows") / "run",
                           SynthSpec(steps=4, prompts=4, n=4, min_len=6, max_len=24, extra_columns=True, seed=5))
    add_text(path, skip_step=4)
    rldiag.recompute(path, device="cpu")
    rldiag.recompute(path, estimator="rloo", device="cpu")
    return path


@pytest.fixture(scope="module")
def every(run) -> pl.DataFrame:
    """Every row of the baseline, read whole (what the queries are checked against)."""
    return pl.concat([pl.read_parquet(f) for f in sorted((run / "rldiag/scenarios/baseline/rows").glob("*.parquet"))],
                     how="diagonal")


def test_default_order_and_paging(run, every):
    assert rldiag.rows_count(run) == len(every) == 64
    first = rldiag.rows(run)
    assert len(first) == 50 and first.select("step", "row").rows() == every.sort("step", "row").head(50).select(
        "step", "row").rows()
    page = rldiag.rows(run, limit=10, offset=55)
    assert page.select("step", "row").rows() == every.sort("step", "row").slice(55, 10).select("step", "row").rows()
    assert len(page) == 9  # the last page is short
    assert rldiag.rows(run, limit=None).height == 64
    assert {"uid", "traj_uid", "step_index", "acc", "advantage_mean", "is_weight_seq"} <= set(first.columns)


def test_filters_and_sort(run, every):
    got = rldiag.rows(run, where="length > 10 AND group_has_signal = 1", sort="-advantage_mean", limit=None)
    want = every.filter((pl.col("length") > 10) & (pl.col("group_has_signal") == 1))
    assert len(got) == len(want) == rldiag.rows_count(run, where="length > 10 AND group_has_signal = 1") > 0
    adv = got["advantage_mean"].to_numpy()
    assert (np.diff(adv) <= 0).all()
    asc = rldiag.rows(run, where="is_weight_seq >= 1", sort="is_weight_seq", limit=5)
    assert (np.diff(asc["is_weight_seq"].to_numpy()) >= 0).all() and (asc["is_weight_seq"] >= 1).all()
    # strings, functions, IN, BETWEEN, CASE, casts
    uid = every["uid"][0]
    assert rldiag.rows_count(run, where=f"uid = '{uid}'") == 4
    assert rldiag.rows_count(run, where="step IN (1, 3) AND abs(advantage_mean) BETWEEN 0 AND 100") == 32
    assert rldiag.rows_count(run, where="CASE WHEN step = 2 THEN true ELSE false END AND length::DOUBLE > 0") == 16
    assert rldiag.rows_count(run, where="row = 0") == 4  # a column named like a keyword


@pytest.mark.parametrize("where, names", [
    ("nope > 1", "no column 'nope'"),
    ("length > (SELECT 1)", "'SELECT' is not allowed"),
    ("length > 1; DROP TABLE r", "';' is not allowed"),
    ("read_csv('/etc/passwd') IS NULL", "function 'read_csv' is not allowed"),
    ("step IN (FROM read_parquet('x'))", "'FROM' is not allowed"),
    ("length > 1 -- all", "comments are not allowed"),
    ("length > $1", "'$' is not allowed"),
    ("(length > 1", "a '(' without its ')'"),
    ("length > 1) OR (1 = 1", "a ')' without its '('"),
    ("length >", "Parser Error"),
    ("uid > 5", "uid > 5"),
])
def test_a_bad_filter_is_an_error_naming_it(run, where, names):
    with pytest.raises(QueryError, match=None) as err:
        rldiag.rows(run, where=where)
    assert names in str(err.value) and where in str(err.value)
    with pytest.raises(QueryError):
        rldiag.rows_count(run, where=where)


def test_check_expression_alone():
    assert check_expression("a > 1 AND lower(b) LIKE 'x%'", ["a", "b"]) == "a > 1 AND lower(b) LIKE 'x%'"
    with pytest.raises(QueryError, match="columns: a, b"):
        check_expression("c = 1", ["a", "b"])


def test_bad_sort_paging_and_scenario(run):
    with pytest.raises(QueryError, match="sort: no column 'nope'"):
        rldiag.rows(run, sort="-nope")
    with pytest.raises(QueryError, match="offset must be >= 0"):
        rldiag.rows(run, offset=-1)
    with pytest.raises(RunDirError, match=r"scenario 'zzz' does not exist .*rldiag recompute"):
        rldiag.rows(run, scenario="zzz")


def test_search_over_the_response_text(run, every):
    hits = rldiag.rows(run, search="the answer", limit=None)  # case-insensitive, across token boundaries
    want = every.filter((pl.col("row") % 5 == 0) & (pl.col("step") != 4))  # step 4 has no text
    assert sorted(hits.select("step", "row").rows()) == sorted(want.select("step", "row").rows())
    assert rldiag.rows_count(run, search="the answer") == len(want)
    one = rldiag.rows(run, search="S2R7 ")
    assert one.select("step", "row").rows() == [(2, 7)]
    both = rldiag.rows_count(run, search="answer", where="step = 1")
    assert both == len(want.filter(pl.col("step") == 1))
    assert rldiag.rows_count(run, search="no such text") == 0
    # a quote in the text searched for is text, not SQL
    assert rldiag.rows_count(run, search="'; DROP TABLE r; --") == 0


def test_a_search_is_kept_until_a_batch_file_changes(tmp_path):
    path = write_synth_run(tmp_path / "run", SynthSpec(steps=2, prompts=2, n=4, min_len=6, max_len=12, seed=6))
    add_text(path)
    rldiag.recompute(path, device="cpu")
    first = rldiag.rows(path, search="answer", limit=None).select("step", "row").rows()
    assert first == [(1, 0), (1, 5), (2, 0), (2, 5)]
    hits, misses = rows_mod.HITS.hits, rows_mod.HITS.misses
    rldiag.rows_count(path, search="ANSWER")  # the same search, any case: the kept matches
    assert (rows_mod.HITS.hits, rows_mod.HITS.misses) == (hits + 1, misses)
    # step 2 rewritten (a run still writing replaces a file): its new text is searched, not the kept one
    f = path / "batches" / "step_2.parquet"
    t = pq.read_table(f)
    texts = t["response_tokens"].to_pylist()
    texts[1] = ["the answer"] + texts[1][1:]
    pq.write_table(t.set_column(t.column_names.index("response_tokens"), "response_tokens",
                                pa.array(texts, pa.list_(pa.string()))), f)
    assert rldiag.rows_count(path, search="answer") == 5
    assert rows_mod.HITS.misses == misses + 1


def test_preview_of_the_page_rows(run):
    page = rldiag.rows(run, where="step >= 3 AND row < 2", preview=8)
    assert page["response"].to_list() == ["s3r0 The…", "s3r1 no.…", None, None]  # step 4: no text


def test_sign_differs_under_another_scenario(run):
    base = rldiag.rows(run, limit=None)
    joined = rldiag.rows(run, other=RLOO, limit=None)
    rloo = pl.concat([pl.read_parquet(f) for f in sorted((run / f"rldiag/scenarios/{RLOO}/rows").glob("*.parquet"))])
    assert joined.select("step", "row").rows() == base.select("step", "row").rows()
    merged = base.join(rloo.select("step", "row", pl.col("advantage_mean").alias("b")), on=["step", "row"])
    assert np.allclose(joined["other_advantage_mean"].to_numpy(), merged.sort("step", "row")["b"].to_numpy())
    differs = rldiag.rows(run, where=SIGN_DIFFERS, other=RLOO, limit=None)
    want = merged.filter(pl.col("advantage_mean").sign() != pl.col("b").sign())
    assert len(differs) == len(want) == rldiag.rows_count(run, where=SIGN_DIFFERS, other=RLOO)
    assert len(want) > 0  # GRPO's std normalisation and RLOO's leave-one-out do disagree on some rows
    with pytest.raises(QueryError, match="no column 'other_advantage_mean'"):
        rldiag.rows(run, where=SIGN_DIFFERS)
    with pytest.raises(QueryError, match="the scenario itself"):
        rldiag.rows(run, other="baseline")


def test_without_per_row_tables_the_error_says_to_recompute(tmp_path):
    path = write_synth_run(tmp_path / "bare", SynthSpec(steps=2, seed=1))
    with pytest.raises(RunDirError, match=r"rldiag recompute RUN"):
        rldiag.rows(path)


def test_step_tokens_saved_or_recomputed_into_the_token_cache(run):
    t = rldiag.step_token_frame(run, 2)  # the baseline saved no tokens: recomputed into its token cache
    assert (run / "rldiag" / "cache" / "baseline" / "tokens" / "step_000002.parquet").is_file()
    assert t["row"].to_list() == list(range(16))
    assert {"advantages", "ratio", "loss_weight", "turn", "response_mask"} <= set(t.columns)
    rows = rldiag.rows(run, where="step = 2", limit=None)
    adv = [np.mean([a for a, m in zip(r, k) if m]) for r, k in zip(t["advantages"].to_list(), t["response_mask"].to_list())]
    assert np.allclose(adv, rows["advantage_mean"].to_numpy(), atol=1e-6)
    assert np.allclose([sum(w) for w in t["loss_weight"].to_list()], rows["loss_weight"].to_numpy(), atol=1e-6)
    saved = rldiag.recompute(run, name="tok", save_tokens=True, steps="2", device="cpu")
    assert rldiag.step_token_frame(run, 2, "tok").equals(saved.token_frame(2))
    with pytest.raises(RunDirError, match="no batch file for step 99"):
        rldiag.step_token_frame(run, 99)
