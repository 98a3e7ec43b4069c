"""The layout audit (rldiag.analysis.layout_audit): the spread statistics on constructed per-layout
metric frames, the layouts planned (named, skipped where verl would refuse, duplicates folded),
the JSON shape, ``why``; then the driver, the API and the command on small synthetic runs."""

from __future__ import annotations

import json
import math

import polars as pl
import pytest

import rldiag
from rldiag.analysis.layout_audit import (
    COMBINATIONS,
    NOTE_DYNAMIC,
    NOTE_PADDING,
    OWN,
    AuditLayout,
    LayoutAuditResult,
    WhyContext,
    audit_metrics,
    candidate_layouts,
    combination,
    plan_layouts,
    refusal,
    why,
)
from rldiag.cli.main import main
from rldiag.config.settings import resolve_settings
from rldiag.synth import SynthSpec, write_synth_run

A = "actor_rollout_ref.actor."


def frame(values: dict[int, dict[str, float | None]]) -> pl.DataFrame:
    return pl.DataFrame([{"step": s, **row} for s, row in values.items()])


# ---- the statistics ------------------------------------------------------------------------------


def test_relative_spread_is_the_median_over_steps_of_the_range_over_own():
    frames = {
        OWN: frame({1: {"actor/pg_clipfrac": 0.10, "critic/score/mean": 0.5},
                    2: {"actor/pg_clipfrac": 0.20, "critic/score/mean": 0.7},
                    3: {"actor/pg_clipfrac": 0.40, "critic/score/mean": 0.9}}),
        "one_batch": frame({1: {"actor/pg_clipfrac": 0.12, "critic/score/mean": 0.5},
                            2: {"actor/pg_clipfrac": 0.20, "critic/score/mean": 0.7},
                            3: {"actor/pg_clipfrac": 0.30, "critic/score/mean": 0.9}}),
        "dp=2": frame({1: {"actor/pg_clipfrac": 0.09, "critic/score/mean": 0.5},
                       2: {"actor/pg_clipfrac": 0.21, "critic/score/mean": 0.7},
                       3: {"actor/pg_clipfrac": 0.40, "critic/score/mean": 0.9}}),
    }
    got = {m.metric: m for m in audit_metrics(frames)}
    clip = got["actor/pg_clipfrac"]
    # per step (max - min) / |own|: 0.03/0.1, 0.01/0.2, 0.1/0.4 -> median 0.25
    assert clip.relative_spread == pytest.approx(0.25)
    assert clip.layout_dependent and clip.combination == "mean" and clip.why
    assert clip.values == pytest.approx({OWN: 0.7 / 3, "one_batch": 0.62 / 3, "dp=2": 0.70 / 3})
    assert set(clip.differs_in) == {"one_batch", "dp=2"}
    score = got["critic/score/mean"]
    assert score.relative_spread == 0.0 and not score.layout_dependent and score.differs_in == []
    assert score.combination == "step"


def test_the_threshold_the_zero_own_value_and_missing_values():
    frames = {
        OWN: frame({1: {"a": 1.0, "zero": 0.0, "nan": float("nan"), "part": 2.0},
                    2: {"a": 1.0, "zero": 0.0, "nan": float("nan"), "part": 2.0}}),
        "x": frame({1: {"a": 1.0 + 5e-6, "zero": 0.0, "nan": 1.0, "part": None},
                    2: {"a": 1.0 + 2e-5, "zero": 0.0, "nan": 2.0, "part": 2.5}}),
    }
    got = {m.metric: m for m in audit_metrics(frames)}
    assert got["a"].relative_spread == pytest.approx(1.25e-5) and got["a"].layout_dependent  # median of 5e-6, 2e-5
    only_small = audit_metrics({OWN: frame({1: {"a": 1.0}}), "x": frame({1: {"a": 1.0 + 5e-6}})})[0]
    assert not only_small.layout_dependent  # 5e-6 <= 1e-5
    assert got["zero"].relative_spread == 0.0 and not got["zero"].layout_dependent  # 0 / (0 + 1e-12)
    assert math.isnan(got["nan"].relative_spread) and not got["nan"].layout_dependent  # no own value
    # a missing value of another layout: the step's range over the layouts that have it
    assert got["part"].relative_spread == pytest.approx((0.0 + 0.25) / 2)


def test_best_match_names_the_layout_closest_to_the_log_and_ties_go_to_own():
    frames = {OWN: frame({1: {"m": 1.0, "same": 3.0}, 2: {"m": 2.0, "same": 3.0}}),
              "one_batch": frame({1: {"m": 1.5, "same": 3.0}, 2: {"m": 3.0, "same": 3.0}})}
    logged = {1: {"m": 1.5, "same": 3.0, "other": 1.0}, 2: {"m": 2.9, "same": 3.0}}
    got = {m.metric: m for m in audit_metrics(frames, logged)}
    assert got["m"].best_match == "one_batch"
    assert got["m"].best_match_error == pytest.approx(0.1 / 2.9 / 2)  # median of 0 and 0.1/2.9
    assert got["m"].logged_errors[OWN] == pytest.approx((0.5 / 1.5 + 0.9 / 2.9) / 2)
    assert got["same"].best_match == OWN  # every layout matches: the first
    assert "other" not in got  # logged but never recomputed


# ---- why ----------------------------------------------------------------------------------------


def test_every_metric_has_one_combination_and_words_for_it():
    assert COMBINATIONS[-1] == ("*", "step")
    assert combination("actor/pg_loss") == combination("critic/vf_loss") == "loss"
    assert combination("actor/pg_clipfrac") == combination("critic/vpred_mean") == "mean"
    assert combination("actor/rollout_corr/rollout_is_mean") == "mean"
    assert combination("rollout_corr/rollout_is_mean") == "step"
    assert combination("rldiag/clip_cov/clipped") == "count"
    ctx = WhyContext()
    assert why("actor/pg_clipfrac", ctx).startswith("a mean of per-micro-batch means")
    assert why("actor/pg_loss", ctx).startswith("a sum over micro-batches of token-sum-normalised losses")
    assert "row means over the mini-batch's row count" in why("actor/pg_loss", WhyContext(actor_agg="seq-mean-token-mean"))
    assert "geo_mean" in why("actor/pg_loss", WhyContext(loss_mode="geo_mean"))
    assert "critic" not in why("critic/vf_loss", WhyContext(critic_agg="token-sum")) and "token sums" in why(
        "critic/vf_loss", WhyContext(critic_agg="token-sum"))
    moved = WhyContext(actor_agg="seq-mean-token-sum", padded=frozenset({"dp=4"}), dynamic=frozenset({"dynamic_bsz=on"}))
    assert NOTE_PADDING in why("actor/pg_loss", moved, ["dp=4"])
    assert NOTE_PADDING not in why("actor/pg_loss", moved, ["one_batch"])
    assert why("actor/ppo_kl", moved, ["dynamic_bsz=on"]).endswith(NOTE_DYNAMIC)
    assert NOTE_DYNAMIC not in why("critic/score/mean", moved, ["dynamic_bsz=on"])


# ---- the layouts --------------------------------------------------------------------------------


def config(mini: int | None = 4, micro: int | None = 2, n: int = 4, dynamic: bool = False, **trainer) -> dict:
    actor: dict = {"use_dynamic_bsz": dynamic}
    if mini is not None:
        actor["ppo_mini_batch_size"] = mini
    if micro is not None:
        actor["ppo_micro_batch_size_per_gpu"] = micro
    return {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": actor, "rollout": {"n": n}},
            "trainer": trainer}


def plan(cfg: dict, rows=(16, 16), overrides: dict | None = None) -> dict[str, AuditLayout]:
    s = resolve_settings(config=cfg, overrides=overrides)
    layouts = plan_layouts(s, list(rows), lambda extra: resolve_settings(config=cfg, overrides={**(overrides or {}), **extra}))
    return {x.name: x for x in layouts}


def test_the_layouts_are_named_and_every_one_is_accounted_for():
    names = [x.name for x in candidate_layouts(resolve_settings(config=config()))]
    assert names == ["own", "one_batch", "micro_batch_x0.5", "micro_batch_x2", "dp=1", "dp=2", "dp=4",
                     "dynamic_bsz=on", "dynamic_bsz=off", "mini_batch_x0.5", "balance_batch=off"]
    got = plan(config())  # mini 16 rows, micro 2 rows, dp 1, V1
    folded = [n for x in got.values() for n in x.folded]
    assert sorted([*got, *folded]) == sorted(names)  # each listed once, or folded into one listed
    assert got[OWN].folded == ["dp=1", "dynamic_bsz=off"] and got[OWN].runs and got[OWN].settings == {}
    assert got["micro_batch_x0.5"].settings == {"rldiag.micro_batch_size": 1}
    assert got["micro_batch_x2"].settings == {"rldiag.micro_batch_size": 4} and got["micro_batch_x2"].runs
    assert got["mini_batch_x0.5"].settings == {"rldiag.mini_batch_size": 8} and got["mini_batch_x0.5"].runs
    assert got["dp=2"].runs and got["dp=4"].runs and "dp 4" in got["dp=4"].layout
    assert got["dynamic_bsz=on"].dynamic and got["one_batch"].runs
    assert "V1 trainer balances every step" in got["balance_batch=off"].skipped


def test_what_verl_would_refuse_is_skipped_with_its_reason():
    got = plan(config(mini=1, micro=2, n=4))  # mini-batches of 4 rows, micro 2
    assert got["dp=2"].runs  # 2 rows per rank, micro 2
    assert "does not divide its share of a mini-batch per rank (4 rows / dp 4 = 1)" in got["dp=4"].skipped
    assert "prepare_micro_batches asserts" in got["dp=4"].skipped
    assert got["micro_batch_x2"].runs and got["micro_batch_x2"].settings == {"rldiag.micro_batch_size": 4}
    assert "(1 prompt x rollout.n 4) halves to 2 rows" in got["mini_batch_x0.5"].skipped
    odd = plan(config(mini=3, micro=1, n=2))  # mini-batches of 6 rows: not a multiple of dp 4
    assert "must be a multiple of rldiag.dp_size (4)" in odd["dp=4"].skipped
    whole = plan(config(mini=None, micro=3, n=4), rows=(16, 12))  # each step one mini-batch, micro 3
    assert whole[OWN].runs  # the run's own layout is the reference, whatever the check says
    assert "its share of a step per rank (12, 16 rows)" in whole["micro_batch_x2"].skipped
    assert "cannot be halved to a whole number" in whole["micro_batch_x0.5"].skipped
    assert "(6, 8 rows)" in whole["dp=2"].skipped and "(3, 4 rows)" in whole["dp=4"].skipped


def test_the_legacy_trainer_balance_batch_and_uneven_ranks():
    legacy = plan(config(use_v1=False))
    assert "balance_batch=off" in legacy[OWN].folded  # at dp 1 balancing has nothing to do
    two = plan(config(use_v1=False), overrides={"rldiag.dp_size": 2})
    assert two["balance_batch=off"].runs and two["balance_batch=off"].settings == {"trainer.balance_batch": False}
    assert "rows dealt as stored" in two["balance_batch=off"].layout and "balanced by rldiag" in two[OWN].layout
    uneven = plan(config(mini=2, micro=1, n=2, use_v1=False), rows=(14, 14))
    assert "a step of 14 rows does not split over 4 DP ranks" in uneven["dp=4"].skipped and uneven["dp=2"].runs
    captured = plan({**config(use_v1=False), "rldiag": {"capture": {"trainer": "legacy"}}})
    assert "order before it is not known" in captured["balance_batch=off"].skipped
    assert captured["dp=2"].settings == {"rldiag.dp_size": 2, "rldiag.rows_balanced": False}


def test_dynamic_batches_and_runs_without_batch_keys():
    dyn = plan(config(micro=None, dynamic=True))
    assert "token budget" in dyn["micro_batch_x0.5"].skipped
    assert "ppo_micro_batch_size_per_gpu, which the run's config does not set" in dyn["dynamic_bsz=off"].skipped
    assert "dynamic_bsz=on" in dyn[OWN].folded
    bare = plan({"algorithm": {"adv_estimator": "grpo"}})  # no batch keys: each step one batch
    assert sorted(bare[OWN].folded) == ["dp=1", "dynamic_bsz=off", "one_batch"]
    assert "no micro-batch size to scale" in bare["micro_batch_x0.5"].skipped
    assert "no mini-batch size to scale" in bare["mini_batch_x0.5"].skipped


def test_refusal_checks_the_mini_batch_against_the_step():
    s = resolve_settings(config=config(mini=8, micro=2))  # 32 rows
    assert "larger than a step (16 rows)" in refusal(s, [16])
    assert refusal(s, [32, 32]) is None


# ---- the result's shape ---------------------------------------------------------------------------


def _result() -> LayoutAuditResult:
    frames = {OWN: frame({1: {"actor/pg_clipfrac": 0.1, "critic/score/mean": 1.0}}),
              "one_batch": frame({1: {"actor/pg_clipfrac": 0.2, "critic/score/mean": 1.0}})}
    layouts = [AuditLayout(OWN, {}, folded=["dp=1"], layout="V1, dp 1"),
               AuditLayout("one_batch", {"rldiag.dp_size": 1}, layout="V1, dp 1"),
               AuditLayout("dp=2", {"rldiag.dp_size": 2}, skipped="verl refuses")]
    return LayoutAuditResult(run="r", path=None, layouts=layouts, metrics=audit_metrics(frames, {1: {"actor/pg_clipfrac": 0.2}}),
                             steps=[1])


def test_the_json_shape():
    d = json.loads(json.dumps(_result().to_dict()))
    assert set(d) == {"layouts", "metrics"}
    assert [x["name"] for x in d["layouts"]] == [OWN, "one_batch", "dp=2"]
    for x in d["layouts"]:
        assert {"name", "settings", "skipped"} <= set(x) and isinstance(x["settings"], dict)
    assert d["layouts"][2]["skipped"] == "verl refuses" and d["layouts"][0]["skipped"] is None
    assert d["layouts"][0]["folded"] == ["dp=1"]
    for m in d["metrics"]:
        assert {"metric", "layout_dependent", "relative_spread", "values", "why"} <= set(m)
        assert set(m["values"]) == {OWN, "one_batch"}
        if m["layout_dependent"]:
            assert m["why"]
    clip = next(m for m in d["metrics"] if m["metric"] == "actor/pg_clipfrac")
    assert clip["layout_dependent"] and clip["relative_spread"] == pytest.approx(1.0) and clip["best_match"] == "one_batch"


def test_the_frames():
    r = _result()
    f = r.metrics_frame()
    assert f.columns[:7] == ["metric", "layout_dependent", "relative_spread", "best_match", "best_match_error",
                             "combination", "why"]
    assert f.columns[7:] == [OWN, "one_batch"] and f.height == 2
    lf = r.layouts_frame()
    assert lf["name"].to_list() == [OWN, "one_batch", "dp=2"] and lf["skipped"].to_list()[2] == "verl refuses"


# ---- the driver, the API, the command ---------------------------------------------------------


@pytest.fixture
def batched_run(tmp_path):
    """3 steps of 16 rows (4 prompts x 4), mini-batches of 8 rows, micro-batches of 2."""
    cfg = config(mini=2, micro=2)
    cfg["actor_rollout_ref"]["actor"].update(loss_agg_mode="token-mean", clip_ratio=0.1)
    return write_synth_run(tmp_path / "run", SynthSpec(steps=3, prompts=4, n=4, seed=5, drift=0.3, config=cfg))


def test_the_api_audits_and_writes_the_sweep(batched_run):
    calls = []
    r = rldiag.layout_audit(batched_run, steps="1:2", progress=lambda d, t, w: calls.append((d, t, w)))
    assert isinstance(r, rldiag.LayoutAuditResult) and r.steps == [1, 2]
    ran = [x.name for x in r.ran]
    assert ran[0] == OWN and {"one_batch", "micro_batch_x0.5", "micro_batch_x2", "dp=2", "dp=4"} <= set(ran)
    assert [c[0] for c in calls] == list(range(1, 2 * len(ran) + 1)) and {c[1] for c in calls} == {2 * len(ran)}
    assert {c[2] for c in calls} == {f"{x}: step {s}" for x in ran for s in (1, 2)}
    audit = batched_run / "rldiag" / "sweeps" / "layout-audit"
    meta = json.loads((audit / "audit.json").read_text())
    assert meta["steps"] == [1, 2] and [x["name"] for x in meta["layouts"]] == [x.name for x in r.layouts]
    for x in ran:
        assert (audit / x / "scenario.json").is_file() and (audit / x / "metrics.parquet").is_file()
    assert not (batched_run / "rldiag" / "scenarios").exists()  # the audit's scenarios are its own
    assert pl.read_parquet(audit / "metrics.parquet")["metric"].to_list() == [m.metric for m in r.metrics]
    dep = {m.metric for m in r.dependent}
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss"} <= dep
    assert not r.metric("critic/advantages/mean").layout_dependent
    assert not r.metric("response_length/mean").layout_dependent
    assert all(m.why for m in r.dependent)
    assert all(m.combination != "step" for m in r.dependent)  # what the trainer computes over the step never moves
    assert r.metric("critic/score/mean").best_match == OWN  # logged, the same everywhere: own
    frame_ = r.metrics_frame()
    assert set(frame_.filter(pl.col("layout_dependent"))["metric"]) == dep
    # a trainer that ran on 2 ranks: its log matches dp=2 best, where the layout matters
    dp2 = pl.read_parquet(audit / "dp=2" / "metrics.parquet")
    lines = [{"step": row["step"], "data": {k: v for k, v in row.items() if k != "step" and v is not None}}
             for row in dp2.to_dicts()]
    (batched_run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    again = rldiag.layout_audit(batched_run, steps="1:2")  # unchanged steps are reused
    assert [m.relative_spread for m in again.metrics] == [m.relative_spread for m in r.metrics]
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss"):
        assert again.metric(name).best_match == "dp=2" and again.metric(name).best_match_error == 0.0
    assert again.metric("critic/score/mean").best_match == OWN


def test_the_command_prints_the_json(batched_run, capsys):
    assert main(["layout-audit", str(batched_run), "--steps", "1", "--json", "--no-progress"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) == {"layouts", "metrics"}
    assert all({"name", "settings", "skipped"} <= set(x) for x in d["layouts"])
    assert all({"metric", "layout_dependent", "relative_spread", "values", "why"} <= set(m) for m in d["metrics"])
    assert any(m["layout_dependent"] for m in d["metrics"])


def test_the_command_prints_the_table(batched_run, capsys):
    assert main(["layout-audit", str(batched_run), "--steps", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "actor/pg_clipfrac" in out and "relative spread" in out and "a mean of per-micro-batch means" in out
    assert "skipped balance_batch=off: the V1 trainer balances every step" in out
    assert "layout own:" in out and "(also dp=1" in out
