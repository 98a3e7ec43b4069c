"""Doctor rules: the built-in file, user files that add and override rules, validation, and
each evaluator kind on hand-made series."""

from __future__ import annotations

import numpy as np
import pytest

from rldiag.cli.main import main
from rldiag.doctor import diagnose, load_rules
from rldiag.doctor.evaluators import RULE_KINDS, Context, Finding, Passed, Series, Skip
from rldiag.doctor.rule import Rule
from rldiag.doctor.rules import BUILTIN_RULES, read_rules_file
from rldiag.errors import ConfigError
from tests.doctor.runs import write_run


def _ctx(values, steps=None, settings=None, source="logged"):
    steps = np.arange(1, len(values) + 1) if steps is None else np.asarray(steps)
    series = Series("m", np.asarray(steps, np.int64), np.asarray(values, np.float64), source)
    return Context(settings=settings or {}, series=lambda name, src: series if name == "m" else None)


def _rule(kind="threshold", **params):
    common = {k: params.pop(k) for k in ("window", "min_steps", "when") if k in params}
    return Rule(id="r", kind=kind, title="t", why="w", metric=params.pop("metric", "m"), params=params, **common)


def _run(rule, ctx):
    return RULE_KINDS.get(rule.kind)(rule, ctx)


def test_builtin_rules_cover_the_issue():
    rules = load_rules()
    got = {r.id for r in rules}
    assert {"ppo_kl_high", "ppo_kl_collapse", "clipfrac_high", "dual_clip_firing", "vf_explained_var_negative",
            "advantages_not_centred", "no_signal_groups", "aborted_responses", "length_clipped", "kl_reward_sign_flip",
            "rollout_is_ess_low", "rollout_kl_growing", "rollout_chi2_growing", "rollout_ppl_gap_growing",
            "reinforce_pp_credit_cut", "double_kl_regularisation", "entropy_collapse"} <= got
    assert len(got) == len(read_rules_file(BUILTIN_RULES))
    assert all(r.why and r.severity in ("info", "warning", "critical") and r.origin == str(BUILTIN_RULES) for r in rules)
    # the rules the calibration corpus found to fire on healthy runs as often as on sick ones are information
    assert {r.id for r in rules if r.severity == "info"} == {"length_clipped", "reward_hacking_kl"}


def test_threshold_each_mean_abs_window():
    ctx = _ctx([0.0, 0.5, 0.5, 0.0])
    assert isinstance(_run(_rule(above=0.4, min_fraction=0.5), ctx), Finding)
    assert isinstance(_run(_rule(above=0.4, min_fraction=0.6), ctx), Passed)
    f = _run(_rule(above=0.4, stat="mean", window=3), ctx)  # mean of 0.5, 0.5, 0 = 0.333
    assert isinstance(f, Passed) and "0.3333" in f.detail
    f = _run(_rule(above=0.2, stat="mean", window=3), ctx)
    assert isinstance(f, Finding) and f.evidence.window == [2, 4] and f.evidence.steps == [2, 3, 4]
    neg = _ctx([-0.3, -0.3, 0.0])
    assert isinstance(_run(_rule(above=0.2, min_fraction=0.5), neg), Passed)
    f = _run(_rule(above=0.2, abs=True, min_fraction=0.5), neg)
    assert isinstance(f, Finding) and f.evidence.steps == [1, 2] and f.evidence.values == [0.3, 0.3]
    assert isinstance(_run(_rule(below=0.0, stat="last"), _ctx([1.0, -0.1])), Finding)
    assert isinstance(_run(_rule(above=0.0, min_steps=5), ctx), Skip)
    assert isinstance(_run(_rule(above=0.0, metric="absent"), ctx), Skip)
    assert isinstance(_run(_rule(above=0.4), _ctx([np.nan, np.nan, 0.5, 0.5])), Finding)  # NaN steps dropped


def test_trend_rising_and_falling():
    steps = np.arange(1, 10)
    rising = _ctx(np.linspace(0.001, 0.02, 9), steps)
    f = _run(_rule("trend", direction="rising", ratio=3.0, min_late=1e-3), rising)
    assert isinstance(f, Finding) and f.evidence.trend["slope_per_step"] > 0
    assert f.evidence.trend["early_mean"] == pytest.approx(np.mean(np.linspace(0.001, 0.02, 9)[:3]))
    assert isinstance(_run(_rule("trend", direction="rising", ratio=3.0, min_late=0.05), rising), Passed)
    assert isinstance(_run(_rule("trend", direction="rising", ratio=30.0), rising), Passed)
    flat = _ctx(np.full(9, 0.01) + np.tile([1e-4, -1e-4, 0], 3), steps)
    assert isinstance(_run(_rule("trend", direction="rising", ratio=1.5), flat), Passed)
    falling = _ctx(np.geomspace(1.0, 0.05, 9), steps)
    assert isinstance(_run(_rule("trend", direction="falling", ratio=0.3), falling), Finding)
    assert isinstance(_run(_rule("trend", direction="falling", ratio=0.3, min_early=2.0), falling), Passed)
    assert isinstance(_run(_rule("trend", direction="falling", ratio=0.3, min_steps=6), _ctx([1.0, 0.1])), Skip)


def test_settings_rule_and_when():
    rule = Rule(id="r", kind="settings", title="t", why="w", params={"match": {"a.b": True, "c": "x"}})
    assert isinstance(_run(rule, _ctx([], settings={"a.b": True, "c": "x"})), Finding)
    assert isinstance(_run(rule, _ctx([], settings={"a.b": True, "c": "y"})), Passed)
    w = _rule(above=0, when={"algorithm.adv_estimator": ["grpo", "rloo"], "x": 1})
    assert w.applies({"algorithm.adv_estimator": "rloo", "x": 1.0})
    assert not w.applies({"algorithm.adv_estimator": "gae", "x": 1})
    assert not _rule(above=0, when={"flag": True}).applies({"flag": 1})  # a bool is not a number


def test_user_rules_add_override_and_disable(tmp_path):
    user = tmp_path / "mine.yaml"
    user.write_text("""
rules:
  - id: no_signal_groups
    above: 0.95
  - id: entropy_collapse
    enabled: false
  - id: low_score
    kind: threshold
    metric: critic/score/mean
    below: 2.0
    stat: mean
    severity: critical
    title: Scores are low
    why: Every score of this task is at most 1.
""")
    rules = {r.id: r for r in load_rules([user])}
    assert rules["no_signal_groups"].params["above"] == 0.95 and rules["no_signal_groups"].origin == str(user)
    assert rules["no_signal_groups"].metric == "rldiag/groups/no_signal_fraction"  # the rest kept
    assert "entropy_collapse" not in rules
    root = write_run(tmp_path / "run", steps=3)
    rep = diagnose(root, rules_files=[user])
    assert [f.rule for f in rep.findings if f.severity != "info"] == ["low_score"]
    assert rep.findings[0].evidence.steps == [1, 2, 3] and rep.findings[0].severity == "critical"
    assert main(["doctor", str(root), "--rules", str(user)]) == 1


def test_warmup_leaves_the_runs_first_steps_unread():
    """A rule with ``warmup: N`` reads none of the run's first N steps (from the table's first
    step, whatever the metric): its window and min_steps count the steps after them."""
    from rldiag.doctor.evaluate import evaluate_rules
    from rldiag.doctor.signals import SignalTable

    table = SignalTable()
    table.add_logged(1, {"other": 0.0})  # the run starts at step 1; m from step 2
    for step, v in zip(range(2, 9), [9.0, 9.0, 9.0, 0.5, 0.5, 0.5, 0.5], strict=True):
        table.add_logged(step, {"m": v})
    rule = Rule(id="r", kind="threshold", title="t", why="w", metric="m", params={"above": 1.0, "stat": "max"})
    assert [f.evidence.steps for f in evaluate_rules([rule], table, {}).findings] == [[2, 3, 4, 5, 6, 7, 8]]
    late = Rule(id="r", kind="threshold", title="t", why="w", metric="m", params={"above": 1.0, "stat": "max"},
                warmup=3, min_steps=2)
    res = evaluate_rules([late], table, {})  # steps 1-3 unread: 9 at step 4 still counts
    assert res.findings and res.findings[0].evidence.window == [4, 8]
    later = Rule(id="r", kind="threshold", title="t", why="w", metric="m", params={"above": 1.0, "stat": "max"},
                 warmup=4, min_steps=2)
    assert "r" in evaluate_rules([later], table, {}).passed
    short = Rule(id="r", kind="threshold", title="t", why="w", metric="m", params={"above": 1.0, "stat": "max"},
                 warmup=4, min_steps=5)  # 4 steps left (5..8)
    assert "needs 5" in evaluate_rules([short], table, {}).not_evaluated["r"]
    windowed = Rule(id="r", kind="threshold", title="t", why="w", metric="m", params={"above": 1.0, "stat": "max"},
                    warmup=2, window=3)  # the tail of 3 (6..8), nothing before step 3 in any case
    assert "r" in evaluate_rules([windowed], table, {}).passed
    assert load_rules()[0].warmup == 0 and {r.id: r.warmup for r in load_rules()}["vf_explained_var_negative"] == 10


@pytest.mark.parametrize("text,message", [
    ("rules:\n  - id: x\n    kind: nope\n    title: t\n    why: w\n", "unknown kind 'nope'"),
    ("rules:\n  - id: x\n    kind: threshold\n    metric: m\n    abvoe: 1\n    title: t\n    why: w\n", "unknown key(s) abvoe"),
    ("rules:\n  - id: x\n    kind: threshold\n    above: 1\n    title: t\n    why: w\n", "needs 'metric'"),
    ("rules:\n  - id: x\n    kind: threshold\n    metric: m\n    title: t\n    why: w\n", "'above' and/or 'below'"),
    ("rules:\n  - id: x\n    kind: trend\n    metric: m\n    direction: up\n    ratio: 2\n    title: t\n    why: w\n",
     "rising or falling"),
    ("rules:\n  - id: ppo_kl_high\n    severity: loud\n", "severity must be one of"),
    ("rules:\n  - id: ppo_kl_high\n    window: 0\n", "'window' must be a positive integer"),
    ("rules:\n  - id: ppo_kl_high\n    warmup: -1\n", "'warmup' must be a non-negative integer"),
    ("rules:\n  - kind: threshold\n", "string 'id'"),
    ("rules: [unclosed\n", "not valid YAML"),
    ("- just a list\n", "a list under 'rules:'"),
    ("rules:\n  - id: x\n    kind: threshold\n    metric: m\n    above: 1\n    why: w\n", "'title' is required"),
])
def test_invalid_rules_are_reported(tmp_path, text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_rules([bad])
    assert message in str(err.value) and str(bad) in str(err.value)


def test_bad_rules_file_exits_2(tmp_path, capsys):
    root = write_run(tmp_path / "run", steps=2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - id: x\n    kind: nope\n    title: t\n    why: w\n")
    assert main(["doctor", str(root), "--rules", str(bad)]) == 2
    assert "unknown kind" in capsys.readouterr().err
    assert main(["doctor", str(root), "--rules", str(tmp_path / "missing.yaml")]) == 2
