"""Numeric settings outside their valid range are refused, naming the key, where it came from
and the range; values at the edges of the range are accepted."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rldiag.cli.main import main
from rldiag.config import settings as settings_mod
from rldiag.config.ranges import FLOAT32_MAX, INT32_MAX
from rldiag.config.schema import RANGES, range_of
from rldiag.config.settings import parse_override, resolve_settings
from rldiag.errors import ConfigError
from rldiag.synth import SynthSpec, write_synth_run

A = "actor_rollout_ref.actor"


def refused(text: str) -> str:
    key, value = parse_override(text)
    with pytest.raises(ConfigError) as exc:
        resolve_settings(overrides={key: value})
    return str(exc.value)


@pytest.mark.parametrize("text, expected", [
    ("algorithm.gamma=.inf", "algorithm.gamma from the command line: inf is outside the valid range 0 <= gamma <= 1 (a discount factor)"),
    ("algorithm.gamma=1e999", "algorithm.gamma from the command line: inf is outside the valid range 0 <= gamma <= 1 (a discount factor)"),
    ("algorithm.gamma=1.5", "algorithm.gamma from the command line: 1.5 is outside the valid range 0 <= gamma <= 1 (a discount factor)"),
    ("algorithm.gamma=.nan", "algorithm.gamma from the command line: NaN is not a valid setting"),
    ("algorithm.lam=-1", "algorithm.lam from the command line: -1.0 is outside the valid range 0 <= lam <= 1 (GAE's lambda)"),
    (f"{A}.clip_ratio=-0.5", f"{A}.clip_ratio from the command line: -0.5 is outside the valid range 0 <= clip_ratio <= 3.40282e+38"),
    (f"{A}.clip_ratio=1e308", f"{A}.clip_ratio from the command line: 1e+308 is outside the valid range 0 <= clip_ratio <= 3.40282e+38"),
    ("data.max_response_length=0", "data.max_response_length from the command line: 0 is outside the valid range 1 <= max_response_length <= 2147483647 (tokens)"),
    ("data.max_response_length=-1", "data.max_response_length from the command line: -1 is outside the valid range 1 <= max_response_length <= 2147483647 (tokens)"),
    ("data.max_response_length=1e999", "data.max_response_length from the command line: expected an integer, got '1e999'"),
    ("data.max_response_length=2.5", "data.max_response_length from the command line: expected an integer, got 2.5"),
    ("data.max_prompt_length=99999999999", "data.max_prompt_length from the command line: 99999999999 is outside the valid range 1 <= max_prompt_length <= 2147483647 (tokens)"),
    (f"{A}.tau_neg=0", f"{A}.tau_neg from the command line: 0.0 is outside the valid range 0 < tau_neg <= 3.40282e+38 (SAPO divides by it)"),
    (f"{A}.policy_loss.clip_cov_ratio=2", f"{A}.policy_loss.clip_cov_ratio from the command line: 2.0 is outside the valid range 0 <= clip_cov_ratio <= 1 (a fraction of the tokens)"),
    (f"{A}.entropy_coeff=-1e39", f"{A}.entropy_coeff from the command line: -1e+39 is outside the valid range -3.40282e+38 <= entropy_coeff <= 3.40282e+38 (a finite float32)"),
    ("algorithm.gdpo_reward_weights=1,1e999", "algorithm.gdpo_reward_weights from the command line: inf is outside the valid range"),
    ("algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon from the command line: 0 is outside the valid range 1 <= horizon <= 2147483647"),
    ("actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_p from the command line: 0.0 is outside the valid range 0 < top_p <= 1 (a probability mass)"),
    ("actor_rollout_ref.rollout.top_p=1.5", "actor_rollout_ref.rollout.top_p from the command line: 1.5 is outside the valid range 0 < top_p <= 1 (a probability mass)"),
    ("actor_rollout_ref.rollout.top_k=-2", "actor_rollout_ref.rollout.top_k from the command line: -2 is outside the valid range -1 <= top_k <= 2147483647 (-1 and 0: off)"),
    ("actor_rollout_ref.rollout.temperature=-0.5", "actor_rollout_ref.rollout.temperature from the command line: -0.5 is outside the valid range 0 <= temperature <= 3.40282e+38 (0: greedy)"),
])
def test_out_of_range_settings_are_refused(text, expected):
    msg = refused(text)
    assert msg.startswith(expected)
    assert "\n" not in msg


@pytest.mark.parametrize("text, value", [
    ("algorithm.gamma=0", 0.0), ("algorithm.gamma=1", 1.0), ("algorithm.lam=0", 0.0), (f"{A}.clip_ratio=0", 0.0),
    ("data.max_response_length=1", 1), ("data.max_response_length=1e3", 1000), ("data.max_response_length=4096.0", 4096),
    (f"{A}.entropy_coeff=-0.01", -0.01), (f"{A}.clip_ratio_c=3.4e38", 3.4e38),
    ("actor_rollout_ref.rollout.top_p=1", 1.0), ("actor_rollout_ref.rollout.top_p=1e-9", 1e-9),
    ("actor_rollout_ref.rollout.top_k=-1", -1), ("actor_rollout_ref.rollout.top_k=0", 0),
    ("actor_rollout_ref.rollout.temperature=0", 0.0),
])
def test_values_at_the_edges_are_accepted(text, value):
    key, raw = parse_override(text)
    assert resolve_settings(overrides={key: raw})[key] == value


def test_the_config_file_is_named_as_the_source(tmp_path):
    (tmp_path / "run.yaml").write_text("algorithm:\n  lam: -1\n")
    with pytest.raises(ConfigError, match=rf"^algorithm.lam from {tmp_path / 'run.yaml'}: -1.0 is outside the valid range 0 <= lam <= 1"):
        resolve_settings(tmp_path)


def test_every_numeric_key_has_a_range_that_refuses_infinity():
    for key in sorted(settings_mod._FLOAT_KEYS | settings_mod._INT_KEYS):
        for bad in (math.inf, -math.inf):
            with pytest.raises(ConfigError, match=rf"^{key} from the command line"):
                resolve_settings(overrides={key: bad})
    assert set(RANGES) <= settings_mod._FLOAT_KEYS | settings_mod._INT_KEYS  # no range for a key that is not read


@given(st.sampled_from(sorted(settings_mod._FLOAT_KEYS)), st.floats(allow_nan=False))
def test_a_float_setting_is_accepted_exactly_when_in_range(key, x):
    r = range_of(key, integer=False)
    inside = math.isfinite(x) and (x > r.lo if r.lo_open else x >= r.lo) and x <= r.hi
    if inside:
        assert resolve_settings(overrides={key: x})[key] == x
        assert abs(x) <= FLOAT32_MAX
    else:
        with pytest.raises(ConfigError, match=rf"^{key} from the command line: .* is outside the valid range"):
            resolve_settings(overrides={key: x})


@given(st.sampled_from(sorted(settings_mod._INT_KEYS)), st.integers(-(2**70), 2**70))
def test_an_integer_setting_is_accepted_exactly_when_in_range(key, n):
    r = range_of(key, integer=True)
    if r.lo <= n <= r.hi:
        assert resolve_settings(overrides={key: n})[key] == n
        assert n <= INT32_MAX
    else:
        with pytest.raises(ConfigError, match=rf"^{key} from the command line: {n} is outside the valid range"):
            resolve_settings(overrides={key: n})


def test_clip_ratio_1e308_through_the_cli_is_one_line(tmp_path, capsys):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=2))
    assert main(["recompute", str(run), "--no-progress", "--set", f"{A}.clip_ratio=1e308"]) == 1
    err = capsys.readouterr().err
    assert err == (f"ConfigError: {A}.clip_ratio from the command line: 1e+308 is outside the valid range "
                   "0 <= clip_ratio <= 3.40282e+38\n")
    assert not (run / "rldiag" / "scenarios").exists() or not any((run / "rldiag" / "scenarios").iterdir())
