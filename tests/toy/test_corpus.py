"""The calibration corpus (rldiag/toy/corpus.py): the cases, the onset rule, and a tiny corpus
trained end to end (a healthy run and an entropy collapse produced by the training itself)."""

from __future__ import annotations

import json

import pytest

from rldiag.errors import RldiagError
from rldiag.toy.corpus import (
    CASES,
    Case,
    Family,
    cases,
    divergence_case,
    entropy_collapse_case,
    generate,
    healthy_case,
    no_pathology,
    register,
)
from rldiag.toy.onsets import collapse_onset, divergence_onset, hacking_onset


def test_the_onset_rule_on_a_hand_made_series():
    # start 2.0; 0.75 x 2.0 = 1.5; rolling means of 3: 1.9, 1.6, 1.3 -> index 4
    assert collapse_onset([2.1, 1.9, 1.7, 1.2, 1.0, 0.5]) == 4
    assert collapse_onset([2.0, 2.0, 1.9, 1.8, 1.7]) is None
    assert collapse_onset([2.0]) is None
    # entropy below 0.1 and score below the best of the first 3 steps (0.2) from index 3 on
    entropy = [2.0, 0.05, 0.5, 0.05, 0.0, 0.01]
    assert divergence_onset(entropy, [0.2, 0.0, 0.0, 0.1, 0.0, 0.01]) == 3
    assert divergence_onset(entropy, [0.2, 0.0, 0.0, 0.1, 0.0, 0.3]) is None  # the reward came back
    assert divergence_onset([2.0, 1.9, 1.8], [0.2, 0.0, 0.0]) is None  # too short
    assert divergence_onset([2.0, 1.9, 1.8, 1.7], [0.2, 0.0, 0.0, 0.0]) is None  # the entropy did not go
    # a run whose first step scored 0: the best of the first three (0.12) is the reference
    assert divergence_onset([2.4, 1.2, 0.7, 0.0, 0.0], [0.0, 0.12, 0.0, 0.02, 0.0]) == 3
    # deterministic on a better reward: collapsed, not diverged
    assert divergence_onset([1.7, 0.8, 0.05, 0.0, 0.0], [0.07, 0.13, 0.06, 0.31, 0.41]) is None


def test_the_cases_and_their_split_by_seed():
    small = cases("small", kinds=["healthy", "entropy_collapse", "divergence", "reward_hacking"])
    assert [c.kind for c in small] == ["healthy", "healthy", "entropy_collapse", "entropy_collapse", "divergence",
                                       "divergence", "reward_hacking", "reward_hacking"]
    assert [c.split for c in small] == ["test", "train"] * 4
    full = cases("full", seed=100)
    healthy = [c for c in full if c.kind == "healthy"]
    collapse = [c for c in full if c.kind == "entropy_collapse"]
    for kind in ("divergence", "reward_hacking"):
        assert sum(c.kind == kind and c.split == "test" for c in full) >= 12
    assert len(healthy) == 16 and len(collapse) == 24 and len({c.name for c in full}) == len(full)
    assert sum(c.split == "test" for c in collapse) == 12
    assert sum(c.config.steps for c in healthy if c.split == "test") == 240
    assert {c.tags["adv_estimator"] for c in healthy} == {"grpo", "gae"}
    assert {c.tags["kl"] for c in healthy} == {"loss", "reward", "none"}
    assert {c.tags["tool"] for c in healthy} == {True, False} and {c.tags["temperature"] for c in healthy} == {1.0, 0.8}
    # each setting in both splits (the split is by seed, never by setting)
    for split in ("train", "test"):
        part = [c for c in healthy if c.split == split]
        assert {c.tags["adv_estimator"] for c in part} == {"grpo", "gae"} and {c.tags["kl"] for c in part} == {
            "loss", "reward", "none"}
        assert {c.tags["tool"] for c in part} == {True, False} and {c.tags["temperature"] for c in part} == {1.0, 0.8}
    assert all(c.config.entropy_coeff == 0.0 and c.config.actor_lr == 3e-2 for c in collapse)
    with pytest.raises(RldiagError, match="small or full"):
        cases("medium")
    with pytest.raises(RldiagError, match="unknown corpus kinds"):
        cases("small", kinds=["nope"])


def test_a_family_added_to_the_table_joins_the_corpus(monkeypatch):
    """The extension point other modules use (rldiag/toy/corpus_gap.py): a registered family's
    runs join cases() with consecutive seeds, in both splits; a kind registered twice fails."""
    monkeypatch.setattr("rldiag.toy.corpus.CASES", dict(CASES))
    fam = Family("extra", lambda seed, steps, i: healthy_case(seed, steps, i), {"small": 3}, no_pathology)
    register(fam)
    extra = cases("small", seed=10, kinds=["extra"])
    assert [c.config.seed for c in extra] == [11, 12, 13] and [c.split for c in extra] == ["test", "train", "test"]
    assert [c.kind for c in cases("small")][-3:] == ["healthy"] * 3 and cases("full", kinds=["extra"]) == []
    with pytest.raises(RldiagError, match="registered twice"):
        register(Family("extra", healthy_case, {"small": 1}, no_pathology))
    with pytest.raises(RldiagError, match="unknown sizes"):
        register(Family("other", healthy_case, {"tiny": 1}, no_pathology))


def test_the_hacking_onset_rule_on_a_hand_made_series():
    # the true score rises to a plateau of 0.5, then falls to 0.2 from index 10 while the reward keeps rising
    label = [0.1, 0.3, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]
    reward = [0.1 * i for i in range(len(label))]
    # rolling means of 5 of the label: max 0.5 (indices 6-9); below 0.45 from index 10 (0.44) on
    assert hacking_onset(label, reward) == 10
    assert hacking_onset(label, [1.0] * len(label)) is None  # the reward did not rise: no hacking
    assert hacking_onset(label[:10], reward[:10]) is None  # the true score never turned


@pytest.mark.slow
def test_a_tiny_corpus_end_to_end(tmp_path):
    """Three runs of 8 steps: the healthy one's series meet neither rule, the collapse's and the
    divergence's meet theirs, at the steps their labels say, read back from the runs' own
    metrics.jsonl; then rldiag calibrate over them."""
    healthy, collapse, diverged = healthy_case(1, 8, 0), entropy_collapse_case(1, 8), divergence_case(1, 8)
    manifest = generate(tmp_path, [healthy, collapse, diverged])
    assert [r["name"] for r in manifest["runs"]] == [healthy.name, collapse.name, diverged.name]
    assert manifest["not_produced"] == [] and manifest["splits"] == {"train": 0, "test": 3}
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest

    def logged(case: Case, metric: str) -> list[float]:
        lines = (tmp_path / case.name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["data"][metric] for line in lines]

    def entropy(case: Case) -> list[float]:
        return logged(case, "actor/entropy_loss")

    for case in (healthy, collapse, diverged):
        assert len(list((tmp_path / case.name / "batches").iterdir())) == 8
    lab_h = json.loads((tmp_path / healthy.name / "labels.json").read_text())
    lab_c = json.loads((tmp_path / collapse.name / "labels.json").read_text())
    assert lab_h["healthy"] is True and lab_h["pathologies"] == [] and lab_h["split"] == "test"
    assert lab_h["info"][0]["cause"] == "precision" and lab_h["info"][0]["severity"] == "info"
    assert collapse_onset(entropy(healthy)) is None
    assert divergence_onset(entropy(healthy), logged(healthy, "critic/score/mean")) is None
    (p,) = lab_c["pathologies"]
    assert lab_c["healthy"] is False and p["kind"] == "entropy_collapse" and p["signal"] == "actor/entropy_loss"
    assert p["onset_step"] == collapse_onset(entropy(collapse)) + 1 and 3 <= p["onset_step"] <= 8
    assert lab_c["config"]["entropy_coeff"] == 0.0 and lab_c["config"]["seed"] == 1
    lab_d = json.loads((tmp_path / diverged.name / "labels.json").read_text())
    (d,) = lab_d["pathologies"]
    assert d["kind"] == "divergence" and d["signal"] == "actor/entropy_loss, critic/score/mean"
    assert d["onset_step"] == divergence_onset(entropy(diverged), logged(diverged, "critic/score/mean")) + 1

    # rldiag calibrate on the three runs (all in test): the floors, never exact figures
    from rldiag import api

    cal = api.calibrate(tmp_path)
    assert json.loads((tmp_path / "calibration.json").read_text())["splits"] == cal["splits"]
    test = cal["splits"]["test"]
    assert test["runs"] == 3 and test["healthy_steps"] == 8 and test["runs_by_kind"] == {
        "healthy": 1, "entropy_collapse": 1, "divergence": 1}
    replays = {r["name"]: r for r in cal["runs"]}
    assert {r["steps"] for r in replays.values()} == {8} and not any(r["recompute_failed"] for r in replays.values())
    # the healthy run: no critical alert, and at most the bf16 precision cause at info from the gap rule
    assert not [a for a in replays[healthy.name]["alerts"] if a["severity"] == "critical"]
    assert replays[healthy.name]["final"].get("rollout_mismatch/precision", "info") == "info"
    # each planted run alerted, and every row adds up
    assert replays[collapse.name]["alerts"] and replays[diverged.name]["alerts"]
    for row in test["rules"]:
        assert row["tp"] + row["fp"] == row["fired"] <= row["runs"] == 3
        assert row["status"] in ("never fired", "not enough data", "uncalibrated")  # 3 runs: too few for a figure
