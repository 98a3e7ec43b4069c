"""The one table of settings (rldiag/config/schema.py): the docs table is generated from it, every
key the settings resolve is declared there, and the What-if widgets' bounds sit inside the valid
ranges."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from rldiag.config import schema
from rldiag.config.settings import DEFAULTS, resolve_settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_docs_table_is_the_schemas():
    text = DOC.read_text()
    table = re.search(r"<!-- settings-table:start -->\n(.*)<!-- settings-table:end -->", text, re.S)
    assert table, "docs/settings.md has lost its generated table's markers"
    assert table.group(1) == schema.markdown_table(), "regenerate it: python -m rldiag.config.schema"


def test_every_resolved_key_is_declared_once():
    keys = [s.key for s in schema.SETTINGS]
    assert len(keys) == len(set(keys))
    assert set(resolve_settings().values) == set(keys) == set(DEFAULTS)


@pytest.mark.parametrize("s", [s for s in schema.SETTINGS if s.widget is not None], ids=lambda s: s.key)
def test_widget_bounds_are_valid_values(s):
    w = s.widget
    assert w.lo < w.hi and 0 < w.step <= w.hi - w.lo
    assert s.valid.contains(w.hi) and (s.valid.contains(w.lo) or (w.lo == s.valid.lo and s.valid.lo_open))
    assert s.default is None or w.lo <= s.default <= w.hi


def test_choices_name_real_registries():
    from rldiag.config.choices import REGISTRIES, registry
    from rldiag.engine.advantage import ESTIMATORS
    from rldiag.engine.aggregation import AGG_MODES
    from rldiag.engine.kl import KL_ESTIMATORS
    from rldiag.engine.policy_loss import POLICY_LOSSES
    from rldiag.engine.rollout_correction import IS_LEVELS, RS_OPTIONS

    registries = dict(ESTIMATORS=ESTIMATORS, AGG_MODES=AGG_MODES, KL_ESTIMATORS=KL_ESTIMATORS,
                      POLICY_LOSSES=POLICY_LOSSES, IS_LEVELS=IS_LEVELS, RS_OPTIONS=RS_OPTIONS)
    assert set(REGISTRIES) == set(registries) and all(registry(n) is r for n, r in registries.items())
    for s in schema.SETTINGS:
        if s.choices is not None:
            reg = registries[s.choices]
            if s.default is not None:
                assert s.default in reg.names(), (s.key, s.default)


def test_every_inherited_key_is_declared_with_the_same_kind_and_no_circle():
    for s in schema.SETTINGS:
        if s.inherits is None:
            continue
        parent = schema.BY_KEY[s.inherits]
        assert parent.kind == s.kind and s.default is None, s.key
        seen = {s.key}
        while parent.inherits is not None:
            assert parent.key not in seen, f"{s.key} inherits in a circle"
            seen.add(parent.key)
            parent = schema.BY_KEY[parent.inherits]


def test_a_null_takes_the_inherited_value_wherever_it_is_read():
    from rldiag.engine.batch_layout import role_layout

    a = "actor_rollout_ref.actor."
    s = resolve_settings(config={a + "clip_ratio": 0.3, a + "clip_ratio_high": 0.28, a + "ppo_mini_batch_size": 4,
                                 a + "ppo_micro_batch_size_per_gpu": 2, "actor_rollout_ref.rollout.n": 3,
                                 a + "loss_agg_mode": "seq-mean-token-sum", "critic.ppo_micro_batch_size_per_gpu": 1})
    assert (s.clip_low, s.clip_high) == (0.3, 0.28)
    assert s.critic_agg_mode == "seq-mean-token-sum"
    resolved = s.resolved()
    assert resolved[a + "clip_ratio_low"] == 0.3 and resolved[a + "clip_ratio_high"] == 0.28
    assert resolved["critic.ppo_mini_batch_size"] == 4 and resolved["critic.ppo_micro_batch_size_per_gpu"] == 1
    assert resolved["critic.loss_scale_factor"] is None  # the actor's is null too
    assert s.values["critic.ppo_mini_batch_size"] is None  # the values keep what the run says
    actor, critic = role_layout(s, "actor"), role_layout(s, "critic")
    assert (actor.mini, actor.micro, critic.mini, critic.micro) == (12, 2, 12, 1)  # mini: 4 prompts x n 3


@pytest.mark.parametrize("enable", [None, True, False])
@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo"])
def test_needs_critic_is_verls_need_critic(enable, estimator):
    from rldiag.engine.batch_layout import uses_critic

    utils = pytest.importorskip("verl.trainer.ppo.utils")
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"critic": {"enable": enable}, "algorithm": {"adv_estimator": estimator}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = utils.need_critic(cfg)
    s = resolve_settings(config={"critic.enable": enable, "algorithm.adv_estimator": estimator})
    assert schema.needs_critic(s.values) is s.uses_critic is uses_critic(s) is theirs
    assert s.resolved()["critic.enable"] is theirs


def test_whatif_rows_are_edited_keys_with_widgets_or_choices():
    from rldiag.config.choices import choices

    rows = [s for s in schema.SETTINGS if s.whatif]
    assert len(rows) == 20
    for s in schema.SETTINGS:
        assert s.widget is None or s.whatif, f"{s.key} has a What-if widget but the page does not edit it"
    for s in rows:
        if s.kind in ("float", "int"):
            assert s.widget is not None, s.key
    assert choices("algorithm.kl_ctrl.type") == ["fixed", "adaptive"]
    assert choices("algorithm.gamma") is None
