"""rldiag.viz: the helpers behind the pages (no Streamlit)."""

from __future__ import annotations

import dataclasses

import polars as pl
import pytest

from rldiag import api
from rldiag.config.settings import resolve_settings
from rldiag.store import StepFacts
from rldiag.viz import checklist, whatif
from rldiag.viz.charts import heat_strip, mask_spans, metric_grid
from rldiag.viz.metric_groups import NO_PREFIX, default_selection, filter_names, follow_range, group_by_prefix, search
from rldiag.viz.offpolicy import OTHER, panels
from rldiag.viz.runs import default_run, initial_run, run_from_argv
from rldiag.viz.smoothing import ema
from rldiag.viz.timefmt import ago, live_line

NAMES = ["actor/pg_loss", "actor/ppo_kl", "critic/score/mean", "rollout_corr/kl", "lr", "actor/pg_clipfrac"]


def test_groups_and_search():
    g = group_by_prefix(NAMES)
    assert list(g) == ["actor/", "critic/", "rollout_corr/", NO_PREFIX]
    assert g["actor/"] == ["actor/pg_clipfrac", "actor/pg_loss", "actor/ppo_kl"]
    assert search(NAMES, "KL") == ["actor/ppo_kl", "rollout_corr/kl"]
    assert search(NAMES, "actor pg") == ["actor/pg_loss", "actor/pg_clipfrac"]
    assert search(NAMES, "actor/*kl") == ["actor/ppo_kl"]
    assert filter_names(NAMES, "kl", ["rollout_corr/"]) == ["rollout_corr/kl"]
    assert default_selection(NAMES) == ["critic/score/mean", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss"]
    assert default_selection(["b", "a"]) == ["b", "a"]


def test_ema_is_tensorboards_debiased_average():
    f = pl.DataFrame({"step": [3, 1, 2, 1], "metric": ["a", "a", "a", "b"], "v": [4.0, 1.0, None, 7.0]})
    out = ema(f, ["v"], 0.5)
    a = out.filter(pl.col("metric") == "a")["v"].to_list()
    assert a[0] == 1.0 and a[1] is None and a[2] == pytest.approx((4.0 + 0.5 * 1.0) / 1.5)
    assert out.filter(pl.col("metric") == "b")["v"].to_list() == [7.0]
    assert ema(f, ["v"], 0.0) is f
    with pytest.raises(ValueError):
        ema(f, ["v"], 1.0)


def test_offpolicy_panels():
    p = panels(["rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_is_mean", "rollout_corr/kl",
                "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/log_ppl_diff",
                "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/new_thing", "actor/pg_loss"])
    assert p == {
        "Effective sample size": ["rollout_corr/rollout_is_eff_sample_size"],
        "Rejection fractions": ["rollout_corr/rollout_rs_masked_fraction"],
        "IS weights": ["rollout_corr/rollout_is_mean"],
        "Chi-squared": ["rollout_corr/chi2_token"],
        "Rollout vs train KL": ["rollout_corr/k3_kl", "rollout_corr/kl"],
        "PPL gap": ["rollout_corr/log_ppl_diff"],
        OTHER: ["rollout_corr/new_thing"],
    }


def test_run_from_the_command_line(tmp_path):
    assert run_from_argv(["/x/app/main.py", "/runs/a"]) == "/runs/a"
    assert run_from_argv(["/x/app/main.py"]) is None
    assert run_from_argv(["/usr/bin/pytest", "tests/app"]) is None  # a test runner's argv is not a run
    assert initial_run(["pytest"], env={"RLDIAG_RUN": "/r"}) == "/r"
    samples = tmp_path / "samples"
    (samples / "aaa" / "batches").mkdir(parents=True)
    (samples / "aaa" / "batches" / "step_1.parquet").write_bytes(b"")
    (samples / "empty").mkdir()
    assert default_run(samples) == samples / "aaa"
    (samples / "ppo-gae" / "batches").mkdir(parents=True)
    (samples / "ppo-gae" / "batches" / "step_1.parquet").write_bytes(b"")
    assert default_run(samples) == samples / "ppo-gae"
    assert default_run(tmp_path / "none") is None


def test_whatif_overrides_only_what_changed():
    s = resolve_settings(config={"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": {"clip_ratio": 0.2}}})
    base = api.whatif_options(s).base
    assert base[whatif.CLIP_LOW] == 0.2 and base[whatif.CLIP_HIGH] == 0.2
    same = dict(base, **{whatif.CLIP_HIGH: 0.2 + 1e-15})
    assert whatif.overrides(base, same) == {}
    ovr = whatif.overrides(base, dict(base, **{whatif.ESTIMATOR: "rloo", whatif.CLIP_HIGH: 0.28}))
    assert ovr == {whatif.ESTIMATOR: "rloo", whatif.CLIP_HIGH: 0.28}
    assert whatif.scenario_name(ovr) == "clip_ratio_high=0.28__adv_estimator=rloo"
    assert whatif.parse_value("0.5_2.0") == "0.5_2.0" and whatif.parse_value("2") == 2 and whatif.parse_value("") is None
    assert whatif.rs_value(["token_k1", "seq_sum_k3"]) == "token_k1,seq_sum_k3" and whatif.rs_value([]) is None
    opts = api.whatif_options(s)
    assert "grpo" in opts.choices[whatif.ESTIMATOR] and "token-mean" in opts.choices[whatif.AGG]
    assert "vanilla" in opts.choices[whatif.LOSS] and opts.choices[whatif.IS_LEVEL] == ["sequence", "token"]
    assert opts.choices[whatif.KL_CTRL] == ["fixed", "adaptive"]  # the schema's values of kl_ctrl.type
    kl = opts.choices[whatif.KL_PENALTY]
    assert kl == opts.choices[whatif.KL_LOSS_TYPE] and "low_var_kl" in kl


def test_the_page_places_every_key_the_schema_marks_and_no_other():
    opts = api.whatif_options(resolve_settings())
    assert sorted(whatif.PLACED) == sorted(opts.keys) and len(set(whatif.PLACED)) == len(whatif.PLACED)
    assert set(opts.base) == set(opts.keys)
    # every string key the page offers as a list of choices has one
    assert {whatif.ESTIMATOR, whatif.AGG, whatif.LOSS, whatif.KL_PENALTY, whatif.KL_CTRL, whatif.KL_LOSS_TYPE,
            whatif.IS_LEVEL, whatif.RS} <= set(opts.choices)


def test_the_group_estimators_are_the_registrys_grouped_ones():
    from rldiag.engine.advantage import ESTIMATORS

    grouped = api.whatif_options(resolve_settings()).grouped
    assert set(grouped) == {"grpo", "grpo_vectorized", "grpo_passk", "gdpo", "gpg", "opo", "rloo", "rloo_vectorized",
                            "reinforce_plus_plus_baseline", "optimal_token_baseline", "tir_optimal_token_baseline"}
    assert not {"gae", "reinforce_plus_plus", "remax"} & set(grouped) and set(grouped) <= set(ESTIMATORS.names())


def test_mask_spans_and_the_heat_strip():
    assert mask_spans([1, 0, 0, 1, 0]) == [(1, 2), (4, 4)]
    assert mask_spans([1, 1]) == [] and mask_spans([0]) == [(0, 0)]
    fig = heat_strip({"mask": [1, 0, 0, 1], "post_mask": [1, 0, 0, 0], "advantages": [0.5, 0.0, 0.0, -0.5],
                      "ratio": [1.0, 1.1, 0.9, 1.0]})
    assert [t.y[0] for t in fig.data] == ["advantage", "ratio π/π_old", "mask (batch)", "mask (after correction)"]
    # the tool span, shaded on every strip and labelled once
    assert [(s.x0, s.x1) for s in fig.layout.shapes] == [(0.5, 2.5)] * 4
    assert [a.text for a in fig.layout.annotations] == ["tool"]
    assert fig.data[0].zmin == -0.5 and fig.data[0].zmax == 0.5  # centred on 0


def test_metric_grid_puts_every_source_on_the_metric_panel():
    j = pl.DataFrame({"step": [1, 2, 1, 2], "metric": ["a", "a", "b", "b"], "logged": [1.0, 2.0, None, None],
                      "base": [1.5, 2.5, 3.0, 4.0]})
    fig = metric_grid(j, ["a", "b"], {"logged": "logged", "base": "base"})
    panels_ = {(t.name, t.xaxis) for t in fig.data}
    assert panels_ == {("logged", "x"), ("base", "x"), ("base", "x2")}
    assert [t.showlegend for t in fig.data] == [True, True, False]


def _facts(**kw) -> StepFacts:
    base = StepFacts(step=1, rows=8, columns=[], groups=2, group_sizes={4: 2}, multi_groups=2, flat_groups=0,
                     score_min=0.0, score_max=1.0, score_mean=0.5, score_zero_rows=4, actor_tokens=80,
                     scenario="s", rewards_compared=8, rewards_sign_flips=0, rewards_max_abs_change=0.0,
                     rejected_tokens=0, unmasked_tokens=0, adv_tokens=80, adv_mean=0.0, adv_std=1.0,
                     adv_positive_fraction=0.5, adv_nonfinite=0, ratio_tokens=80, ratio_mean=1.0, ratio_min=0.9,
                     ratio_max=1.1)
    return dataclasses.replace(base, **kw)


def _status(checks, order):
    return next(c.status for c in checks if c.order == order)


def test_checklist_healthy_step_passes():
    checks = checklist.evaluate(_facts(), "grpo", 4, {"logged": {"actor/pg_clipfrac": 0.1, "actor/ppo_kl": 0.01}})
    assert [c.order for c in checks] == list(range(1, 9))
    assert [c.status for c in checks] == ["ok", "ok", "ok", "ok", "ok", "ok", "n/a", "info"]
    assert "pg_clipfrac 0.1" in checks[7].finding


@pytest.mark.parametrize(
    "change, order, status, words",
    [
        (dict(score_nonfinite=2), 1, "fail", "non-finite"),
        (dict(score_zero_rows=8), 1, "warn", "no reward"),
        (dict(score_vs_scalar_mismatch=1), 1, "fail", "token_level_scores"),
        (dict(rewards_sign_flips=3), 2, "fail", "flips the sign of 3"),
        (dict(rewards_max_abs_change=0.8), 2, "warn", "80%"),
        (dict(scenario=None, rewards_compared=None), 2, "n/a", "saved tokens"),
        (dict(unmasked_tokens=5), 3, "fail", "5 tokens"),
        (dict(rows_outside_loss_mask=2), 3, "fail", "loss_mask"),
        (dict(rows_without_actor=1), 3, "warn", "no actor token"),
        (dict(group_sizes={1: 1, 4: 2}, groups=3), 4, "warn", "single row"),
        (dict(group_sizes={3: 2}), 4, "warn", "rollout.n = 4"),
        (dict(sessions=5), 4, "info", "Multi-output"),
        (dict(flat_groups=2), 5, "fail", "nothing to learn"),
        (dict(flat_groups=1), 5, "warn", "1 of 2"),
        (dict(adv_std=0.0), 6, "fail", "no gradient"),
        (dict(adv_positive_fraction=0.99), 6, "warn", "one sign"),
        (dict(adv_nonfinite=3), 6, "fail", "non-finite"),
    ],
)
def test_checklist_catches_each_planted_problem(change, order, status, words):
    c = next(c for c in checklist.evaluate(_facts(**change), "grpo", 4) if c.order == order)
    assert c.status == status and words in c.finding


def test_checklist_reinforce_pp_and_clipfrac():
    checks = checklist.evaluate(_facts(tool_rows=3), "reinforce_plus_plus")
    assert _status(checks, 7) == "warn" and "resets" in checks[6].finding
    assert _status(checklist.evaluate(_facts(), "reinforce_plus_plus"), 7) == "ok"
    # the healthy sides are the doctor's rules' (one source): clip fraction above 0.3 warns, 0.25 does not
    from rldiag import api

    limits = api.rule_limits()
    assert limits["actor/pg_clipfrac"]["above"] == 0.3 and limits["actor/ppo_kl"]["above"] == 0.1
    checks = checklist.evaluate(_facts(), "grpo", at_step={"s": {"actor/pg_clipfrac": 0.45}}, limits=limits)
    assert _status(checks, 8) == "warn" and "pg_clipfrac above 0.3 (rule clipfrac_high)" in checks[7].finding
    checks = checklist.evaluate(_facts(), "grpo", at_step={"s": {"actor/pg_clipfrac": 0.25, "actor/ppo_kl": -0.2}},
                                limits=limits)
    assert _status(checks, 8) == "warn" and "|ppo_kl| above 0.1 (rule ppo_kl_high)" in checks[7].finding
    assert "rule clipfrac_high" not in checks[7].finding  # 0.25 is inside the rule's healthy side
    moved = {**limits, "actor/pg_clipfrac": {**limits["actor/pg_clipfrac"], "above": 0.5}}
    assert _status(checklist.evaluate(_facts(), "grpo", at_step={"s": {"actor/pg_clipfrac": 0.45}}, limits=moved), 8) != "warn"
    assert _status(checklist.evaluate(_facts(flat_groups=2), "gae"), 5) == "info"


def test_time_words():
    assert ago(3.2) == "3 s ago" and ago(125) == "2 min ago" and ago(7200) == "2.0 h ago"
    assert live_line(12, 12, 100.0, 103.0) == "Latest logged step **12** (12 steps), written 3 s ago."
    assert live_line(None, 0, None, 0).startswith("No logged metrics")


def test_step_page_opens_on_a_row_with_a_tool_span():
    from rldiag.viz.stepview import interesting_row, rollout_n

    rows = pl.DataFrame({"row": [0, 1, 2, 3], "tool_tokens": [0, 2, 0, 3], "score_total": [1.0, 0.0, 1.0, 1.0]})
    assert interesting_row(rows) == 3
    assert interesting_row(rows.with_columns(pl.lit(0.0).alias("score_total"))) == 1
    assert interesting_row(rows.with_columns(pl.lit(0).alias("tool_tokens"))) == 0
    assert rollout_n({"actor_rollout_ref.rollout.n": 8}) == 8 and rollout_n({}) is None


def test_step_range_follows_growth():
    assert follow_range((2, 10), 10, (1, 12)) == (2, 12)  # reached the end: keeps following
    assert follow_range((2, 8), 10, (1, 12)) == (2, 8)  # narrowed: stays
    assert follow_range((5, 9), 9, (1, 4)) == (1, 4)  # the file was rewritten shorter
    assert follow_range((2, 8), None, (1, 12)) == (2, 8)


def test_panels_helpers():
    import polars as pl

    from rldiag.viz.panels import identical_sources, merge_runs, overlap_note, run_labels

    f = pl.DataFrame({"step": [1, 2, 1, 2], "metric": ["a", "a", "b", "b"], "logged": [1.0, float("nan"), 1.0, 2.0],
                      "s": [1.0, float("nan"), 1.0, 2.5]})
    pairs = identical_sources(f, {"logged": "logged", "s": "s"})
    assert pairs == [("logged", "s", ["a"])]
    assert "**logged** and **s** are identical on `a`" in overlap_note(pairs) and overlap_note([]) is None
    other = pl.DataFrame({"step": [2, 3], "metric": ["a", "a"], "logged": [5.0, 6.0]})
    merged, legend = merge_runs(f, {"main · logged": "logged"}, {"r2": (other, {"logged": "logged"})})
    assert legend == {"main · logged": "logged", "r2 · logged": "r2 · logged"}
    assert merged.filter(metric="a")["r2 · logged"].to_list() == [None, 5.0, 6.0]
    assert run_labels(["/x/a/run", "/y/b/run", "/z/c"]) == {"/x/a/run": "a/run", "/y/b/run": "b/run", "/z/c": "c"}


def test_estimator_fit_warns_for_groups_of_one():
    grouped = api.whatif_options(resolve_settings()).grouped
    assert "6 groups of 1" in whatif.estimator_fit("rloo", [1] * 6, 3, grouped)
    assert "2 of 3 groups" in whatif.estimator_fit("grpo", [1, 1, 4], 3, grouped)
    assert whatif.estimator_fit("rloo", [4, 4], 1, grouped) is None
    assert whatif.estimator_fit("gae", [1] * 6, 1, grouped) is None
    assert whatif.estimator_fit("reinforce_plus_plus", [1], 1, grouped) is None


def test_ref_kl_strip_scale_comes_from_the_row():
    fig = heat_strip({"mask": [1, 1, 1], "ref_kl": [0.002, -0.004, 0.001]})
    kl = fig.data[0]
    assert kl.y[0] == "ref KL" and (kl.zmin, kl.zmax) == (-0.004, 0.004)


def test_token_html_colours_and_marks_tools():
    from rldiag.viz.tokentext import context_line, token_html

    body = token_html(["a", "b", "<c>"], [1, 0, 1], [2.0, None, -1.0], "advantages")
    assert body.count("<span title=") == 3 and ">tool</span>" in body and "&lt;c&gt;" in body
    # the app's convention (rldiag.viz.colours): +2 full blue, -1 half red
    assert "rgba(33,102,172,0.850)" in body and "rgba(178,24,43,0.425)" in body
    assert "advantage: blue above 0, red below" in body
    assert context_line(["x", "y"], "z", ["w"]) == "…xy[z]w…"


def test_streamed_compare_redraws_and_partial_view():
    from rldiag.analysis.agreement import TokenAgreement
    from rldiag.viz.comparison import partial_view, redraw_due

    assert [d for d in range(1, 7) if redraw_due(d, 6)] == [1, 2, 3, 4, 5]  # never after the last
    assert [d for d in range(1, 101) if redraw_due(d, 100)] == list(range(10, 100, 10))
    steps = [TokenAgreement(step=s, n_tokens=10 * s, sign_agreement=0.5, sign_flip_fraction=0.1, pearson=0.2 * s,
                            spearman=0.3, adv_mean_abs_change=1.0, weight_mean_abs_change=2.0, groups=4,
                            groups_signal_a=2, groups_signal_b=3, groups_signal_only_a=0, groups_signal_only_b=1,
                            weight_tokens=10 * s) for s in (1, 2)]
    rows, frame = partial_view(steps)
    values = {r["quantity"]: r["value"] for r in rows}
    assert values["steps compared"] == 2 and values["tokens compared"] == 30
    assert values["Pearson (mean over steps)"] == pytest.approx(0.3)
    assert values["groups with signal only in B"] == 2
    assert frame["step"].to_list() == [1, 2] and frame["pearson"].to_list() == pytest.approx([0.2, 0.4])
    assert partial_view([])[1].is_empty()
