"""The executors put everything the engine reads on ``--device``, and the engine's results come
back from it: ``--device`` resolution; ``Batch.to`` moves every tensor of a batch (extra columns
and the row layout included: a batch on CUDA with its offsets or group ids left on the CPU fails
on a GPU); a whole recompute run with torch's default device set to ``meta`` while the batches
load onto the CPU, so that a tensor made without a device anywhere on the compute path is a
meta tensor and fails its step (tests/engine/test_device_placement.py explains the check)."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from rldiag.config.settings import resolve_settings
from rldiag.engine.batch import Batch, pack
from rldiag.errors import ConfigError
from rldiag.executors.device import resolve_device
from rldiag.executors.klchain import pack_statistics, replay_statistics
from rldiag.executors.steps import Job, StepTask, compute_pack, fetch
from rldiag.io.loader import load_step, read_schema
from rldiag.io.rundir import RunDir
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run

META = torch.device("meta")
EVERYTHING = {
    "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
    "actor_rollout_ref.actor.use_kl_loss": True,
    "algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_rs": "token_k1",
    "algorithm.rollout_correction.rollout_rs_threshold": 4.0,
    "rldiag.dp_size": 2, "rldiag.mini_batch_size": 8, "rldiag.micro_batch_size": 2,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    spec = SynthSpec(steps=3, prompts=4, n=4, max_len=40, seed=5, extra_columns=True)
    return write_synth_run(tmp_path_factory.mktemp("device") / "run", spec)


# ---- --device ------------------------------------------------------------------------------


def test_resolve_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    for bad in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device(bad)


def test_resolve_device_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="sees 2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("bad", ["gpu", "cudax", "cuda:x", "meta", "mps", ""])
def test_resolve_device_refuses_other_names(bad):
    with pytest.raises(ConfigError, match="expected auto, cpu, cuda"):
        resolve_device(bad)


# ---- Batch.to ------------------------------------------------------------------------------


def _tensors(batch: Batch) -> dict[str, torch.Tensor]:
    """Every tensor a batch holds, by name."""
    out = {f.name: getattr(batch, f.name) for f in fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)}
    out.update({f"extra[{k}]": v for k, v in batch.extra.items()})
    out.update({"rows.offsets": batch.rows.offsets, "rows.row_ids": batch.rows.row_ids})
    return out


def test_batch_to_moves_every_tensor(run):
    settings = resolve_settings(run, {"data.max_prompt_length": 64})
    every_column = read_schema(RunDir(run).require_steps()[0]).names
    batch = pack([load_step(sf, settings, columns=every_column).batch for sf in RunDir(run).require_steps()])
    held = _tensors(batch)
    # every optional column is there, so the check covers them
    assert {"values", "vpreds", "entropy", "rollout_log_probs", "prompt_length", "max_prompt_length",
            "reward_baselines", "extra[traj_uid]", "extra[sum_pi_squared]", "extra[acc]"} <= set(held)
    batch.rows.amax(batch.response_mask)  # the layout's cached chunk plan is built on the CPU first
    moved = batch.to(META)
    on = {name: t.device for name, t in _tensors(moved).items()}
    assert set(on) == set(held)
    assert {name: d for name, d in on.items() if d != META} == {}
    assert moved.device == moved.rows.device == META
    assert "_chunk_plan" in vars(batch.rows) and "_chunk_plan" not in vars(moved.rows)  # no CPU plan carried over


# ---- the compute path on the meta default ----------------------------------------------------


def test_compute_pack_and_kl_statistics_under_the_meta_default(run):
    settings = resolve_settings(run, EVERYTHING)
    job = Job(settings=settings, device="cpu", save_tokens=True)
    tasks = [StepTask(sf.step, str(sf.path), sf.path.name, chunk=0) for sf in RunDir(run).require_steps()]
    with torch.device(META):
        fetched = [fetch(t, job, hash_file=False) for t in tasks]
        assert all(f.error is None for f in fetched)
        stats = pack_statistics(fetched, job)
        replayed = replay_statistics(tasks[:1], job)
        outcomes = compute_pack(fetched, job, None)
    assert [s for s, _, _ in stats] == [[1, 2, 3]]
    assert [s for s, _, _ in replayed] == [[1]]
    assert all(t.device.type == "cpu" for _, kl, rows in replayed for t in (kl, rows))
    assert {o.step: (o.status, o.error) for o in outcomes} == {s: ("done", None) for s in (1, 2, 3)}
    assert all(o.tokens is not None and o.tokens.num_rows == o.rows for o in outcomes)


def test_recompute_under_the_meta_default(run):
    """The local executor end to end (the KL controller replayed over step 1, the read-ahead on
    its own thread), the scenario written."""
    with torch.device(META):
        report = recompute(run, EVERYTHING, name="meta", steps="2:", device="cpu", save_tokens=True, reuse=False)
    assert report.steps_failed == {}
    assert report.steps_done == [2, 3]
