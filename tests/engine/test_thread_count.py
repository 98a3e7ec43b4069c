"""The engine's results do not depend on torch's thread count: every reduction it makes is per
row or per segment, never split across threads. The local executor relies on this when it
gives the engine every core for the last packs (and a user's 16-core machine gets the numbers
this 2-core CI gets)."""

from __future__ import annotations

import pytest
import torch

from rldiag.config.settings import resolve_settings
from rldiag.engine.batch import pack
from rldiag.engine.pipeline import recompute_batch
from rldiag.engine.requirements import recompute_columns
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir
from rldiag.synth import SynthSpec, write_synth_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # 3 steps x 64 rows x up to 700 tokens, packed: ~100k slots, above torch's grain for
    # splitting an elementwise op or a reduction across threads
    spec = SynthSpec(steps=3, prompts=8, n=8, min_len=300, max_len=700, tool_prob=0.5, seed=11)
    return write_synth_run(tmp_path_factory.mktemp("threads") / "run", spec)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(torch.nan_to_num(a, nan=7.25), torch.nan_to_num(b, nan=7.25))) \
        and bool(torch.equal(a.isnan(), b.isnan()))


@pytest.mark.parametrize(
    "overrides",
    [
        {"algorithm.adv_estimator": "gae", "algorithm.lam": 0.95},
        {"algorithm.adv_estimator": "gae"},
        {"algorithm.adv_estimator": "grpo"},
        {"algorithm.adv_estimator": "rloo", "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum"},
        {"algorithm.adv_estimator": "reinforce_plus_plus", "algorithm.rollout_correction.rollout_is": "sequence"},
    ],
)
def test_one_thread_and_several_give_identical_results(run, overrides):
    settings = resolve_settings(run, overrides)
    batch = pack([load_step(sf, settings, recompute_columns(settings)).batch for sf in RunDir(run).require_steps()])
    assert batch.response_mask.numel() > 65_536
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = recompute_batch(batch, settings, None)
        torch.set_num_threads(3)
        several = recompute_batch(batch, settings, None)
    finally:
        torch.set_num_threads(before)
    assert one.metrics.keys() == several.metrics.keys() and one.tokens.keys() == several.tokens.keys()
    differ = [k for k in one.metrics if not _same(one.metrics[k], several.metrics[k])]
    differ += [k for k in one.tokens if not _same(one.tokens[k], several.tokens[k])]
    assert differ == []
