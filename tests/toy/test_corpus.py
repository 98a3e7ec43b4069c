"""The calibration corpus (rldiag/toy/corpus.py): the cases, the onset rule, and a tiny corpus
trained end to end (a healthy run and an entropy collapse produced by the training itself)."""

from __future__ import annotations

import json

import pytest

from rldiag.errors import RldiagError
from rldiag.toy.corpus import Case, _entropy_collapse, _healthy, cases, collapse_onset, generate


def test_the_onset_rule_on_a_hand_made_series():
    # start 2.0; 0.75 x 2.0 = 1.5; rolling means of 3: 1.9, 1.6, 1.3 -> index 4
    assert collapse_onset([2.1, 1.9, 1.7, 1.2, 1.0, 0.5]) == 4
    assert collapse_onset([2.0, 2.0, 1.9, 1.8, 1.7]) is None
    assert collapse_onset([2.0]) is None


def test_the_cases_and_their_split_by_seed():
    small = cases("small")
    assert [c.kind for c in small] == ["healthy", "healthy", "entropy_collapse", "entropy_collapse"]
    assert [c.split for c in small] == ["test", "train", "test", "train"]
    full = cases("full", seed=100)
    healthy = [c for c in full if c.kind == "healthy"]
    collapse = [c for c in full if c.kind == "entropy_collapse"]
    assert len(healthy) == 16 and len(collapse) == 20 and len({c.name for c in full}) == len(full)
    assert sum(c.split == "test" for c in collapse) == 10
    assert sum(c.config.steps for c in healthy if c.split == "test") == 240
    assert {c.tags["adv_estimator"] for c in healthy} == {"grpo", "gae"}
    assert {c.tags["kl"] for c in healthy} == {"loss", "reward", "none"}
    assert {c.tags["tool"] for c in healthy} == {True, False} and {c.tags["temperature"] for c in healthy} == {1.0, 0.8}
    assert all(c.config.entropy_coeff == 0.0 and c.config.actor_lr == 3e-2 for c in collapse)
    with pytest.raises(RldiagError, match="small or full"):
        cases("medium")


@pytest.mark.slow
def test_a_tiny_corpus_end_to_end(tmp_path):
    """Two runs of 8 steps: the healthy one's entropy never meets the collapse rule, the collapse's
    does, at the step its labels say, read back from the run's own metrics.jsonl."""
    healthy, collapse = _healthy(1, 8, 0), _entropy_collapse(1, 8)
    manifest = generate(tmp_path, [healthy, collapse])
    assert [r["name"] for r in manifest["runs"]] == [healthy.name, collapse.name]
    assert manifest["not_produced"] == [] and manifest["splits"] == {"train": 0, "test": 2}
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest

    def entropy(case: Case) -> list[float]:
        lines = (tmp_path / case.name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["data"]["actor/entropy_loss"] for line in lines]

    for case in (healthy, collapse):
        assert len(list((tmp_path / case.name / "batches").iterdir())) == 8
    lab_h = json.loads((tmp_path / healthy.name / "labels.json").read_text())
    lab_c = json.loads((tmp_path / collapse.name / "labels.json").read_text())
    assert lab_h["healthy"] is True and lab_h["pathologies"] == [] and lab_h["split"] == "test"
    assert lab_h["info"][0]["cause"] == "precision" and lab_h["info"][0]["severity"] == "info"
    assert collapse_onset(entropy(healthy)) is None
    (p,) = lab_c["pathologies"]
    assert lab_c["healthy"] is False and p["kind"] == "entropy_collapse" and p["signal"] == "actor/entropy_loss"
    assert p["onset_step"] == collapse_onset(entropy(collapse)) + 1 and 3 <= p["onset_step"] <= 8
    assert lab_c["config"]["entropy_coeff"] == 0.0 and lab_c["config"]["seed"] == 1
