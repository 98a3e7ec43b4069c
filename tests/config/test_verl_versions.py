"""rldiag.verl_version: which release a recompute reproduces, and the one table of changes."""

from __future__ import annotations

import pytest

from rldiag.config.settings import resolve_settings
from rldiag.config.verl_versions import CHANGES, RELEASES, SNAPSHOT, canonical, has, version_of
from rldiag.errors import ConfigError


def test_default_is_the_snapshot_then_the_recorded_version_then_the_setting():
    assert version_of(resolve_settings()) == SNAPSHOT
    recorded = resolve_settings(config={"verl_version": "0.9.0"})
    assert version_of(recorded) == "0.9.0"
    chosen = resolve_settings(config={"verl_version": "0.9.0"}, overrides={"rldiag.verl_version": "0.8.0"})
    assert version_of(chosen) == "0.8.0"


def test_the_version_rldiags_verl_capture_records_is_used():
    captured = resolve_settings(config={"rldiag": {"capture": {"verl_version": "0.9.1", "trainer": "v1"}}})
    assert version_of(captured) == "0.9.1"
    for recorded, release in (("0.7.2", RELEASES[0]), ("unknown", SNAPSHOT), ("main", SNAPSHOT)):
        s = resolve_settings(config={"rldiag": {"capture": {"verl_version": recorded}}})
        assert version_of(s) == release, recorded  # recorded, not chosen: never an error
    with pytest.raises(ConfigError, match="rldiag.verl_version"):
        version_of(resolve_settings(overrides={"rldiag.verl_version": "0.7.2"}))


@pytest.mark.parametrize(
    "given, release",
    [("0.8.0", "0.8.0"), ("0.8.3", "0.8.0"), ("v0.9.1", "0.9.1"), ("0.9.2", "0.9.1"), ("0.9.1.post1", "0.9.1"),
     ("main", SNAPSHOT), ("0.10.0.dev", SNAPSHOT), ("0.11.0", SNAPSHOT), (0.9, "0.9.0")],
)
def test_canonical_maps_to_the_release_with_that_behaviour(given, release):
    assert canonical(given) == release


@pytest.mark.parametrize("bad", ["0.7.4", "latest", ""])
def test_unknown_versions_are_a_config_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match="rldiag.verl_version"):
        canonical(bad)


def test_the_table_per_release():
    table = {v: {c.key for c in CHANGES if has({"rldiag.verl_version": v}, c.key)} for v in RELEASES}
    assert table == {
        "0.8.0": set(),
        "0.9.0": {"v1_trainer", "reinforce_pp_carry", "critic_global_norm", "filter_groups_reward_metric"},
        "0.9.1": {"v1_trainer", "reinforce_pp_carry", "critic_global_norm", "gspo_agg_mode", "v1_pad_rows_128",
                  "dynamic_bsz_token_limit", "filter_groups_reward_metric"},
        SNAPSHOT: {"v1_trainer", "reinforce_pp_carry", "critic_global_norm", "filter_groups_reward_metric"},
    }
    assert all(c.commit and c.new and c.old and c.versions <= set(RELEASES) for c in CHANGES)


def test_unknown_change_key_is_an_error():
    with pytest.raises(KeyError, match="known"):
        has({}, "nope")


def test_every_release_is_its_own_canonical_form():
    # each release's numbers are readable, so that every comparison between versions is defined
    assert [canonical(r) for r in RELEASES] == list(RELEASES)
    assert canonical("0.9.2") == "0.9.1" and canonical("0.10.3") == SNAPSHOT
