"""``critic.enable`` and verl's ``need_critic``: critic metrics only where the trainer has a critic
(``verl/trainer/ppo/utils.py``: ``critic.enable`` when set, else ``adv_estimator == "gae"``)."""

from __future__ import annotations

import pytest

from rldiag.config.settings import resolve_settings
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run

CRITIC_DATA = {"critic/values/mean", "critic/values/max", "critic/values/min", "critic/vf_explained_var"}
CRITIC_LOSS = {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"}


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic") / "run"
    write_synth_run(root, SynthSpec(steps=2, prompts=4, n=4, max_len=24, seed=3,
                                     config={"algorithm": {"adv_estimator": "gae", "lam": 0.95}}))
    return root


def _metrics(run, overrides, name):
    import pyarrow.parquet as pq

    rep = recompute(run, overrides, name=name, reuse=False)
    table = pq.read_table(run / "rldiag" / "scenarios" / name / "metrics.parquet")
    return rep, {c for c in table.column_names if table[c].null_count < table.num_rows}


@pytest.mark.parametrize("enable,estimator,critic", [
    (None, "gae", True), (None, "grpo", False), (None, "rloo", False),
    (True, "grpo", True), (False, "grpo", False),
])
def test_need_critic_rule(enable, estimator, critic):
    s = resolve_settings(overrides={"critic.enable": enable, "algorithm.adv_estimator": estimator})
    assert s.uses_critic is critic
    assert s.resolved()["critic.enable"] is critic


def test_grpo_what_if_on_a_ppo_run_logs_no_critic_metrics(ppo_run):
    _, gae = _metrics(ppo_run, {}, "gae")
    assert CRITIC_DATA | CRITIC_LOSS <= gae
    _, grpo = _metrics(ppo_run, {"algorithm.adv_estimator": "grpo"}, "grpo")
    assert not (CRITIC_DATA | CRITIC_LOSS) & grpo
    assert "critic/advantages/mean" in grpo  # the data metrics that do not need a critic stay
    _, forced = _metrics(ppo_run, {"algorithm.adv_estimator": "grpo", "critic.enable": True}, "grpo-critic")
    assert CRITIC_DATA | CRITIC_LOSS <= forced


def test_gae_without_a_critic_fails_each_step_naming_the_setting(ppo_run):
    rep, _ = _metrics(ppo_run, {"critic.enable": False}, "gae-nocritic")
    assert sorted(rep.steps_failed) == [1, 2]
    assert all("critic.enable=false" in m for m in rep.steps_failed.values())


def test_critic_enable_refuses_a_non_boolean():
    from rldiag.errors import ConfigError

    with pytest.raises(ConfigError, match="critic.enable"):
        resolve_settings(overrides={"critic.enable": "sometimes"})
