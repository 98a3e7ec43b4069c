"""The column planner (rldiag/engine/requirements.py): what a recompute, the adaptive-KL replay,
each estimator, policy loss and metric family needs comes from the registries' metadata and the
stages' declarations; rldiag check's families keep their labels, order and needs; the loader
takes its columns from the caller."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rldiag.config.settings import resolve_settings
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.policy_loss import POLICY_LOSSES
from rldiag.engine.requirements import (
    BASE_NEED,
    ColumnPlan,
    Need,
    columns_by_stage,
    estimator_need,
    metric_family_needs,
    policy_loss_need,
    recompute_columns,
    reward_kl_columns,
)
from rldiag.engine.stages import STAGES

ROOT = Path(__file__).resolve().parents[2]
BYPASS = "algorithm.rollout_correction.bypass_mode"

#: rldiag check's metric families before the loss modes: its output is a contract (labels, order, needs)
CHECK_FAMILIES = {
    "actor/* (pg_loss, pg_clipfrac, ppo_kl)": ("old_log_probs", "log_probs"),
    "actor/entropy_loss": ("entropy",),
    "actor/kl_loss (use_kl_loss)": ("log_probs", "ref_log_prob"),
    "KL in reward (use_kl_in_reward)": ("old_log_probs", "ref_log_prob"),
    "critic/values/*, vf_explained_var": ("values",),
    "critic/vf_loss (vpreds)": ("vpreds", "values"),
    "rollout_corr/*": ("rollout_log_probs", "old_log_probs"),
    "algorithm.rollout_correction rollout_is / rollout_rs (IS weights, rejection)": ("rollout_log_probs", "old_log_probs"),
    "algorithm.rollout_correction.bypass_mode (old_log_probs := rollout_log_probs)": ("rollout_log_probs", "log_probs"),
    "prompt_length/*": ("prompt_length",),
    "num_turns/*": ("num_turns",),
    "tool_call_counts/*": ("tool_call_counts",),
}


def _settings(**overrides):
    return resolve_settings(overrides=overrides)


def test_check_families_keep_their_labels_order_and_needs():
    families = metric_family_needs()
    expected = list(CHECK_FAMILIES) + [f"loss_mode={name} (actor/*)" for name in POLICY_LOSSES.names()]
    assert list(families) == expected
    for label, cols in CHECK_FAMILIES.items():
        assert families[label] == Need(all_of=cols), label
    for name in POLICY_LOSSES.names():
        assert families[f"loss_mode={name} (actor/*)"].all_of == tuple(POLICY_LOSSES.meta(name).needs)


def test_every_stage_column_is_read_and_only_the_estimators_are_required():
    for name in ESTIMATORS.names():
        s = _settings(**{"algorithm.adv_estimator": name, "algorithm.gdpo_reward_keys": "acc,fmt"})
        plan = recompute_columns(s)
        stage_cols = {c for cols in columns_by_stage(s).values() for c in cols}
        assert set(plan.wanted) == stage_cols
        assert set(estimator_need(name, s).all_of) | set(ESTIMATORS.meta(name).optional) <= set(plan.wanted)
        assert plan.required == (BASE_NEED, estimator_need(name, s)) and plan.who == name


def test_an_estimators_columns_come_from_its_registration():
    """Adding an estimator's column is one place, its registration's ``needs=``: remax's
    ``reward_baselines`` is read for remax alone, and rldiag check asks for it."""
    names = ["uid", "response_mask", "score", "reward_baselines", "step"]
    assert "reward_baselines" in recompute_columns(_settings(**{"algorithm.adv_estimator": "remax"})).select(names)
    assert "reward_baselines" not in recompute_columns(_settings(**{"algorithm.adv_estimator": "grpo"})).select(names)
    assert estimator_need("remax") == Need(all_of=("reward_baselines",))
    gd = _settings(**{"algorithm.gdpo_reward_keys": "acc,fmt"})
    assert estimator_need("gdpo", gd).all_of == ("acc", "fmt") and estimator_need("gdpo").all_of == ()


def test_the_policy_losss_columns_follow_the_anchor():
    assert policy_loss_need("vanilla") == Need(all_of=("old_log_probs", "log_probs"))
    actor = next(s for s in STAGES if s.name == "actor_loss")
    assert actor.required(_settings()) == ("old_log_probs", "log_probs")
    assert actor.required(_settings(**{BYPASS: True})) == ("rollout_log_probs", "log_probs")


def test_a_plan_reads_the_base_columns_its_wanted_ones_and_step_last():
    plan = ColumnPlan(wanted=("ref_log_prob", "step", "old_log_probs", "ref_log_prob"))
    names = ["step", "old_log_probs", "score", "response_mask", "uid", "values", "ref_log_prob"]
    assert plan.select(names) == ["uid", "response_mask", "score", "ref_log_prob", "old_log_probs", "step"]
    assert plan.missing(names) == []
    plan = recompute_columns(_settings(**{"algorithm.adv_estimator": "gae"}))
    assert plan.missing(["uid", "score"]) == ["response_mask", "values"]
    assert plan.missing(["uid"]) == ["response_mask", "token_level_scores or score", "values"]


@pytest.mark.parametrize("bypass", [False, True])
def test_the_adaptive_kl_replay_reads_the_reward_kl_stages_columns(bypass):
    plan = reward_kl_columns(_settings(**{BYPASS: bypass}))
    anchor = "rollout_log_probs" if bypass else "old_log_probs"
    assert plan.wanted == (anchor, "ref_log_prob", "loss_mask") and plan.required == ()
    names = ["uid", "response_mask", "token_level_scores", "old_log_probs", "rollout_log_probs", "log_probs",
             "ref_log_prob", "values", "step"]
    assert plan.select(names) == ["uid", "response_mask", "token_level_scores", anchor, "ref_log_prob", "step"]


def test_the_loader_takes_its_columns_from_the_caller():
    """io/loader.py imports no configuration: the callers resolve the settings and ask the
    planner (layers: engine < config < io)."""
    tree = ast.parse((ROOT / "rldiag" / "io" / "loader.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("rldiag.config")]
