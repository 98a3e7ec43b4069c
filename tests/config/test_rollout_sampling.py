"""The rollout's sampling settings (``actor_rollout_ref.rollout.*``: temperature, top_p, top_k,
logprobs_mode, calculate_log_probs), which the rollout-vs-trainer mismatch diagnosis reads: verl's
defaults, read from a run's nested config and from ``--set``, refused out of range naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rldiag.config.settings import parse_override, resolve_settings
from rldiag.errors import ConfigError

R = "actor_rollout_ref.rollout"
KEYS = ("temperature", "top_p", "top_k", "logprobs_mode", "calculate_log_probs")

RUN_YAML = """\
actor_rollout_ref:
  actor:
    clip_ratio: 0.2
  rollout:
    name: vllm
    n: 4
    temperature: 0.7
    top_p: 0.95
    top_k: 50
    logprobs_mode: raw_logprobs
    calculate_log_probs: false
    val_kwargs:
      temperature: 0
      top_p: 1.0
      top_k: -1
"""


def test_the_defaults_are_those_of_verls_rollout_yaml():
    verl = pytest.importorskip("verl")
    tree = yaml.safe_load((Path(verl.__file__).parent / "trainer" / "config" / "rollout" / "rollout.yaml").read_text())
    s = resolve_settings()
    for key in KEYS:
        assert s[f"{R}.{key}"] == tree[key], key
    assert (s[f"{R}.temperature"], s[f"{R}.top_p"], s[f"{R}.top_k"]) == (1.0, 1.0, -1)
    assert s[f"{R}.logprobs_mode"] == "processed_logprobs" and s[f"{R}.calculate_log_probs"] is True


def test_a_run_yaml_with_the_rollout_block_resolves_them_not_the_validation_sampling(tmp_path):
    (tmp_path / "run.yaml").write_text(RUN_YAML)
    s = resolve_settings(tmp_path)
    assert s[f"{R}.temperature"] == 0.7 and s[f"{R}.top_p"] == 0.95 and s[f"{R}.top_k"] == 50
    assert isinstance(s[f"{R}.top_k"], int) and isinstance(s[f"{R}.top_p"], float)
    assert s[f"{R}.logprobs_mode"] == "raw_logprobs" and s[f"{R}.calculate_log_probs"] is False
    assert s.get(f"{R}.val_kwargs.temperature") == 0  # kept as the run says, not read as the rollout's
    assert {f"{R}.{k}" for k in KEYS} <= s.configured


def test_set_overrides_the_run(tmp_path):
    (tmp_path / "run.yaml").write_text(RUN_YAML)
    overrides = dict(parse_override(t) for t in (f"{R}.top_p=0.9", f"{R}.top_k=-1", f"{R}.calculate_log_probs=true"))
    s = resolve_settings(tmp_path, overrides)
    assert s[f"{R}.top_p"] == 0.9 and s[f"{R}.top_k"] == -1 and s[f"{R}.calculate_log_probs"] is True
    assert s[f"{R}.temperature"] == 0.7  # the run's


def test_an_out_of_range_top_p_in_the_run_is_a_config_error_naming_the_key_and_file(tmp_path):
    (tmp_path / "run.yaml").write_text(RUN_YAML.replace("top_p: 0.95", "top_p: 1.2"))
    with pytest.raises(ConfigError) as exc:
        resolve_settings(tmp_path)
    assert str(exc.value) == (f"{R}.top_p from {tmp_path / 'run.yaml'}: 1.2 is outside the valid range "
                              "0 < top_p <= 1 (a probability mass)")


@pytest.mark.parametrize("text, match", [
    (f"{R}.top_p=0", rf"^{R}.top_p from the command line: 0.0 is outside the valid range 0 < top_p <= 1"),
    (f"{R}.top_k=2.5", rf"^{R}.top_k from the command line: expected an integer, got 2.5"),
    (f"{R}.calculate_log_probs=maybe", rf"^{R}.calculate_log_probs from the command line: expected true or false"),
])
def test_bad_values_from_the_command_line_name_the_key(text, match):
    key, value = parse_override(text)
    with pytest.raises(ConfigError, match=match):
        resolve_settings(overrides={key: value})
