"""``rldiag rows RUN --group-by uid|step|data_source``: one row per group, counts summed, other
columns averaged, checked against polars over the per-row files; the sort column always shown and
a response preview; "which groups drive the clipping" in one command."""

from __future__ import annotations

import json
import math

import polars as pl
import pytest

import rldiag
from rldiag.cli.main import main
from rldiag.errors import QueryError
from rldiag.io.run_layout import RunLayout
from rldiag.synth import SynthSpec, write_synth_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = write_synth_run(tmp_path_factory.mktemp("rows-groups") / "run", SynthSpec(steps=3, min_len=4, max_len=24, seed=3))
    rldiag.recompute(path, device="cpu")
    return path


def _rows(run) -> pl.DataFrame:
    sc = RunLayout(run).scenario("baseline")
    return pl.concat([pl.read_parquet(sc.rows_file(s)) for s in sc.row_steps()], how="diagonal_relaxed")


def test_groups_by_uid_sum_the_counts_and_average_the_rest(run):
    rows = _rows(run)
    want = (rows.group_by("step", "uid").agg(pl.len().alias("rows"), pl.col("length").sum().alias("length_sum"),
                                             pl.col("clipped_tokens").sum().alias("clipped_tokens_sum"),
                                             pl.col("score").mean().alias("score_mean"), pl.col("row").min().alias("first_row"),
                                             pl.col("group_has_signal").mean().alias("group_has_signal_mean"))
            .sort(["clipped_tokens_sum", "step", "uid"], descending=[True, False, False]))
    got = rldiag.rows(run, group_by="uid", sort="-clipped_tokens", limit=None)
    assert got.height == want.height == rldiag.rows_count(run, group_by="uid")
    assert got.columns[:4] == ["step", "uid", "rows", "first_row"]
    assert got["clipped_tokens_sum"].to_list() == want["clipped_tokens_sum"].to_list()
    assert got.select("step", "uid").rows() == want.select("step", "uid").rows()
    for col in ("rows", "length_sum", "first_row"):
        assert got[col].to_list() == want[col].to_list(), col
    for col in ("score_mean", "group_has_signal_mean"):
        assert got[col].to_list() == pytest.approx(want[col].to_list()), col
    assert got.schema["length_sum"] == pl.Int64 and got.schema["clipped_tokens_sum"] == pl.Float64
    # by step: every row of the step; the filter applies before grouping
    steps = rldiag.rows(run, group_by="step", where="length > 10", limit=None)
    expect = rows.filter(pl.col("length") > 10).group_by("step").agg(pl.len()).sort("step")
    assert steps.select("step", "rows").rows() == expect.rows()


def test_the_plain_name_and_the_errors(run):
    a = rldiag.rows(run, group_by="uid", sort="-length", limit=3)
    b = rldiag.rows(run, group_by="uid", sort="-length_sum", limit=3)
    assert a.equals(b)
    m = rldiag.rows(run, group_by="uid", sort="score", limit=3)["score_mean"].to_list()
    assert m == sorted(m)
    with pytest.raises(QueryError, match=r"group by 'data_source': the per-row table has no column 'data_source'"):
        rldiag.rows(run, group_by="data_source")
    with pytest.raises(QueryError, match=r"sort: no group column 'lenght'.*did you mean"):
        rldiag.rows(run, group_by="uid", sort="lenght")
    with pytest.raises(QueryError, match="choose one of uid, step, data_source"):
        rldiag.rows(run, group_by="prompt")


def test_which_groups_drive_the_clipping_in_one_command(run, capsys):
    assert main(["rows", str(run), "--group-by", "uid", "--sort", "-clipped_tokens", "--limit", "5"]) == 0
    out = capsys.readouterr().out
    n = rldiag.rows_count(run, group_by="uid")
    assert f"groups by uid 1-5 of {n}" in out and "clipped_tokens_sum" in out and "rows" in out
    top = rldiag.rows(run, group_by="uid", sort="-clipped_tokens", limit=5)
    for uid in top["uid"].to_list():
        assert uid in out
    # the sort column is shown even when --columns leaves it out, and JSON has every column
    assert main(["rows", str(run), "--sort", "-clipped_tokens", "--limit", "2", "--columns", "step,row"]) == 0
    out = capsys.readouterr().out
    assert "clipped_tokens" in out
    assert main(["rows", str(run), "--group-by", "step", "--json", "--limit", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [g["step"] for g in got] == [1, 2] and all(not math.isnan(g["rows"]) for g in got)


def test_a_response_preview_column(tmp_path, capsys):
    """A run whose batches carry the response text: its first characters in the table."""
    from rldiag.synth import MismatchSpec, write_mismatch_run

    run = write_mismatch_run(tmp_path / "run", MismatchSpec(cause="clean", steps=2, rows=16, n=4, tokens=12))
    rldiag.recompute(run, device="cpu")
    page = rldiag.rows(run, limit=2, preview=20)
    assert page["response"].null_count() == 0 and all(len(t) <= 21 for t in page["response"].to_list())
    groups = rldiag.rows(run, group_by="uid", limit=2, preview=20)
    first = rldiag.rows(run, where=f"step = {groups['step'][0]} AND row = {groups['first_row'][0]}", preview=20)
    assert groups["response"][0] == first["response"][0]
    assert main(["rows", str(run), "--limit", "2"]) == 0
    assert "response" in capsys.readouterr().out
