"""``--executor ray`` writes the same scenario as the local executor, on a 2-CPU local Ray started
once for the module: identical metrics.parquet, tokens files and scenario.json (but for timing,
device and executor), with adaptive KL chained across steps, a --steps subset, a failed step,
reuse, and a run in object storage."""

from __future__ import annotations

import importlib.util
import shutil
from contextlib import ExitStack

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'rldiag[ray]')")

from rldiag.cli.main import main  # noqa: E402
from rldiag.config.settings import resolve_settings  # noqa: E402
from rldiag.errors import ConfigError, ExecutorError, StorageError  # noqa: E402
from rldiag.executors import Plan  # noqa: E402
from rldiag.executors.ray_cluster import RayExecutor, task_options  # noqa: E402
from rldiag.executors.steps import Job, StepTask  # noqa: E402
from rldiag.io.outputs import read_scenario  # noqa: E402
from rldiag.scenario.recompute import recompute  # noqa: E402
from rldiag.synth import SynthSpec, write_synth_run  # noqa: E402
from tests.kl_runs import KL, KL_LIVE, poison, rejected_after_capture  # noqa: E402
from tests.scenario_utils import assert_same_scenario  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # runs a subprocess / a cluster: `make test-fast` leaves it out
    pytest.mark.xdist_group("ray"),  # one test process starts the module's cluster (`make test` runs in parallel)
]



@pytest.fixture(scope="module")
def cluster():
    """A 2-CPU local Ray; a local S3 server first when moto is installed, so that the workers
    inherit its environment. Yields the S3 server or None."""
    with ExitStack() as stack:
        s3 = None
        if importlib.util.find_spec("moto") is not None:
            from tests.s3server import moto_s3

            s3 = stack.enter_context(moto_s3(bucket="rldiag-ray"))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield s3
        finally:
            ray.shutdown()


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=6, seed=3))


def _pair(run, overrides=None, **kw):
    """The same recompute with both executors into two scenarios of the same run (each computed:
    the second would otherwise reuse the first's steps, its resolved settings being the same)."""
    local = recompute(run, overrides, name="local", reuse=False, **kw)
    dist = recompute(run, overrides, name="ray", executor="ray", reuse=False, **kw)
    scen = run / "rldiag" / "scenarios"
    meta = assert_same_scenario(scen / "local", scen / "ray")
    assert (local.executor, dist.executor, dist.device) == ("local", "ray", "cpu")
    assert read_scenario(run, "ray")[0]["executor"] == "ray"
    return local, dist, meta


def test_same_scenario_as_local(cluster, run):
    local, dist, meta = _pair(run, save_tokens=True, chunk_steps=2)
    assert dist.steps_done == [1, 2, 3, 4, 5, 6] and dist.rows == local.rows == 96
    assert dist.tokens == local.tokens > 0
    assert len(meta["inputs"]) == 6 and all(len(i["sha256"]) == 64 for i in meta["inputs"])
    table = pq.read_table(run / "rldiag" / "scenarios" / "ray" / "metrics.parquet")
    assert table["step"].to_pylist() == [1, 2, 3, 4, 5, 6]
    assert np.isfinite(table["critic/advantages/mean"].to_numpy()).all()
    # one chunk per task or one for the whole run: the same numbers (computed again, not reused
    # from the scenarios above, whose resolved settings are the same)
    recompute(run, name="ray_one_chunk", executor="ray", save_tokens=True, reuse=False)
    recompute(run, name="local_one_chunk", save_tokens=True, reuse=False)
    scen = run / "rldiag" / "scenarios"
    assert_same_scenario(scen / "local_one_chunk", scen / "ray_one_chunk")


def test_adaptive_kl_is_chained_in_step_order(cluster, run):
    _, dist, _ = _pair(run, KL, chunk_steps=2)
    rows = sorted(dist.metrics, key=lambda r: r["step"])
    beta = 0.05
    for r in rows:  # verl's adaptive update, 16 rows per step
        assert r["actor/reward_kl_penalty_coeff"] == pytest.approx(beta, rel=1e-6)
        err = float(np.clip(r["actor/reward_kl_penalty"] / 0.001 - 1, -0.2, 0.2))
        beta *= 1 + err * 16 / 100
    assert rows[-1]["actor/reward_kl_penalty_coeff"] < 0.05 * 0.99


def test_adaptive_kl_with_a_subset_replays_earlier_steps(cluster, run):
    _, dist, meta = _pair(run, KL, steps="4:", chunk_steps=1)
    assert meta["steps_done"] == [4, 5, 6]
    full = {r["step"]: r for r in recompute(run, KL, name="full").metrics}
    for r in dist.metrics:
        assert r["actor/reward_kl_penalty_coeff"] == pytest.approx(full[r["step"]]["actor/reward_kl_penalty_coeff"], rel=1e-6)
    assert dist.metrics[0]["actor/reward_kl_penalty_coeff"] != pytest.approx(0.05, rel=1e-4)


def test_adaptive_kl_subset_replays_the_statistic_verl_reads(cluster, tmp_path):
    """Bypass mode on batches captured after rejection, steps left out before and between the
    chosen ones, one of them failed by its log_probs: the replay reads the rollout's log-probs on
    loss_mask and counts every left-out step, in step order, as the full recompute does."""
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=6, seed=3))
    rejected_after_capture(run)
    poison(run, 3, "log_probs")
    over = {**KL_LIVE, "algorithm.rollout_correction.bypass_mode": True}
    _, dist, meta = _pair(run, over, steps="2,5:", chunk_steps=2)
    assert meta["steps_done"] == [2, 5, 6]
    full = {r["step"]: r for r in recompute(run, over, name="full", chunk_steps=2).metrics}
    assert sorted(full) == [1, 2, 4, 5, 6]
    by = {r["step"]: r for r in dist.metrics}
    assert by[2]["actor/reward_kl_penalty_coeff"] == full[2]["actor/reward_kl_penalty_coeff"]
    for s in (5, 6):
        assert by[s]["actor/reward_kl_penalty_coeff"] == pytest.approx(full[s]["actor/reward_kl_penalty_coeff"], rel=1e-6)


def test_failed_step_is_reported_the_same_way(cluster, run):
    p = run / "batches" / "step_3.parquet"
    t = pq.read_table(p)
    col = t["old_log_probs"].to_pylist()
    col[5][0] = float("nan")
    pq.write_table(t.set_column(t.schema.get_field_index("old_log_probs"), "old_log_probs",
                                pa.array(col, t.schema.field("old_log_probs").type)), p)
    local, dist, meta = _pair(run, KL, chunk_steps=2, save_tokens=True)
    assert sorted(dist.steps_failed) == [3] and dist.steps_failed == local.steps_failed
    assert "row 5" in dist.steps_failed[3] and "non-finite" in dist.steps_failed[3]
    assert meta["steps_done"] == [1, 2, 4, 5, 6]
    # the controller skips the unreadable step: step 4 uses the coefficient step 2 left
    by = {r["step"]: r for r in dist.metrics}
    beta = by[2]["actor/reward_kl_penalty_coeff"]
    err = float(np.clip(by[2]["actor/reward_kl_penalty"] / 0.001 - 1, -0.2, 0.2))
    assert by[4]["actor/reward_kl_penalty_coeff"] == pytest.approx(beta * (1 + err * 16 / 100), rel=1e-6)


def test_reuse_with_ray(cluster, run):
    first = recompute(run, name="s", executor="ray", save_tokens=True, chunk_steps=2)
    again = recompute(run, name="s", executor="ray", save_tokens=True, chunk_steps=2)
    assert first.steps_reused == [] and again.steps_reused == [1, 2, 3, 4, 5, 6] and again.tokens == 0
    assert {r["step"]: r for r in again.metrics} == {r["step"]: r for r in first.metrics}
    shutil.copy(run / "batches" / "step_1.parquet", run / "batches" / "step_2.parquet")  # step 2 changes
    third = recompute(run, name="s", executor="ray", save_tokens=True, chunk_steps=2)
    assert third.steps_reused == [1, 3, 4, 5, 6]
    assert third.steps_failed[2].startswith("BatchError") and "file name says 2" in third.steps_failed[2]


def test_cuda_on_a_cluster_without_gpus_is_a_config_error(cluster, run):
    with pytest.raises(ConfigError, match="no GPU"):
        recompute(run, name="g", executor="ray", device="cuda")
    ex = RayExecutor(gpus_per_task=0.5)
    assert ex.start("auto") == "cpu" and ex.task_options() == {"num_cpus": 1.0, "num_gpus": 0}
    # what start() picks on a cluster with GPUs
    assert task_options("cuda", 1.0, 0.5) == {"num_cpus": 1.0, "num_gpus": 0.5}


def test_task_errors_reach_the_driver(cluster, run):
    ex = RayExecutor()
    assert ex.start("cpu") == "cpu"
    job = Job(settings=resolve_settings(run), device="cpu", save_tokens=False)
    gone = Plan(job, [StepTask(step=1, file=str(run / "batches" / "step_99.parquet"), rel="batches/step_99.parquet", chunk=0)])
    with pytest.raises(ExecutorError, match=r"steps 1\.\.1: a Ray task failed"):
        list(ex.run(gone))
    # an RldiagError raised in a worker arrives as itself
    bad = Plan(job, [StepTask(step=2, file="nosuchscheme://bucket/step_2.parquet", rel="batches/step_2.parquet", chunk=0)])
    with pytest.raises(StorageError, match="nosuchscheme://bucket"):
        list(ex.run(bad))
    ex.close()
    assert ray.is_initialized()  # not started by this executor: left running


def test_cli_executor_ray(cluster, run, capsys):
    assert main(["recompute", str(run), "--executor", "ray", "--name", "cli", "--no-progress"]) == 0
    assert "via ray" in capsys.readouterr().out
    meta, table = read_scenario(run, "cli")
    assert meta["executor"] == "ray" and table.num_rows == 6
    assert ray.is_initialized()  # a Ray the caller started is left running


def test_ray_reads_and_writes_object_storage(cluster, run):
    if cluster is None:
        pytest.skip("moto[server] is not installed (pip install 'rldiag[dev]')")
    uri = cluster.upload_dir(run, "runs/ray")
    dist = recompute(uri, KL, name="kl", executor="ray", save_tokens=True, chunk_steps=2)
    local = recompute(run, KL, name="kl", save_tokens=True, chunk_steps=2)
    assert dist.steps_done == local.steps_done == [1, 2, 3, 4, 5, 6]
    meta, table = read_scenario(uri, "kl")
    assert table.equals(pq.read_table(run / "rldiag" / "scenarios" / "kl" / "metrics.parquet"))
    assert [i["sha256"] for i in meta["inputs"]] == [i["sha256"] for i in read_scenario(run, "kl")[0]["inputs"]]
    assert cluster.keys("runs/ray/rldiag/scenarios/kl/tokens") == [
        f"runs/ray/rldiag/scenarios/kl/tokens/step_{s:06d}.parquet" for s in range(1, 7)]


def test_sweep_on_ray_writes_what_the_local_sweep_writes(cluster, run, tmp_path):
    """``rldiag sweep --executor ray``: each scenario recomputed on its own on the cluster, the
    same scenarios as the local sweep (which shares reads and stages)."""
    from polars.testing import assert_frame_equal

    from rldiag.scenario.sweep import sweep
    from tests.scenario.test_sweep import assert_metrics_close

    grid = {"actor_rollout_ref.actor.clip_ratio": [0.1, 0.2]}
    local = sweep(run, grid, estimators=["grpo", "rloo"], save_tokens=True, reuse=False, name="s")
    scen = run / "rldiag" / "scenarios"
    for name in local.scenarios:
        shutil.copytree(scen / name, tmp_path / name)
    dist = sweep(run, grid, estimators=["grpo", "rloo"], save_tokens=True, reuse=False, executor="ray", name="s")
    assert dist.scenarios == local.scenarios and dist.executor == "ray" and dist.notes
    for name in local.scenarios:
        assert_metrics_close(scen / name / "metrics.parquet", tmp_path / name / "metrics.parquet")
        for f in (tmp_path / name / "tokens").iterdir():
            assert pq.read_table(f).equals(pq.read_table(scen / name / "tokens" / f.name)), (name, f.name)
    assert_frame_equal(dist.summary_frame(), local.summary_frame())
