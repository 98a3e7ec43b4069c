from __future__ import annotations

import pytest

from rldiag.config.settings import parse_override, resolve_settings, scenario_slug
from rldiag.errors import ConfigError


def test_defaults_are_verls():
    s = resolve_settings()
    assert s.estimator == "gae" and s["algorithm.lam"] == 1.0
    assert s.clip_low == 0.2 and s.clip_high == 0.2
    assert s.critic_agg_mode == "token-mean"
    assert s["actor_rollout_ref.actor.kl_loss_type"] == "low_var_kl"


def test_resolution_order_defaults_config_overrides(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "algorithm:\n  adv_estimator: grpo\n  lam: 0.9\nactor_rollout_ref:\n  actor:\n    loss_agg_mode: seq-mean-token-mean\n"
        "critic:\n  loss_agg_mode: ${actor_rollout_ref.actor.loss_agg_mode}\ntrainer:\n  project_name: x\n"
    )
    s = resolve_settings(tmp_path, {"algorithm.lam": 0.5})
    assert s.estimator == "grpo" and s["algorithm.lam"] == 0.5
    assert s.critic_agg_mode == "seq-mean-token-mean"
    assert s.get("trainer.project_name") == "x"
    assert s.config_file.endswith("run.yaml")


def test_hydra_config_fallback_and_oc_select(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(
        "critic:\n  loss_agg_mode: ${oc.select:actor_rollout_ref.actor.missing,token-sum}\n"
    )
    assert resolve_settings(tmp_path).critic_agg_mode == "token-sum"


def test_yaml_is_loaded_safely(tmp_path):
    (tmp_path / "run.yaml").write_text("algorithm: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        resolve_settings(tmp_path)


@pytest.mark.parametrize(
    "text, value",
    [("a.b=true", True), ("a.b=null", None), ("a.b=0.95", 0.95), ("a.b=0.5_2.0", "0.5_2.0"), ("a.b=token-mean", "token-mean")],
)
def test_override_values_are_yaml_scalars(text, value):
    assert parse_override(text) == ("a.b", value)


def test_unknown_override_lists_valid_keys():
    with pytest.raises(ConfigError) as exc:
        resolve_settings(overrides={"algorithm.lamda": 0.9})
    assert "algorithm.lam" in str(exc.value)


def test_bad_value_type():
    with pytest.raises(ConfigError, match="expected true or false"):
        resolve_settings(overrides={"algorithm.use_kl_in_reward": "maybe"})
    with pytest.raises(ConfigError, match="algorithm.gamma"):
        resolve_settings(overrides={"algorithm.gamma": "high"})


def test_scenario_slug():
    assert scenario_slug({}) == "baseline"
    assert scenario_slug({"algorithm.adv_estimator": "rloo"}) == "adv_estimator=rloo"
    assert scenario_slug({"algorithm.lam": 0.95, "algorithm.use_kl_in_reward": True}) == "lam=0.95__use_kl_in_reward=true"


def test_scenario_slug_names_keys_in_full_where_their_last_parts_collide():
    both = {"actor_rollout_ref.actor.loss_agg_mode": "token-mean", "critic.loss_agg_mode": "seq-mean-token-mean",
            "algorithm.lam": 0.9}
    assert scenario_slug(both) == ("actor_rollout_ref.actor.loss_agg_mode=token-mean__lam=0.9__"
                                   "critic.loss_agg_mode=seq-mean-token-mean")
    assert scenario_slug({"critic.loss_agg_mode": "token-mean"}) == "loss_agg_mode=token-mean"  # alone: as before
