"""``rldiag probe-reward``: a reward that pays the answer tag alone is named a shortcut; the toy
task's own reward, which pays the answer, stays quiet."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rldiag import api
from rldiag.analysis.reward_probe import PROBES, choose, probe_reward
from rldiag.cli.main import main

pytestmark = pytest.mark.slow  # worker processes

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "grpo-tool"
TAG_ONLY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Pays for the answer's end tag alone: a planted shortcut."""
    return 1.0 if "<eos>" in solution_str else 0.0
'''


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("probe") / "grpo-tool"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns("rldiag"))
    return run


def test_a_reward_paying_the_tag_alone_is_named(sample, tmp_path):
    fn = tmp_path / "tag.py"
    fn.write_text(TAG_ONLY)
    rep = probe_reward(sample, f"{fn}:compute_score", prompts=64, workers=2)
    assert rep.prompts == 64 and [p.probe for p in rep.probes] == list(PROBES)
    stats = {p.probe: p for p in rep.probes}
    assert stats["empty"].mean == 0.0 and stats["ground_truth_only"].mean == 0.0
    # another prompt's reply carries the tag as often as a real one: paid as much
    assert stats["other_prompt"].mean >= 0.5 * rep.real_mean > 0
    assert [(f.rule, f.evidence.cause) for f in rep.findings] == [("reward_shortcut", "other_prompt")]
    ev = rep.findings[0].evidence.details
    assert ev["mean_score"] == stats["other_prompt"].mean and ev["examples"][0]["score"] == 1.0
    assert all("<eos>" in ex["reply"] for ex in ev["examples"])


def test_the_toy_tasks_own_reward_stays_quiet(sample):
    rep = probe_reward(sample, "rldiag.toy.task:compute_score", prompts=64, workers=2)
    assert rep.findings == []
    stats = {p.probe: p.mean for p in rep.probes}
    assert stats["empty"] == 0.0 and stats["other_prompt"] < 0.5 * rep.real_mean
    # the bare answer earns the task's partial credit, under what a rewarded reply earns
    assert stats["ground_truth_only"] == 0.5 and rep.rewarded_mean is not None and rep.rewarded_mean > 0.5


def test_prompts_are_spread_over_sources_and_steps():
    from rldiag.analysis.reward_probe import ProbedPrompt

    items = [ProbedPrompt(step, src, "1", {}, "r", "p") for step in range(1, 11) for src in ("a", "a", "b")]
    got = choose(items, 6)
    assert sorted(p.data_source for p in got) == ["a", "a", "a", "b", "b", "b"]
    assert [p.step for p in got if p.data_source == "b"] == [1, 5, 10]


def test_cli_probe_reward_json_and_doctor_reward(sample, tmp_path, capsys):
    fn = tmp_path / "tag.py"
    fn.write_text(TAG_ONLY)
    assert main(["probe-reward", str(sample), "--reward", f"{fn}:compute_score", "--prompts", "16", "--workers", "1",
                 "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [f["evidence"]["cause"] for f in out["findings"]] == ["other_prompt"]
    rep = api.diagnose(sample, recompute=False, reward=f"{fn}:compute_score")
    assert "reward_shortcut" in {f.rule for f in rep.findings}
