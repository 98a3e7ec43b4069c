"""rldiag's Python API (rldiag.api, re-exported by ``import rldiag``) on a copy of the bundled
sample run: what each function returns, the frames of its results, and its progress callback."""

from __future__ import annotations

import importlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from polars.testing import assert_frame_equal

import rldiag
from rldiag import api
from rldiag.errors import ConfigError, RunDirError

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "grpo-tool"
STEPS = list(range(1, 31))
RLOO = "adv_estimator=rloo"


class Calls(list):
    """A ``progress(done, total, what)`` that records its calls."""

    def __call__(self, done: int, total: int, what: str) -> None:
        assert isinstance(done, int) and isinstance(total, int) and isinstance(what, str)
        self.append((done, total, what))


def assert_counts_up(calls: Calls, total: int, prefix: str = "", steps=STEPS) -> None:
    """Called once per step, ``done`` 1, 2, ... up to ``total``, ``what`` naming each step once."""
    assert [c[0] for c in calls] == list(range(1, total + 1))
    assert {c[1] for c in calls} == {total}
    assert sorted(c[2] for c in calls) == sorted(f"{prefix}step {s}" for s in steps)


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """The bundled sample, copied (never written in place), without outputs of earlier runs."""
    dst = tmp_path_factory.mktemp("api") / "grpo-tool"
    shutil.copytree(SAMPLE, dst, ignore=shutil.ignore_patterns("rldiag"))
    return dst


def logged_lines(run: Path) -> dict[int, dict]:
    return {(d := json.loads(line))["step"]: d["data"] for line in (run / "metrics.jsonl").read_text().splitlines()}


# ---- the package ------------------------------------------------------------------------------


def test_the_package_offers_every_name_of_the_api():
    assert rldiag.__all__ == ["__version__", *api.__all__]
    for name in api.__all__:
        assert getattr(rldiag, name) is getattr(api, name) is not None
    importlib.import_module("rldiag.scenario.recompute")  # the driver's modules live in their own package
    importlib.import_module("rldiag.analysis.check")
    assert rldiag.recompute is api.recompute and rldiag.check is api.check
    assert rldiag.VerifyResult is importlib.import_module("rldiag.analysis.verify").VerifyReport
    assert rldiag.SweepResult is importlib.import_module("rldiag.scenario.sweep").SweepReport
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        rldiag.no_such_name  # noqa: B018


@pytest.mark.slow  # a subprocess
def test_import_rldiag_imports_nothing_heavy():
    code = ("import sys, rldiag\n"
            "heavy = [m for m in ('torch', 'polars', 'pyarrow', 'numpy', 'rldiag.api') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "from rldiag import api\n"
            "assert 'torch' not in sys.modules and 'polars' not in sys.modules\n"
            "assert callable(rldiag.recompute) and rldiag.recompute is api.recompute\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_settings_and_tolerances():
    assert api.settings(SAMPLE)["algorithm.adv_estimator"] == "grpo"
    s = rldiag.settings(SAMPLE, {"algorithm.adv_estimator": "gae", "algorithm.lam": 0.9}, estimator="rloo")
    assert s["algorithm.adv_estimator"] == "rloo" and s["algorithm.lam"] == 0.9
    from_text = rldiag.tolerances(fields=["actor/pg_loss=1e-3", "critic/*=1e-3,1e-4"])
    from_map = rldiag.tolerances(fields={"actor/pg_loss": 1e-3, "critic/*": (1e-3, 1e-4)})
    assert from_text == from_map
    assert from_map.for_field("critic/vf_loss", "metric") == api.Tol(1e-3, 1e-4)
    bf16 = rldiag.tolerances(bf16=True, atol=0.5)
    assert (bf16.tokens.rtol, bf16.tokens.atol, bf16.metrics) == (1e-2, 0.5, api.Tolerances.bf16().metrics)


# ---- recompute --------------------------------------------------------------------------------


def test_recompute_returns_the_scenario_it_wrote(sample, tmp_path):
    # a copy of its own: the module's sample may hold a baseline another test wrote first
    run = shutil.copytree(sample, tmp_path / "run", ignore=shutil.ignore_patterns("rldiag"))
    calls = Calls()
    res = rldiag.recompute(run, device="cpu", progress=calls)
    assert isinstance(res, api.RecomputeResult)
    assert (res.name, res.path, res.device, res.executor) == ("baseline", run / "rldiag" / "scenarios" / "baseline",
                                                             "cpu", "local")
    assert res.ok and res.steps_done == STEPS and res.steps_reused == []
    assert res.rows == 30 * 64 and res.tokens > 0
    assert_counts_up(calls, 30)
    # the frame is the scenario's metrics.parquet, and the numbers are the ones the trainer logged
    assert_frame_equal(res.metrics, pl.read_parquet(res.path / "metrics.parquet"))
    assert res.metrics["step"].to_list() == STEPS
    logged = logged_lines(sample)
    for name in ("critic/advantages/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/kl_loss"):
        assert res.metrics[name].to_list() == pytest.approx([logged[s][name] for s in STEPS], rel=1e-4, abs=1e-6)
    assert_frame_equal(rldiag.logged(sample).select(res.metrics.columns[:1] + ["actor/pg_loss"]),
                       pl.DataFrame({"step": STEPS, "actor/pg_loss": [logged[s]["actor/pg_loss"] for s in STEPS]}))


def test_a_what_if_with_another_estimator(sample):
    base = rldiag.recompute(sample, device="cpu")
    calls = Calls()
    rloo = rldiag.recompute(sample, estimator="rloo", steps="3:7", save_tokens=True, device="cpu", progress=calls)
    assert rloo.name == RLOO and rloo.settings["algorithm.adv_estimator"] == "rloo"
    assert rloo.steps_done == [3, 4, 5, 6, 7]
    assert_counts_up(calls, 5, steps=[3, 4, 5, 6, 7])
    assert_frame_equal(rloo.metrics, pl.read_parquet(rloo.path / "metrics.parquet"))
    # the same scores, other advantages
    at = base.metrics.filter(pl.col("step").is_between(3, 7))
    assert rloo.metrics["critic/score/mean"].to_list() == at["critic/score/mean"].to_list()
    assert rloo.metrics["critic/advantages/max"].to_list() != at["critic/advantages/max"].to_list()
    tokens = rloo.token_frame(5)
    assert tokens.height == 64 and {"advantages", "response_mask"} <= set(tokens.columns)
    with pytest.raises(RunDirError, match="save_tokens"):
        base.token_frame(5)
    # unchanged steps are reused: the same frame, nothing recomputed
    again = rldiag.recompute(sample, estimator="rloo", steps="3:7", save_tokens=True, device="cpu")
    assert again.steps_reused == [3, 4, 5, 6, 7] and again.rows == 0
    assert_frame_equal(again.metrics, rloo.metrics)


def test_recompute_follows_a_run(sample):
    """``follow=True``: a recompute as the run's files change (here: none after the first), each
    result to ``on_update``, the last returned once ``idle_timeout`` passes without a new file."""
    updates: list[api.RecomputeResult] = []
    calls = Calls()
    res = rldiag.recompute(sample, name="followed", steps="1:2", device="cpu", follow=True, poll_seconds=0.01,
                           idle_timeout=0.05, on_update=updates.append, progress=calls)
    assert [u.steps_done for u in updates] == [[1, 2]]
    assert isinstance(res, api.RecomputeResult) and res.name == "followed" and res.steps_done == [1, 2]
    assert_frame_equal(res.metrics, updates[0].metrics)
    assert_counts_up(calls, 2, steps=[1, 2])


def test_recompute_refuses_a_bad_setting_before_any_work(sample):
    with pytest.raises(ConfigError):
        rldiag.recompute(sample, name="a/b")


# ---- verify, compare, doctor, check -----------------------------------------------------------


def test_verify_matches_the_run_the_reference_logged(sample):
    calls = Calls()
    v = rldiag.verify(sample, progress=calls)
    assert isinstance(v, api.VerifyResult)
    assert (v.status, v.exit_code, v.steps_checked) == ("match", 0, STEPS)
    assert_counts_up(calls, 30)
    frame = v.fields_frame()
    assert frame["field"].to_list() == list(v.fields)
    assert frame["ok"].all() and frame["mismatches"].sum() == 0
    assert frame["compared"].sum() == v.compared > 0
    assert {"advantages", "returns", "token_level_rewards", "actor/pg_loss"} <= set(frame["field"])
    assert frame.filter(pl.col("field") == "advantages")["kind"].item() == "token"


def test_verify_names_the_setting_that_would_have_matched(sample):
    v = rldiag.verify(sample, {"algorithm.norm_adv_by_std_in_grpo": False}, steps="1:2")
    assert v.status == "mismatch"
    bad = v.fields_frame().filter(~pl.col("ok"))
    assert "advantages" in bad["field"].to_list()
    first = bad.filter(pl.col("field") == "advantages")["first_mismatch"].item()
    assert first.startswith("step 1, row 0, token 0, advantages: logged")
    assert any(c.overrides == {"algorithm.norm_adv_by_std_in_grpo": True} and c.matches_all for c in v.candidates)


def test_compare_two_scenarios(sample):
    base = rldiag.recompute(sample, device="cpu", save_tokens=True)
    rloo = rldiag.recompute(sample, estimator="rloo", device="cpu", save_tokens=True)
    calls = Calls()
    cmp = rldiag.compare(sample, base.name, rloo.name, progress=calls)
    assert isinstance(cmp, api.CompareResult)
    assert (cmp.a, cmp.b, cmp.recomputed, cmp.token_steps) == ("baseline", RLOO, [], STEPS)
    assert_counts_up(calls, 30)
    assert (cmp.path / "comparison.json").is_file()
    # per metric: the means of the two recomputes, and their difference
    deltas = cmp.metrics_frame()
    assert deltas.height == len(cmp.metrics) > 0
    row = deltas.filter(pl.col("metric") == "critic/advantages/max").row(0, named=True)
    assert row["steps"] == 30
    assert row["mean_a"] == pytest.approx(base.metrics["critic/advantages/max"].mean())
    assert row["mean_b"] == pytest.approx(rloo.metrics["critic/advantages/max"].mean())
    assert row["mean_delta"] == pytest.approx(row["mean_b"] - row["mean_a"])
    assert deltas.filter(pl.col("metric") == "critic/score/mean")["max_abs_delta"].item() == 0.0
    # per step: the agreement of the advantages, summed up in the summary
    tokens = cmp.tokens_frame()
    assert tokens["step"].to_list() == STEPS
    assert tokens["n_tokens"].sum() == cmp.summary["tokens"]
    assert 0.0 < cmp.summary["sign_agreement"] <= 1.0


def test_compare_with_the_logged_values_and_on_step(sample):
    rldiag.recompute(sample, device="cpu", save_tokens=True)
    seen: list = []
    cmp = rldiag.compare(sample, "logged", "baseline", steps="1:4", on_step=seen.append)
    assert [t.step for t in seen] == [1, 2, 3, 4] == cmp.token_steps
    assert cmp.summary["sign_agreement"] == 1.0  # the recompute reproduces the logged advantages
    assert cmp.tokens_frame()["pearson"].to_list() == pytest.approx([1.0] * 4)


def test_compare_estimators(sample):
    calls = Calls()
    res = rldiag.compare_estimators(sample, ["grpo", "rloo"], steps="1:3", device="cpu", progress=calls)
    assert isinstance(res, api.EstimatorsResult)
    assert res.scenarios == {"grpo": "adv_estimator=grpo", "rloo": RLOO}
    assert "adv_estimator=grpo" in res.recomputed
    # the progress of each recompute is named by its scenario
    grpo = Calls(c for c in calls if c[2].startswith("adv_estimator=grpo: "))
    assert_counts_up(grpo, 3, prefix="adv_estimator=grpo: ", steps=[1, 2, 3])
    assert all(c[2].startswith(("adv_estimator=grpo: ", RLOO + ": ")) for c in calls)
    frame = res.summary_frame()
    assert frame.select("a", "b").rows() == [("adv_estimator=grpo", RLOO)]
    assert frame["tokens"].item() == res.pairs[0].summary["tokens"] > 0


def test_diagnose(sample):
    calls = Calls()
    d = rldiag.diagnose(sample, progress=calls)
    assert isinstance(d, api.DiagnoseResult)
    assert (d.logged_steps, d.recomputed_steps, d.recompute_error) == (30, 30, None)
    assert_counts_up(calls, 30)
    frame = d.findings_frame()
    assert frame["rule"].to_list() == [f.rule for f in d.findings]
    # healthy: no finding above info (the sample's only finding is bf16 precision, at info)
    assert d.healthy == frame.filter(frame["severity"] != "info").is_empty()
    assert not frame.is_empty()
    assert set(d.rules) == set(d.passed) | set(d.not_evaluated) | set(d.not_applicable) | set(frame["rule"])
    for f, row in zip(d.findings, frame.iter_rows(named=True)):
        assert (row["severity"], row["metric"], row["steps"]) == (f.severity, f.evidence.metric, f.evidence.steps)
    # logged metrics only: no recompute, no progress
    quick = Calls()
    logged_only = rldiag.diagnose(sample, recompute=False, progress=quick)
    assert (logged_only.logged_steps, logged_only.recomputed_steps, quick) == (30, 0, [])


def test_check(sample):
    import pyarrow.parquet as pq

    calls = Calls()
    c = rldiag.check(sample, progress=calls)
    assert isinstance(c, api.CheckResult)
    assert c.ok and c.problems == [] and c.metrics_lines == 30
    assert_counts_up(calls, 30)
    frame = c.steps_frame()
    assert frame["step"].to_list() == STEPS
    assert frame["rows"].to_list() == [pq.read_metadata(sample / "batches" / f"step_{s:06d}.parquet").num_rows
                                       for s in STEPS]
    assert frame["problem"].null_count() == 30
    assert c.algorithms["rloo"] == [] and c.algorithms["grpo"] == []


# ---- import -----------------------------------------------------------------------------------


class FakeRun:
    """The part of a W&B public-API run an import reads."""

    id, entity, project, name, state = "abc123", "me", "rl", "grpo-tool", "finished"

    def __init__(self, rows: list[dict], config: dict):
        self._rows, self.config = rows, config
        self.lastHistoryStep = max(r["_step"] for r in rows)  # noqa: N815 - the public API's name

    def scan_history(self, page_size=1000, **kw):
        yield from (dict(r) for r in self._rows)

    def logged_artifacts(self):
        return []


def test_import_wandb_then_doctor(sample, tmp_path):
    logged = logged_lines(SAMPLE)
    config = {k: {"value": v} for k, v in yaml.safe_load((SAMPLE / "run.yaml").read_text()).items()}
    run = FakeRun([{"_step": s, **values} for s, values in logged.items()], config)

    class FakeApi:
        def run(self, path):
            assert path == "me/rl/abc123"
            return run

    calls = Calls()
    out = tmp_path / "imported"
    res = rldiag.import_wandb("me/rl/abc123", out, api_factory=lambda **kw: FakeApi(), progress=calls)
    assert isinstance(res, api.ImportResult)
    assert (res.kind, res.run_id, res.history_rows, res.first_step, res.last_step) == ("online", "abc123", 30, 1, 30)
    assert calls and calls[-1][0] == 30 and calls[-1][2].startswith("step ")  # history rows read
    # what it wrote reads back as the sample's own logs and settings
    assert_frame_equal(rldiag.logged(out), rldiag.logged(SAMPLE), check_column_order=False)
    assert rldiag.settings(out).resolved() == rldiag.settings(SAMPLE).resolved()
    d = rldiag.diagnose(out, recompute=False)
    assert d.logged_steps == 30 and d.recompute_error is None
    assert math.isfinite(rldiag.logged(out)["actor/pg_loss"].sum())


def test_mismatch_keeps_the_tokens_the_scenario_saved(tmp_path):
    """A diagnosis recomputes the baseline: tokens an earlier recompute saved stay (the Off-policy
    page runs it on open, and the Step page reads them)."""
    from rldiag.synth import SynthSpec, write_synth_run

    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=5))
    tokens = run / "rldiag" / "scenarios" / "baseline" / "tokens"
    api.mismatch(run, examples=False)
    assert not tokens.exists()  # none saved before: none written
    api.recompute(run, save_tokens=True)
    saved = sorted(p.name for p in tokens.iterdir())
    diag = api.mismatch(run, examples=False)
    assert sorted(p.name for p in tokens.iterdir()) == saved and diag.steps == [1, 2]
    api.mismatch(run, examples=False, save_tokens=False)
    assert not tokens.exists()


def test_mismatch_without_writing_equals_the_recomputed_one(sample, tmp_path):
    """write=False recomputes the steps in memory and writes nothing; the diagnosis
    is the one the recompute's metrics give."""
    run = shutil.copytree(sample, tmp_path / "run", ignore=shutil.ignore_patterns("rldiag"))
    streamed = rldiag.mismatch(run, write=False)
    assert not (run / "rldiag").exists()
    written = rldiag.mismatch(run)
    assert streamed.confidences == written.confidences and streamed.steps == written.steps
    for k, v in written.summary.items():
        assert streamed.summary[k] == pytest.approx(v, rel=1e-9, nan_ok=True), k
