"""Shared fixtures: small synthetic runs and a helper to build engine batches by hand."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

# CI runs the property tests with a fixed derivation of examples (reproducible builds); locally
# each run explores new examples.
# Neither profile has a deadline or the too-slow health check: both time the examples, and a
# loaded machine would turn a correct example into a failure.
_untimed = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True, **_untimed)
hypothesis_settings.register_profile("dev", **_untimed)
hypothesis_settings.load_profile("ci" if os.environ.get("CI") else "dev")

from rldiag.config.settings import resolve_settings  # noqa: E402 - the profiles first
from rldiag.engine.batch import Batch  # noqa: E402
from rldiag.synth import SynthSpec, write_synth_run  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core: each worker's torch takes one core, not every core (two
    # workers of two threads each on two cores wait for each other at every operation; the results
    # do not depend on the thread count: tests/engine/test_thread_count.py)
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The slow tests first (a stable sort: the others keep their order): the parallel run hands
    tests out in this order, and a long test started last would run alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def rldiag_home(tmp_path, monkeypatch):
    """Each test's own rldiag directory (mirrors of read-only runs, the app's recent runs), never
    the user's ~/.cache/rldiag, nor one another test writes at the same time."""
    home = tmp_path / "rldiag-home"
    monkeypatch.setenv("RLDIAG_HOME", str(home))
    return home


def make_batch(
    scores=None,
    mask=None,
    uids=None,
    steps=None,
    lengths=None,
    **tensors,
) -> Batch:
    """A Batch from plain lists. ``mask``/``scores`` are (rows, tokens) padded lists (row i holds
    ``lengths[i]`` tokens, default the full width), packed into the engine's flat layout by
    :func:`tests.engine.packing.to_packed`; ``uids`` per row (any hashable; grouped per step);
    ``steps`` per row (run step numbers, default all 1). Other keyword lists are token columns
    when 2-D (packed the same way) and row columns when 1-D."""
    from tests.engine.packing import to_packed

    mask_t = torch.tensor(mask, dtype=torch.float32)
    rows, width = mask_t.shape
    scores_t = torch.zeros_like(mask_t) if scores is None else torch.tensor(scores, dtype=torch.float32)
    steps = steps or [1] * rows
    uids = uids or list(range(rows))
    order = sorted(set(steps), key=steps.index)
    step_ids = torch.tensor([order.index(s) for s in steps], dtype=torch.long)
    keys = list(dict.fromkeys(zip(steps, uids)))
    group_ids = torch.tensor([keys.index((s, u)) for s, u in zip(steps, uids)], dtype=torch.long)
    lengths_t = torch.tensor(lengths if lengths is not None else [width] * rows, dtype=torch.long)
    horizon = torch.tensor([int(lengths_t[step_ids == i].max()) for i in range(len(order))])
    extra = {k: torch.tensor(v, dtype=torch.float32) for k, v in tensors.items() if v is not None}
    extra = {k: to_packed(v, lengths_t)[0] if v.dim() == 2 else v for k, v in extra.items()}
    return Batch(
        response_mask=to_packed(mask_t, lengths_t)[0],
        token_level_scores=to_packed(scores_t, lengths_t)[0],
        lengths=lengths_t,
        step_ids=step_ids,
        group_ids=group_ids,
        steps=order,
        n_groups=len(keys),
        max_response_length=horizon,
        **extra,
    )


def settings(**overrides):
    """Settings from short keys: ``settings(estimator="rloo", lam=0.95)`` or full dotted keys."""
    short = {
        "estimator": "algorithm.adv_estimator",
        "gamma": "algorithm.gamma",
        "lam": "algorithm.lam",
        "norm_by_std": "algorithm.norm_adv_by_std_in_grpo",
        "agg": "actor_rollout_ref.actor.loss_agg_mode",
        "clip": "actor_rollout_ref.actor.clip_ratio",
        "clip_low": "actor_rollout_ref.actor.clip_ratio_low",
        "clip_high": "actor_rollout_ref.actor.clip_ratio_high",
        "clip_c": "actor_rollout_ref.actor.clip_ratio_c",
    }
    return resolve_settings(overrides={short.get(k, k.replace("__", ".")): v for k, v in overrides.items()})


@pytest.fixture
def synth_run(tmp_path):
    """A small synthetic run directory (5 steps x 16 rows, tool gaps, critic columns)."""
    return write_synth_run(tmp_path / "run", SynthSpec(steps=5, seed=3))
