"""The output, gradient-concentration and reward-hacking rules (rules.yaml's last block): each
planted in a generated run gives its finding with its evidence; the bundled healthy samples stay
quiet; the kind ``while`` on hand-made series."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from rldiag.doctor import diagnose, load_rules
from rldiag.doctor.evaluators import RULE_KINDS, Context, Finding, Passed, Series, Skip
from rldiag.doctor.rule import Rule
from rldiag.errors import ConfigError
from tests.doctor.runs import MAX_LEN, write_run
from tests.doctor.test_doctor_runs import ids

NEW = ("response_length_collapse", "response_length_runaway", "reward_hacking_length", "reward_hacking_kl",
       "reward_hacking_component", "reward_hacking_spread", "degenerate_repetition", "empty_responses",
       "gradient_concentration")
SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def _scale_lengths(factor, cap=None):
    """Every row's length times ``factor ** (step - 1)`` (at least 2, at most ``cap``)."""
    def plant(step, s):
        for i in range(s.rows):
            n = max(2, int(round(len(s.mask[i]) * factor ** (step - 1))))
            s.set_length(i, n if cap is None else min(cap, n))
    return plant


def _rising_score(step, s):  # the success rate climbs from 0.1 to 0.74
    s.score[:] = (s.rng.random(s.rows) < 0.1 + 0.08 * (step - 1)).astype(np.float32)


def _both(*plants):
    def plant(step, s):
        for p in plants:
            p(step, s)
    return plant


def _ref_drift(step, s):  # the policy leaves the reference faster every step
    sd = 0.05 * 1.4 ** (step - 1)
    for i in range(s.rows):
        s.ref[i] = (s.old[i] + s.rng.normal(0, sd, len(s.old[i]))).astype(np.float32)


def _format_takes_over(step, s):  # acc flat at 0.2, fmt climbs from 0.3 to 1: the score is theirs
    acc = (s.rng.random(s.rows) < 0.2).astype(np.float32)
    fmt = (s.rng.random(s.rows) < min(1.0, 0.3 + 0.09 * (step - 1))).astype(np.float32)
    s.columns.update(acc=acc, fmt=fmt)
    s.score[:] = acc + fmt


def _spread_collapses(step, s):  # scores rise and become the same within each group
    noise = s.rng.normal(0, 0.3 * 0.55 ** (step - 1), s.rows)
    s.score[:] = np.clip(0.2 + 0.08 * (step - 1) + noise, 0, 1.5).astype(np.float32)


LOOP = ["The", " answer", " is", " 4", "."]


def _loops(step, s):  # rows 0-9 loop for 100 tokens; rows 10-19 are 100 tokens of words (not repetitive)
    for i in range(20):
        s.set_length(i, 100)
        if i < 10:
            s.text[i] = [LOOP[k % len(LOOP)] for k in range(100)]


def _masked_rows(step, s):  # rows 0-4: a response of tool tokens only (length > 0, no actor token)
    for i in range(5):
        s.mask[i][:] = 0


def _lone_short_success(step, s):  # each group: one success in one token, seven failures
    for i in range(s.rows):
        first = i % 8 == 0
        s.score[i] = float(first)
        if first:
            s.set_length(i, 1)


COMPONENTS = {"algorithm": {"adv_estimator": "grpo"}, "rldiag": {"reward_components": ["acc", "fmt"]}}
SEQ_MEAN = {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": {"loss_agg_mode": "seq-mean-token-mean"}}}

# (name, write_run arguments, the alarms it must give, exact: no other alarm)
CASES = [
    ("length_collapse", dict(plant=_scale_lengths(0.7)), {"response_length_collapse"}, True),
    # length_clipped (information only since the calibration corpus) does not count
    ("length_runaway", dict(plant=_scale_lengths(1.3, cap=MAX_LEN)), {"response_length_runaway"}, True),
    ("hacking_length", dict(plant=_both(_scale_lengths(1.15), _rising_score), max_len=128), {"reward_hacking_length"}, False),
    # reward_hacking_kl is information only since the calibration corpus: test_reward_hacking_kl_is_information
    ("hacking_kl", dict(plant=_both(_ref_drift, _rising_score)), set(), False),
    ("hacking_component", dict(plant=_format_takes_over, config=COMPONENTS), {"reward_hacking_component"}, True),
    ("hacking_spread", dict(plant=_spread_collapses), {"reward_hacking_spread"}, True),
    ("repetition", dict(plant=_loops, max_len=128, text=True), {"degenerate_repetition"}, False),
    ("empty", dict(plant=_masked_rows), {"empty_responses"}, False),
    ("concentration", dict(plant=_lone_short_success, config=SEQ_MEAN), {"gradient_concentration"}, False),
]


@pytest.mark.parametrize("name,kwargs,expected,exact", CASES, ids=[c[0] for c in CASES])
def test_planted_problem_gives_its_alarm(tmp_path, name, kwargs, expected, exact):
    rep = diagnose(write_run(tmp_path / "run", **kwargs))
    got = ids(rep)
    assert expected <= got, (name, [f.message for f in rep.findings])
    if exact:
        assert got == expected, (name, [f.message for f in rep.findings])
    for f in rep.findings:
        if f.rule in expected:
            assert f.evidence.steps and len(f.evidence.steps) == len(f.evidence.values)
            assert f.evidence.window[0] >= 1 and f.evidence.window[1] == 9


def _finding(rep, rule):
    return next(f for f in rep.findings if f.rule == rule)


def test_repetition_evidence_counts_the_loops(tmp_path):
    """10 of the 64 rows loop; 10 more are as long but words: the share is exactly 10 / 64 on every step."""
    rep = diagnose(write_run(tmp_path / "run", plant=_loops, max_len=128, text=True, steps=4))
    f = _finding(rep, "degenerate_repetition")
    assert f.evidence.steps == [1, 2, 3, 4] and f.evidence.values == pytest.approx([10 / 64] * 4)
    assert f.evidence.source == "recomputed" and f.evidence.metric == "rldiag/output/repetition_fraction"


def test_empty_evidence_and_aborted_rows(tmp_path):
    rep = diagnose(write_run(tmp_path / "run", plant=_masked_rows, steps=3))
    f = _finding(rep, "empty_responses")
    assert f.evidence.values == pytest.approx([5 / 64] * 3) and "aborted_responses" in rep.passed
    rep = diagnose(write_run(tmp_path / "aborted", steps=3, plant=lambda st, s: [s.set_length(i, 0) for i in range(3)]))
    assert _finding(rep, "empty_responses").evidence.values == pytest.approx([3 / 64] * 3)


def test_while_finding_carries_both_evidences(tmp_path):
    rep = diagnose(write_run(tmp_path / "run", plant=_both(_scale_lengths(1.15), _rising_score), max_len=128))
    f = _finding(rep, "reward_hacking_length")
    assert f.evidence.metric == "critic/score/mean" and f.evidence.steps == list(range(1, 10))
    second = f.evidence.details["while"]
    assert second["metric"] == "response_length/mean" and second["window"] == [1, 9]
    assert second["trend"]["late_mean"] > 1.5 * second["trend"]["early_mean"]
    assert "; while response_length/mean" in f.message


def test_healthy_run_passes_the_new_rules(tmp_path):
    rep = diagnose(write_run(tmp_path / "run", text=True, config=COMPONENTS))
    assert not set(NEW) & ids(rep), [f.message for f in rep.findings]
    for rid in ("response_length_collapse", "degenerate_repetition", "empty_responses", "gradient_concentration"):
        assert rid in rep.passed, rid


@pytest.mark.parametrize("sample", ["grpo-tool", "ppo-gae"])
def test_bundled_samples_stay_quiet(tmp_path, sample):
    """Both samples learn (score 0.05 -> 0.7) with a reference KL growing from 0 to about 1.2
    and lengths falling from 9 to 7: none of it is a finding of the new rules."""
    run = tmp_path / sample
    shutil.copytree(SAMPLES / sample, run)
    rep = diagnose(run)
    assert not set(NEW) & ids(rep), [f.message for f in rep.findings if f.rule in NEW]
    for rid in ("degenerate_repetition", "empty_responses", "gradient_concentration", "reward_hacking_length",
                "reward_hacking_kl", "response_length_collapse", "response_length_runaway"):
        assert rid in rep.passed, (rid, rep.not_evaluated.get(rid))


# ---- the kind `while` on hand-made series -----------------------------------------------------


def _ctx(**series):
    table = {k.replace("_", "/"): Series(k, np.arange(1, len(v) + 1), np.asarray(v, np.float64), "logged")
             for k, v in series.items()}
    return Context(settings={}, series=lambda name, src: table.get(name))


def _while(second, **primary):
    params = {"direction": "rising", "ratio": 1.2, **primary, "while": second}
    return Rule(id="w", kind="while", title="t", why="w", metric="score", params=params, window=primary.pop("window", None))


def test_while_needs_both_over_the_same_window():
    up = np.linspace(1.0, 2.0, 9)
    second = {"metric": "len", "direction": "rising", "ratio": 1.5}
    run = RULE_KINDS.get("while")
    f = run(_while(second), _ctx(score=up, len=np.linspace(10, 20, 9)))
    assert isinstance(f, Finding)
    assert f.evidence.details["while"]["trend"]["late_mean"] == pytest.approx(np.mean(np.linspace(10, 20, 9)[-3:]))
    assert isinstance(run(_while(second), _ctx(score=up, len=np.full(9, 10.0))), Passed)
    assert isinstance(run(_while(second), _ctx(score=up[::-1], len=np.linspace(10, 20, 9))), Passed)  # score falls
    assert isinstance(run(_while(second), _ctx(score=up)), Skip)  # no length
    # the length rose only before the window of the last 6 steps: over those steps it is flat
    early_rise = np.r_[np.linspace(10, 20, 3), np.full(6, 20.0)]
    w = Rule(id="w", kind="while", title="t", why="w", metric="score", window=6,
             params={"direction": "rising", "ratio": 1.1, "while": second})
    assert isinstance(run(w, _ctx(score=up, len=early_rise)), Passed)
    thr = _while({"kind": "threshold", "metric": "share", "above": 0.8, "stat": "mean"})
    assert isinstance(run(thr, _ctx(score=up, share=np.full(9, 0.9))), Finding)
    assert isinstance(run(thr, _ctx(score=up, share=np.full(9, 0.5))), Passed)


@pytest.mark.parametrize("second,message", [
    ("len", "'while' must be a mapping"),
    ({"direction": "rising", "ratio": 1.5}, "'while' needs 'metric'"),
    ({"metric": "x", "kind": "settings"}, "'while.kind' must be one of"),
    ({"metric": "x", "direction": "up", "ratio": 1.5}, "under 'while': 'direction'"),
    ({"metric": "x", "direction": "rising", "ratio": 1.5, "above": 1}, "unknown key(s) above"),
])
def test_while_rules_are_checked(tmp_path, second, message):
    import yaml
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"rules": [{"id": "w", "kind": "while", "title": "t", "why": "w", "metric": "m",
                                               "direction": "rising", "ratio": 1.2, "while": second}]}))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_rules([path], builtin=False)


def test_reward_hacking_kl_is_information(tmp_path):
    """A rising score with a drifting reference KL: reward_hacking_kl's finding, at severity info
    (on the calibration corpus healthy runs that learn fast showed the same, docs/calibration.md)."""
    rep = diagnose(write_run(tmp_path / "run", plant=_both(_ref_drift, _rising_score)))
    f = _finding(rep, "reward_hacking_kl")
    assert f.severity == "info" and f.evidence.window == [1, 9]
    assert f.evidence.calibration is not None and f.evidence.calibration["text"]
