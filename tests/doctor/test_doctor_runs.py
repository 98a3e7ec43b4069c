"""``rldiag doctor`` on generated runs: a healthy run gives no alarm, each planted problem gives
its own alarm (and, where the plant touches nothing else, only that one)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rldiag.cli.main import main
from rldiag.doctor import diagnose
from tests.doctor.runs import MAX_LEN, healthy_logs, write_run


def ids(rep) -> set[str]:
    """The rules with a finding that counts (severity info never does)."""
    return {f.rule for f in rep.findings if f.severity != "info"}


def counted(rep) -> list:
    return [f for f in rep.findings if f.severity != "info"]


def test_healthy_grpo_run_gives_no_alarm(tmp_path, capsys):
    root = write_run(tmp_path / "run", logged=healthy_logs)
    rep = diagnose(root)
    assert counted(rep) == [], [f.message for f in rep.findings]
    assert rep.healthy
    # its rollout log-probs differ from the trainer's by small symmetric noise: precision, for information
    info = [(f.rule, f.evidence.cause) for f in rep.findings]
    assert info == [("rollout_mismatch", "precision")], info
    assert rep.recomputed_steps == 9 and rep.logged_steps == 9 and not rep.recompute_failed
    # the rules that can judge this run did judge it
    for rid in ("ppo_kl_high", "clipfrac_high", "no_signal_groups", "rollout_is_ess_low", "rollout_kl_growing",
                "entropy_collapse", "advantages_not_centred", "length_clipped"):
        assert rid in rep.passed, rid
    assert "vf_explained_var_negative" in rep.not_applicable
    assert main(["doctor", str(root)]) == 0
    assert "no problem found" in capsys.readouterr().out


def test_healthy_gae_run_gives_no_alarm(tmp_path):
    # vf_explained_var_negative reads a critic after its first 10 steps (warmup), 5 steps at least
    root = write_run(tmp_path / "run", critic=True, config={"algorithm": {"adv_estimator": "gae"}}, steps=16)
    rep = diagnose(root)
    assert counted(rep) == [], [f.message for f in rep.findings]
    assert "vf_explained_var_negative" in rep.passed


def _shift_cur(delta):
    def plant(step, s):
        for i in range(s.rows):
            s.cur[i] = (s.old[i] + delta(s, i)).astype(np.float32)
    return plant


def _plant_lengths(frac, length):
    def plant(step, s):
        for i in range(int(s.rows * frac)):
            s.set_length(i, length)
    return plant


def _plant_collapse(step, s):  # 6 of 8 prompts: every response gets the same score
    for i in range(s.rows):
        if int(s.uid[i].split("p")[-1]) < 6:
            s.score[i] = float(int(s.uid[i].split("p")[-1]) % 2)


def _plant_length_bias(step, s):  # failed responses long, successful ones short
    for i in range(s.rows):
        s.set_length(i, 8 if s.score[i] else 30)


def _plant_rollout_drift(step, s):
    sd = 0.02 * 1.4 ** (step - 1)  # rollout and trainer drift further apart every step
    for i in range(s.rows):
        x = s.rng.normal(sd * sd / 2, sd, len(s.old[i]))
        s.rollout[i] = (s.old[i] + x).astype(np.float32)


def _plant_entropy(step, s):
    for i in range(s.rows):
        s.entropy[i] = (s.entropy[i] * 0.7 ** (step - 1)).astype(np.float32)


def _plant_on_policy_late(step, s):
    if step > 5:
        for i in range(s.rows):
            s.cur[i] = s.old[i].copy()


def _plant_dual_clip(step, s):
    for i in range(s.rows):
        hit = s.rng.random(len(s.old[i])) < 0.05
        s.cur[i] = np.where(hit, s.old[i] + 1.5, s.cur[i]).astype(np.float32)


def _plant_kl_reward(step, s):
    for i in range(s.rows):
        s.ref[i] = (s.old[i] - 0.5).astype(np.float32)


def _ess_logs(step, s):
    return {"rollout_corr/rollout_is_eff_sample_size": 0.97 if step <= 4 else 0.15}


KL_IN_REWARD = {"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": True, "kl_ctrl": {"kl_coef": 0.2}}}
BOTH_KL = {"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": True},
           "actor_rollout_ref": {"actor": {"use_kl_loss": True}}}

# (planted problem, write_run arguments, the alarms it must give, exact: no other alarm)
CASES = [
    ("ppo_kl_high", dict(plant=_shift_cur(lambda s, i: -0.15)), {"ppo_kl_high"}, True),
    ("ppo_kl_collapse", dict(plant=_plant_on_policy_late), {"ppo_kl_collapse"}, True),
    ("clipfrac_high", dict(plant=_shift_cur(lambda s, i: s.rng.normal(0, 0.6, len(s.old[i])))), {"clipfrac_high"}, False),
    ("dual_clip", dict(plant=_plant_dual_clip), {"dual_clip_firing"}, True),
    ("vf_explained_var", dict(critic=True, config={"algorithm": {"adv_estimator": "gae"}}, steps=16,
                              plant=lambda st, s: s.values.__setitem__(slice(None), [
                                  s.rng.normal(0, 2, len(m)).astype(np.float32) for m in s.mask])),
     {"vf_explained_var_negative"}, True),
    ("length_bias", dict(plant=_plant_length_bias), {"advantages_not_centred"}, True),
    ("collapsed_groups", dict(plant=_plant_collapse), {"no_signal_groups"}, True),
    # a row of length 0 has no actor token either: empty_responses says so too
    ("aborted", dict(plant=_plant_lengths(0.1, 0)), {"aborted_responses", "empty_responses"}, True),
    # length_clipped is information only (its finding does not count): test_length_clipped_is_information
    ("length_clipped", dict(steps=10, plant=_plant_lengths(0.3, MAX_LEN)), set(), True),
    ("kl_reward_flip", dict(config=KL_IN_REWARD, plant=_plant_kl_reward), {"kl_reward_sign_flip"}, False),
    ("ess_collapse", dict(logged=_ess_logs), {"rollout_is_ess_low"}, True),
    # symmetric noise growing past bf16's level: the size rules fire, and the cause is precision at warning
    ("rollout_drift", dict(plant=_plant_rollout_drift),
     {"rollout_kl_growing", "rollout_chi2_growing", "rollout_ppl_gap_growing", "rollout_mismatch"}, True),
    ("double_kl", dict(config=BOTH_KL), {"double_kl_regularisation"}, True),
    ("entropy_collapse", dict(plant=_plant_entropy), {"entropy_collapse"}, True),
]


@pytest.mark.parametrize("name,kwargs,expected,exact", CASES, ids=[c[0] for c in CASES])
def test_planted_problem_gives_its_alarm(tmp_path, name, kwargs, expected, exact):
    rep = diagnose(write_run(tmp_path / "run", **kwargs))
    assert expected <= ids(rep), (name, [f.message for f in rep.findings])
    if exact:
        assert ids(rep) == expected, (name, [f.message for f in rep.findings])
    for f in rep.findings:
        assert f.why and f.title and f.message
        if f.rule in expected and f.evidence.metric:
            assert f.evidence.steps and len(f.evidence.steps) == len(f.evidence.values)
            assert f.evidence.trend["steps"] >= 1


def test_reinforce_pp_credit_cut(tmp_path):
    """verl 0.8.0's REINFORCE++ resets the return at mask-0 tokens: a run with tool spans is
    warned; the same run reproduced as a release that carries the return through (0.9.0 on, the
    default snapshot) cuts no credit and passes."""
    old = {"algorithm": {"adv_estimator": "reinforce_plus_plus"}, "rldiag": {"verl_version": "0.8.0"}}
    cut = diagnose(write_run(tmp_path / "cut", config=old, tool_prob=0.8, steps=3))
    assert ids(cut) == {"reinforce_pp_credit_cut"}, [f.message for f in cut.findings]
    f = cut.findings[0]
    assert f.evidence.metric == "rldiag/mask/credit_cut_fraction" and 0.05 < np.mean(f.evidence.values) < 1
    clean = diagnose(write_run(tmp_path / "clean", config=old, tool_prob=0.0, steps=3))
    assert "reinforce_pp_credit_cut" in clean.passed
    new = {"algorithm": {"adv_estimator": "reinforce_plus_plus"}}
    carried = diagnose(write_run(tmp_path / "carried", config=new, tool_prob=0.8, steps=3))
    assert "reinforce_pp_credit_cut" in carried.passed, [f.message for f in carried.findings]


def test_evidence_of_a_threshold_finding(tmp_path):
    root = write_run(tmp_path / "run", plant=_plant_collapse, steps=4)
    rep = diagnose(root)
    f = next(f for f in rep.findings if f.rule == "no_signal_groups")
    assert f.evidence.source == "recomputed" and f.evidence.window == [1, 4]
    assert f.evidence.values == pytest.approx([0.75] * 4, abs=0.13)  # 6 of 8 groups flat, maybe one more
    assert "mean of rldiag/groups/no_signal_fraction" in f.message


def test_cli_json_and_logged_only(tmp_path, capsys):
    root = write_run(tmp_path / "run", logged=_ess_logs, plant=_plant_collapse, steps=8)
    assert main(["doctor", str(root), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert {f["rule"] for f in d["findings"] if f["severity"] != "info"} == {"rollout_is_ess_low", "no_signal_groups"}
    # the mismatch diagnosis: the run's noise-level gap is precision, for information (the contract's shape)
    mm = [f for f in d["findings"] if f["rule"] == "rollout_mismatch"]
    assert [(f["severity"], f["evidence"]["cause"]) for f in mm] == [("info", "precision")]
    assert 0.8 < mm[0]["evidence"]["confidence"] <= 1 and mm[0]["evidence"]["steps"]
    ess = next(f for f in d["findings"] if f["rule"] == "rollout_is_ess_low")
    assert ess["evidence"]["steps"] == [5, 6, 7, 8] and ess["evidence"]["source"] == "logged"
    assert ess["severity"] == "critical" and d["healthy"] is False
    # its metric has a reference band (verl's health check, ESS >= 0.3): the evidence's mean, 0.15, is below it
    band = ess["evidence"]["band"]
    assert band["value"] == pytest.approx(0.15) and [b["where"] for b in band["bands"]] == ["below"]
    assert band["text"] == "rollout_corr/rollout_is_eff_sample_size 0.15: below the verl health check band [0.3, 1]"
    assert mm[0]["evidence"]["band"] is None  # rldiag/mismatch/*: no band for the pattern
    # logged only: the recomputed signals are absent, so their rules are not evaluated
    rep = diagnose(root, recompute=False)
    assert ids(rep) == {"rollout_is_ess_low"} and "no_signal_groups" in rep.not_evaluated
    assert "rollout_mismatch" in rep.not_evaluated
    assert main(["doctor", str(root), "--logged-only"]) == 1
    out = capsys.readouterr().out
    assert "Rollout importance-sampling effective sample size collapsed" in out and "why it matters" in out
    assert main(["doctor", str(tmp_path / "nope")]) == 2


def test_length_clipped_is_information(tmp_path):
    """30 % of the rows cut at max_response_length over 10 steps: length_clipped's finding, at
    severity info (on the calibration corpus it fired on healthy runs as often as on sick ones)."""
    rep = diagnose(write_run(tmp_path / "run", steps=10, plant=_plant_lengths(0.3, MAX_LEN)))
    (f,) = [f for f in rep.findings if f.rule == "length_clipped"]
    assert f.severity == "info" and f.evidence.window == [1, 10] and rep.healthy
    assert f.evidence.calibration is not None and f.evidence.calibration["status"] == "calibrated"
    assert f.evidence.calibration["text"].startswith("on the calibration corpus: precision")
