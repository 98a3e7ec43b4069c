"""What runs without Ray: the unit of work every executor shares (packs never span chunks), the
two-pass adaptive KL protocol of a distributed executor (the same bits as the sequential
controller), and clear errors for a missing Ray or an unreachable cluster."""

from __future__ import annotations

import sys

import pyarrow.parquet as pq
import pytest

from rldiag.config.settings import resolve_settings
from rldiag.engine.pipeline import PresetKLCoefficients, initial_kl_state
from rldiag.errors import ConfigError, ExecutorError
from rldiag.executors import get_executor
from rldiag.executors.klchain import chain, pack_statistics
from rldiag.executors.ray_cluster import probe_address
from rldiag.executors.steps import Job, StepTask, fetch, process
from rldiag.io.rundir import RunDir
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run
from tests.kl_runs import KL, KL_LIVE, poison


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=6, seed=3))


def _metrics(run, name):
    return pq.read_table(run / "rldiag" / "scenarios" / name / "metrics.parquet")


def test_chunks_bound_packs(run):
    # chunks of one step make one pack per step, whatever the token budget
    recompute(run, name="chunk1", chunk_steps=1)
    recompute(run, name="pack1", pack_tokens=1)
    assert _metrics(run, "chunk1").equals(_metrics(run, "pack1"))
    assert _metrics(run, "chunk1").num_rows == 6


def test_two_pass_adaptive_kl_matches_sequential(run):
    settings = resolve_settings(run, KL)
    job = Job(settings=settings, device="cpu", save_tokens=False)
    rd = RunDir(run)
    tasks = [StepTask(step=sf.step, file=str(sf.path), rel=str(sf.path.relative_to(rd.path)), chunk=i // 2)
             for i, sf in enumerate(rd.step_files())]
    # pass 1: each pack's statistic (chunks 0..2 computed in any order), then the chain in step order
    stats = {}
    for c in (2, 0, 1):
        stats[c] = pack_statistics([fetch(t, job, hash_file=False) for t in tasks if t.chunk == c], job)
    coefs = chain(initial_kl_state(settings), settings, [s for c in (0, 1, 2) for s in stats[c]])
    assert sorted(coefs) == [1, 2, 3, 4, 5, 6]
    assert coefs[1] == pytest.approx(0.05, rel=1e-6) and coefs[6] != pytest.approx(0.05, rel=1e-3)
    # pass 2: every pack with its preset coefficients
    outs = list(process((fetch(t, job) for t in tasks), job,
                        lambda steps: PresetKLCoefficients([coefs[s] for s in steps])))
    sequential = {r["step"]: r for r in recompute(run, KL, name="kl", chunk_steps=2).metrics}
    assert [o.step for o in outs] == [1, 2, 3, 4, 5, 6]
    for o in outs:
        assert o.status == "done"
        assert o.metrics == sequential[o.step]
        assert o.metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(coefs[o.step], rel=1e-6)


def test_first_pass_counts_a_failed_step_whose_statistic_reads_like_local(run):
    """Ray's first pass and the local executor agree on the steps that advance the controller:
    step 3 fails (a NaN in log_probs) but its reward-KL statistic reads; step 5's does not (a NaN
    in ref_log_prob). Same packs, so the same bits."""
    poison(run, 3, "log_probs")
    poison(run, 5, "ref_log_prob")
    settings = resolve_settings(run, KL_LIVE)
    job = Job(settings=settings, device="cpu", save_tokens=False)
    rd = RunDir(run)
    tasks = [StepTask(step=sf.step, file=str(sf.path), rel=str(sf.path.relative_to(rd.path)), chunk=i // 2)
             for i, sf in enumerate(rd.step_files())]
    stats = pack_statistics([fetch(t, job, hash_file=False) for t in tasks], job)
    assert [steps for steps, _, _ in stats] == [[1, 2], [3], [4], [6]]
    coefs = chain(initial_kl_state(settings), settings, stats)
    local = recompute(run, KL_LIVE, name="kl", chunk_steps=2)
    assert sorted(local.steps_failed) == [3, 5]
    assert {r["step"]: r["actor/reward_kl_penalty_coeff"] for r in local.metrics} == {
        s: coefs[s] for s in (1, 2, 4, 6)}
    assert coefs[4] != pytest.approx(coefs[3], rel=1e-3)  # step 3 moved the coefficient


def test_unknown_executor_is_a_config_error():
    with pytest.raises(ConfigError, match="local, ray"):
        get_executor("spark")


def test_missing_ray_is_a_clear_error(run, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"rldiag\[ray\]"):
        recompute(run, name="r", executor="ray")
    assert not (run / "rldiag" / "scenarios" / "r").exists()


def test_unreachable_ray_address_fails_with_the_address():
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ExecutorError, match=f"127.0.0.1:{port}"):
        probe_address(f"ray://127.0.0.1:{port}")
    probe_address("auto")  # nothing to probe: Ray finds or starts a local cluster
