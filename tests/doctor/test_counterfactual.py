"""The doctor's counterfactual: a finding's window recomputed, in memory, under the settings that
address its rule; checked against the real ``rldiag recompute --steps a:b --set key=value``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from rldiag.cli.main import main
from rldiag.doctor import diagnose
from rldiag.doctor.counterfactual import CAVEAT, compute, counterfactuals, describe, finding_window, own_value
from rldiag.doctor.evaluators import Evidence, Finding
from rldiag.doctor.rule import Rule
from rldiag.doctor.rules import load_rules
from rldiag.errors import ComputeError, ConfigError
from rldiag.scenario.recompute import recompute
from tests.doctor.runs import write_run

HIGH = "actor_rollout_ref.actor.clip_ratio_high"
CLIPFRAC = "actor/pg_clipfrac"
SAMPLES = Path(__file__).resolve().parents[2] / "samples"
KEYS = {"settings", "metric", "statistic", "window", "with", "without"}


def _plant_clip_spike(step, s):
    """From step 4 on the current policy moves far from pi_old: most tokens hit the clip."""
    if step >= 4:
        for i in range(s.rows):
            s.cur[i] = (s.old[i] + s.rng.normal(0, 0.6, len(s.old[i]))).astype(np.float32)


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    root = write_run(tmp_path_factory.mktemp("cf") / "run", plant=_plant_clip_spike)
    return root, diagnose(root)


def _mean(run: Path, overrides: dict, steps: str, metric: str) -> float:
    """The mean over ``steps`` of ``metric`` of the real recompute (as ``rldiag recompute
    --steps --set`` writes it), steps without a value left out."""
    rep = recompute(run, overrides, steps=steps, device="cpu")
    return float(np.mean([row[metric] for row in rep.metrics if row.get(metric) is not None]))


def _clip_rule(**addresses) -> Rule:
    base = {"settings": [{HIGH: 0.28}], "metrics": [CLIPFRAC], "statistic": "mean"}
    return Rule(id="clipfrac_high", kind="threshold", title="t", why="w", metric=CLIPFRAC,
                addresses={**base, **addresses})


def _finding(window: list[int], steps: list[int] | None = None) -> Finding:
    return Finding("clipfrac_high", "t", "warning", "w", "m", Evidence(metric=CLIPFRAC, window=window, steps=steps or []))


def test_clip_spike_counterfactual_is_the_real_recompute(spiked):
    root, rep = spiked
    f = next(f for f in rep.findings if f.rule == "clipfrac_high")
    assert f.evidence.window == [1, 9] and f.counterfactual
    assert all(set(e) == KEYS for e in f.counterfactual)
    e = next(e for e in f.counterfactual if e["settings"] == {HIGH: 0.28} and e["metric"] == CLIPFRAC)
    assert e["window"] == [1, 9] and e["statistic"] == "mean"
    # clip-higher lets more of the rising tokens through: fewer clipped on the same batches
    assert e["with"] < e["without"]
    assert 0.2 < e["without"] < 0.5 and e["without"] - e["with"] > 0.01  # 3 healthy steps, 6 spiked
    # exactly the real recompute's means, baseline and --set, over the same steps
    assert e["without"] == _mean(root, {}, "1:9", CLIPFRAC)
    assert e["with"] == _mean(root, {HIGH: 0.28}, "1:9", CLIPFRAC)
    wide = next(e for e in f.counterfactual if len(e["settings"]) == 2 and e["metric"] == CLIPFRAC)
    assert wide["with"] < e["without"] and wide["without"] == e["without"]
    # the sentence names the run's own value (clip_ratio_high null: clip_ratio's 0.2)
    line = describe(f.counterfactual, rep.settings)[0]
    assert line.startswith("with clip_ratio_high=0.28 instead of 0.2 on steps 1-9, actor/pg_clipfrac on these batches is ")
    assert f"{e['with']:.4g} instead of {e['without']:.4g}" in line


def test_counterfactual_writes_nothing_into_the_run(spiked):
    root, rep = spiked
    before = sorted(p.name for p in (root / "rldiag" / "scenarios").iterdir())
    f = next(f for f in rep.findings if f.rule == "clipfrac_high")
    rule = next(r for r in load_rules() if r.id == "clipfrac_high")
    assert counterfactuals(root, rule, f) == f.counterfactual
    assert sorted(p.name for p in (root / "rldiag" / "scenarios").iterdir()) == before


def test_window_is_capped_at_its_latest_steps(spiked):
    root, _ = spiked
    entries, errors = compute(root, _clip_rule(statistic="median"), _finding([2, 9]), max_steps=3)
    assert errors == [] and len(entries) == 1
    e = entries[0]
    assert e["window"] == [7, 9] and e["statistic"] == "median over the last 3 of the window's 8 steps"
    rep = recompute(root, {HIGH: 0.28}, steps="7:9", device="cpu")
    assert e["with"] == float(np.median([r[CLIPFRAC] for r in rep.metrics]))
    # the evidence steps' span when the finding has no window; max and last
    span = _finding([], steps=[5, 3, 4])
    assert finding_window(span) == (3, 5)
    (mx,), _ = compute(root, _clip_rule(statistic="max"), span)
    (last,), _ = compute(root, _clip_rule(statistic="last"), span)
    base = {r["step"]: r[CLIPFRAC] for r in recompute(root, {}, steps="3:5", device="cpu").metrics}
    assert mx["without"] == max(base.values()) and last["without"] == base[5] and mx["window"] == [3, 5]


def test_a_metric_the_recompute_lacks_is_left_out(spiked):
    root, _ = spiked
    rule = _clip_rule(metrics=["rldiag/no/such_metric", CLIPFRAC])
    entries, errors = compute(root, rule, _finding([1, 9]))
    assert [e["metric"] for e in entries] == [CLIPFRAC] and errors == []
    # the ESS exists only with rollout IS on: absent without it, so left out (no error either)
    ess = Rule(id="x", kind="threshold", title="t", why="w", metric="rollout_corr/rollout_is_eff_sample_size",
               addresses={"settings": [{"algorithm.rollout_correction.rollout_is": "token"}],
                          "metrics": ["rollout_corr/rollout_is_eff_sample_size"], "statistic": "mean"})
    assert counterfactuals(root, ess, _finding([1, 9])) == []
    # an alternative the run already has is not run
    assert counterfactuals(root, _clip_rule(settings=[{HIGH: None}]), _finding([1, 9])) == []


def test_a_failing_counterfactual_never_fails_the_doctor(tmp_path, spiked):
    root, _ = spiked
    bad = _clip_rule(settings=[{"actor_rollout_ref.actor.policy_loss.loss_mode": "no_such_loss"}])
    with pytest.raises(ComputeError, match="no_such_loss"):
        counterfactuals(root, bad, _finding([1, 9]))
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"rules": [{"id": "clipfrac_high", "addresses": {
        "settings": [{"actor_rollout_ref.actor.policy_loss.loss_mode": "no_such_loss"}]}}]}))
    rep = diagnose(root, rules_files=[rules])
    f = next(f for f in rep.findings if f.rule == "clipfrac_high")
    assert f.counterfactual == [] and "no_such_loss" in rep.counterfactual_errors["clipfrac_high"]
    assert all(f.counterfactual == [] for f in diagnose(root, counterfactual=False).findings)


@pytest.mark.parametrize("addresses,match", [
    ("clip_ratio_high", "'addresses' must be a mapping"),
    ({"settings": [{HIGH: 0.28}], "stat": "mean"}, "unknown key.*stat.*under 'addresses'"),
    ({"settings": []}, "non-empty list"),
    ({"settings": [{}]}, "#1 must be a non-empty mapping"),
    ({"settings": [{HIGH: 0.28}, {"actor_rollout_ref.actor.optim.lr": 1e-6}]}, "#2: unknown setting"),
    ({"settings": [{"actor_rollout_ref.rollout.temperature": 0.7}]}, "read by no engine stage"),
    ({"settings": [{HIGH: -1}]}, "#1: .*outside the valid range"),
    ({"settings": [{HIGH: 0.28}], "metrics": "actor/pg_clipfrac"}, "'addresses.metrics' must be a non-empty list"),
    ({"settings": [{HIGH: 0.28}], "statistic": "mode"}, "'addresses.statistic' must be one of mean, median, max, last"),
])
def test_rules_file_addresses_are_checked(tmp_path, addresses, match):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"rules": [{"id": "clipfrac_high", "addresses": addresses}]}))
    with pytest.raises(ConfigError, match=match) as err:
        load_rules([path])
    assert str(path) in str(err.value) and "'clipfrac_high'" in str(err.value)


def test_rules_file_addresses_defaults(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"rules": [
        {"id": "clipfrac_high", "addresses": {"settings": [{HIGH: 0.5}]}},
        {"id": "rollout_mismatch", "addresses": {"settings": [{HIGH: 0.5}]}},
    ]}))
    with pytest.raises(ConfigError, match="'rollout_mismatch'.*'addresses.metrics' is required"):
        load_rules([path])
    path.write_text(yaml.safe_dump({"rules": [{"id": "clipfrac_high", "addresses": {"settings": [{HIGH: 0.5}]}},
                                              {"id": "entropy_collapse", "addresses": None}]}))
    rules = {r.id: r for r in load_rules([path])}
    assert rules["clipfrac_high"].addresses == {"settings": [{HIGH: 0.5}], "metrics": [CLIPFRAC], "statistic": "mean"}
    assert rules["entropy_collapse"].addresses == {}


def test_builtin_addresses_name_only_recomputed_settings():
    """Every built-in alternative loads (checked as above); the rules whose cause no recompute can
    change (learning rate, sampling) have none."""
    rules = {r.id: r for r in load_rules()}
    for rid in ("clipfrac_high", "dual_clip_firing", "advantages_not_centred", "no_signal_groups",
                "kl_reward_sign_flip", "rollout_is_ess_low", "rollout_kl_growing", "rollout_chi2_growing",
                "rollout_ppl_gap_growing", "rollout_mismatch", "entropy_collapse"):
        assert rules[rid].addresses["settings"], rid
    for rid in ("ppo_kl_high", "aborted_responses", "length_clipped", "vf_explained_var_negative"):
        assert rules[rid].addresses == {}, rid
    assert {HIGH: 0.28} in rules["entropy_collapse"].addresses["settings"]


def test_own_value_and_sentences():
    settings = {HIGH: None, "actor_rollout_ref.actor.clip_ratio": 0.2, "algorithm.kl_penalty": "kl",
                "algorithm.filter_groups.enable": False}
    assert own_value(settings, HIGH) == 0.2 and own_value(settings, "algorithm.kl_penalty") == "kl"
    entries = [
        {"settings": {HIGH: 0.28}, "metric": CLIPFRAC, "statistic": "mean", "window": [340, 360], "with": 0.09,
         "without": 0.31},
        {"settings": {HIGH: 0.28}, "metric": "rldiag/grad_weight/clipped_share", "statistic": "mean",
         "window": [340, 360], "with": 0.04, "without": 0.19},
        {"settings": {"algorithm.kl_penalty": "kl"}, "metric": "x/y", "statistic": "max over the last 20 of the "
         "window's 40 steps", "window": [341, 360], "with": 1.0, "without": 2.0},
        {"settings": {"algorithm.filter_groups.enable": True}, "metric": "a/b", "statistic": "mean",
         "window": [1, 2], "with": 0.5, "without": float("nan")},
    ]
    assert describe(entries, settings) == [
        "with clip_ratio_high=0.28 instead of 0.2 on steps 340-360, actor/pg_clipfrac on these batches is 0.09 "
        "instead of 0.31 and the clipped tokens carry 4% of the gradient weight instead of 19%",
        "with kl_penalty=kl on steps 341-360 (max over the last 20 of the window's 40 steps), x/y on these batches "
        "is 1 instead of 2",
        "with filter_groups.enable=true instead of false on steps 1-2, a/b on these batches is 0.5 instead of nan",
    ]


@pytest.mark.parametrize("sample", ["grpo-tool", "ppo-gae"])
def test_samples_doctor_json_carries_counterfactuals(tmp_path, capsys, sample):
    """The bundled samples: the JSON still parses, each finding has its counterfactual list,
    filled where its rule names addressing settings (here clipfrac_high, made to fire)."""
    run = tmp_path / sample
    shutil.copytree(SAMPLES / sample, run, ignore=shutil.ignore_patterns("rldiag"))
    rules = tmp_path / "fire.yaml"
    rules.write_text(yaml.safe_dump({"rules": [{"id": "clipfrac_high", "above": 0.0, "stat": "mean", "window": 5}]}))
    assert main(["doctor", str(run), "--json", "--rules", str(rules), "--no-progress"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["counterfactual_errors"] == {}
    assert all(isinstance(f["counterfactual"], list) for f in d["findings"])
    clip = next(f for f in d["findings"] if f["rule"] == "clipfrac_high")
    assert clip["evidence"]["window"] == [26, 30]
    entries = clip["counterfactual"]
    assert entries and all(set(e) == KEYS and e["window"] == [26, 30] for e in entries)
    # grpo-tool already runs clip_ratio_high=0.28: that alternative is not run, the wider range is
    wide = {"actor_rollout_ref.actor.clip_ratio_low": 0.3, HIGH: 0.3}
    assert [e["settings"] for e in entries if e["metric"] == CLIPFRAC] == (
        [wide] if sample == "grpo-tool" else [{HIGH: 0.28}, wide])
    e = next(e for e in entries if e["settings"] == wide and e["metric"] == CLIPFRAC)
    assert e["with"] <= e["without"]
    # without: the doctor's own baseline recompute of those steps (packed with the others: to rounding)
    base = pq.read_table(run / "rldiag" / "scenarios" / "baseline" / "metrics.parquet").to_pylist()
    assert e["without"] == pytest.approx(np.mean([r[CLIPFRAC] for r in base if 26 <= r["step"] <= 30]), rel=1e-5)
    for f in d["findings"]:
        if f["rule"] in ("length_clipped", "rollout_mismatch"):  # no addresses; info never counted
            assert f["counterfactual"] == []
    if sample == "grpo-tool":  # the text report: a sentence per alternative, the caveat once
        assert main(["doctor", str(run), "--rules", str(rules), "--no-progress"]) == 1
        out = capsys.readouterr().out
        assert ("if: with clip_ratio_low=0.3 instead of 0.2, clip_ratio_high=0.3 instead of 0.28 on steps 26-30, "
                "actor/pg_clipfrac on these batches is ") in out
        assert out.count(CAVEAT) == 1
