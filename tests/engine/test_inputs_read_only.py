"""The loader hands the engine flat tensors that share Arrow's buffers (zero-copy); the engine
must never write into its inputs. Every estimator and the rollout-correction / KL paths run on
a loaded step, and every input tensor is unchanged afterwards."""

from __future__ import annotations

import pytest
import torch

from rldiag.config.settings import resolve_settings
from rldiag.engine.batch import TOKEN_FIELDS
from rldiag.engine.pipeline import recompute_batch
from rldiag.engine.requirements import recompute_columns
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir
from rldiag.synth import SynthSpec, write_synth_run


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    run = write_synth_run(tmp_path_factory.mktemp("ro") / "run", SynthSpec(steps=1, prompts=3, n=4, max_len=24))
    return run, RunDir(run).require_steps()[0]


@pytest.mark.parametrize("estimator", ["grpo", "gae", "reinforce_plus_plus", "rloo", "opo"])
def test_recompute_leaves_loaded_inputs_unchanged(step, estimator):
    run, sf = step
    s = resolve_settings(run, {
        "algorithm.adv_estimator": estimator, "algorithm.use_kl_in_reward": True,
        "actor_rollout_ref.actor.use_kl_loss": True,
        "algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_is_threshold": 2.0,
        "algorithm.rollout_correction.rollout_rs": "token_k1", "algorithm.rollout_correction.rollout_rs_threshold": 1.5,
    })
    b = load_step(sf, s, recompute_columns(s)).batch
    before = {name: getattr(b, name).clone() for name in TOKEN_FIELDS if getattr(b, name) is not None}
    # mask, scores, the log-prob and entropy columns; the values and vpreds only with a critic
    # (gae's), which alone reads them
    assert len(before) == (9 if s.uses_critic else 7)
    assert (b.values is not None) == (b.vpreds is not None) == s.uses_critic
    recompute_batch(b, s)
    for name, t in before.items():
        assert torch.equal(getattr(b, name), t), name
