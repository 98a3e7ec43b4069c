"""rldiag's recompute reproduces what the toy trainer computed and logged with its own code.

The trainer (rldiag.toy.algos) and rldiag's engine are separate implementations of verl's
semantics, so agreement here is a real cross-check. Per-token advantages / returns /
token_level_rewards and the whole-step data metrics match under the baseline settings; the actor
and critic metrics match with ``rldiag.mini_batch_size`` and ``rldiag.micro_batch_size`` set to
the trainer's mini-batch (= micro-batch) rows.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rldiag.toy import ToyTrainer, grpo_tool, ppo_gae
from tests.toy.reproduce import ATOL, metric_mismatches, recompute_scenario, token_mismatches

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
#: Metrics verl sums over the micro-batches of one mini-batch (normalised by the mini-batch's
#: tokens) and then averages over mini-batches.
MINIBATCH_SUM_METRICS = {"actor/pg_loss", "actor/entropy_loss", "actor/kl_loss"}


def _assert_all_match(run: Path, overrides: dict | None = None, skip: set[str] = frozenset()) -> set[str]:
    scenario = recompute_scenario(run, overrides)
    tokens = token_mismatches(run, scenario)
    assert all(v <= ATOL for v in tokens.values()), tokens
    excess, missing = metric_mismatches(run, scenario)
    assert not missing, f"logged but not recomputed: {sorted(missing)}"
    bad = {k: v for k, v in excess.items() if v > ATOL and k not in skip}
    assert not bad, bad
    return set(excess)


@pytest.fixture(params=["grpo-tool", "ppo-gae"])
def sample(request, tmp_path) -> tuple[Path, int]:
    """A copy of a shipped sample run (recompute writes into RUN/rldiag) and its micro-batch rows."""
    src = SAMPLES / request.param
    if not (src / "batches").is_dir():
        pytest.skip(f"{src} is not there; regenerate with python -m rldiag.toy.make_samples samples/")
    dst = tmp_path / request.param
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("rldiag"))
    cfg = (grpo_tool if request.param == "grpo-tool" else ppo_gae)()
    return dst, cfg.mini_batch_rows


def test_samples_reproduce_with_mini_and_micro_batch_emulation(sample):
    """With the trainer's mini-batch (= micro-batch) rows, every logged metric is reproduced:
    the equal-weight micro-batch means and the per-mini-batch normalised losses alike."""
    run, rows = sample
    compared = _assert_all_match(run, {"rldiag.micro_batch_size": rows, "rldiag.mini_batch_size": rows})
    assert {"critic/advantages/mean", "critic/score/mean", "actor/pg_clipfrac", "actor/ppo_kl",
            "response_length/mean"} | MINIBATCH_SUM_METRICS - {"actor/kl_loss"} <= compared
    if "ppo-gae" in run.name:
        assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var",
                "actor/reward_kl_penalty"} <= compared
    else:
        assert "actor/kl_loss" in compared


def test_samples_reproduce_under_the_default_settings(sample):
    """The run's config has verl's batch keys: the default scenario batches as the run did."""
    run, _ = sample
    compared = _assert_all_match(run, {})
    assert MINIBATCH_SUM_METRICS - {"actor/kl_loss"} <= compared


def test_samples_whole_step_losses_differ_without_mini_batches(sample):
    """The toy takes 8 optimizer steps per training step: treated as one mini-batch, the losses
    verl normalises per mini-batch come out different (the data metrics still match)."""
    run, rows = sample
    scenario = recompute_scenario(run, {"rldiag.micro_batch_size": rows, "rldiag.mini_batch_size": None})
    excess, _ = metric_mismatches(run, scenario)
    assert excess["actor/pg_loss"] > ATOL and excess["actor/entropy_loss"] > ATOL
    assert excess["critic/advantages/mean"] <= ATOL and excess["actor/pg_clipfrac"] <= ATOL


@pytest.mark.parametrize("make", [
    lambda: grpo_tool(steps=3, prompts_per_step=4, mini_batch_prompts=4),
    lambda: ppo_gae(steps=3, prompts_per_step=32, mini_batch_prompts=32),
], ids=["grpo-tool", "ppo-gae"])
def test_one_minibatch_per_step_reproduces_every_metric_under_baseline(make, tmp_path):
    """With one mini-batch (= micro-batch) per step, verl's averaging is the whole step's value,
    so the baseline recompute reproduces every metric, the global-normalised losses included."""
    torch.set_num_threads(1)
    run = tmp_path / "run"
    ToyTrainer(make()).run(run)
    compared = _assert_all_match(run)
    assert MINIBATCH_SUM_METRICS & compared >= {"actor/pg_loss", "actor/entropy_loss"}
