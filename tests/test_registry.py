"""The registries: typed metadata per registry, so a misspelt keyword fails at registration."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rldiag.engine.advantage import ESTIMATORS, EstimatorMeta
from rldiag.engine.policy_loss import POLICY_LOSSES
from rldiag.errors import ConfigError, UnknownKeyError
from rldiag.registry import Entry, Registry


@dataclass(frozen=True)
class _Meta(Entry):
    needs: tuple[str, ...] = ()


def test_unknown_metadata_keyword_fails_at_registration_naming_the_fields():
    reg: Registry = Registry("thing", meta=_Meta)
    with pytest.raises(TypeError, match=r"thing 'x': unknown metadata 'neds'; _Meta has source, needs"):
        reg.register("x", neds=("a",))
    reg.register("y", needs=("a",), source="paper")(lambda: 1)
    assert reg.meta("y") == _Meta(source="paper", needs=("a",))
    with pytest.raises(UnknownKeyError, match="y"):
        reg.meta("nope")


def test_every_estimator_and_loss_records_typed_metadata_with_a_source():
    for name in ESTIMATORS.names():
        meta = ESTIMATORS.meta(name)
        assert isinstance(meta, EstimatorMeta) and meta.source and "seed" not in meta.source, name
    for name in POLICY_LOSSES.names():
        assert POLICY_LOSSES.meta(name).source, name


def test_each_entrys_settings_rule_is_its_registered_check():
    from rldiag.config.settings import resolve_settings

    gdpo = ESTIMATORS.meta("gdpo").check
    with pytest.raises(ConfigError, match="gdpo_reward_keys"):
        gdpo(resolve_settings())
    with pytest.raises(ConfigError, match="2 weights for 3 reward keys"):
        gdpo(resolve_settings(overrides={"algorithm.gdpo_reward_keys": "a,b,c", "algorithm.gdpo_reward_weights": "1,2"}))
    assert gdpo(resolve_settings(overrides={"algorithm.gdpo_reward_keys": "a,b"})) == (["a", "b"], [1.0, 1.0])
    vanilla = POLICY_LOSSES.meta("vanilla").check
    with pytest.raises(ConfigError, match="clip_ratio_c must be > 1.0"):
        vanilla(resolve_settings(overrides={"actor_rollout_ref.actor.clip_ratio_c": "1.0"}))
    dro = POLICY_LOSSES.meta("dro").check
    with pytest.raises(ConfigError, match="dro_beta > 0"):
        dro(resolve_settings(overrides={"actor_rollout_ref.actor.policy_loss.loss_mode": "dro"}))
    assert POLICY_LOSSES.meta("gspo").check is None
