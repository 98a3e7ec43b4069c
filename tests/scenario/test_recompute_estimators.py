"""Every advantage estimator end to end: `rldiag recompute RUN --estimator KEY` on a synthetic run
whose batches also carry the agentic, session, OTB, ReMax and reward-component columns; the
scenario's per-token advantages equal the per-step reference loops; `rldiag check` reports each
estimator's needs; a missing column fails the steps with a message naming it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from rldiag.cli.main import main
from rldiag.engine.advantage import ESTIMATORS
from rldiag.io.outputs import read_scenario
from rldiag.synth import SynthSpec, write_synth_run
from tests.engine import reference_estimators as ref


def _augment(run):
    """Add traj_uid / step_index / session_id / output_index / reward_baselines / sum_pi_squared /
    acc / fmt to every batch file of a synthetic run."""
    rng = np.random.default_rng(11)
    for f in sorted((run / "batches").glob("*.parquet")):
        t = pq.read_table(f)
        n = t.num_rows
        uid = t["uid"].to_pylist()
        old = pc.list_flatten(t["old_log_probs"]).to_numpy()
        pi = np.exp(old)
        spp = (pi**2 + rng.uniform(0, 1, pi.size) * (1 - pi**2)).astype(np.float32)
        offsets = t["old_log_probs"].combine_chunks().offsets
        t = (t.append_column("traj_uid", pa.array([f"{u}-t{i % 2}" for i, u in enumerate(uid)]))
              .append_column("step_index", pa.array([(i // 2) % 2 for i in range(n)], pa.int64()))
              .append_column("session_id", pa.array([f"{u}-s{(i // 2) % 2}" for i, u in enumerate(uid)]))
              .append_column("output_index", pa.array([i % 2 for i in range(n)], pa.int64()))
              .append_column("reward_baselines", pa.array(rng.uniform(0, 1, n).astype(np.float32)))
              .append_column("acc", pa.array(rng.integers(0, 2, n).astype(np.float32)))
              .append_column("fmt", pa.array(rng.integers(0, 2, n).astype(bool)))
              .append_column("sum_pi_squared", pa.ListArray.from_arrays(offsets, pa.array(spp))))
        pq.write_table(t, f)
    return run


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    return _augment(write_synth_run(tmp_path_factory.mktemp("agent") / "run", SynthSpec(steps=3, prompts=3, n=4, seed=4)))


def _step_tensors(run, step):
    t = pq.read_table(run / "batches" / f"step_{step}.parquet")
    lengths = pc.list_value_length(t["response_mask"]).to_numpy()
    width = int(lengths.max())

    def pad(col):
        out = torch.zeros(t.num_rows, width)
        for i, row in enumerate(t[col].to_pylist()):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        return out

    rewards = torch.zeros(t.num_rows, width)
    rewards[torch.arange(t.num_rows), torch.from_numpy(lengths - 1)] = torch.tensor(t["score"].to_pylist())
    return t, lengths, rewards, pad


def _ref_for(name, run, step):
    t, lengths, r, pad = _step_tensors(run, step)
    m, uids = pad("response_mask"), t["uid"].to_pylist()
    col = lambda c: t[c].to_pylist()  # noqa: E731
    if name == "grpo":
        return ref.grpo_folded(r, m, uids, col("session_id"), col("output_index"))[0]
    if name == "step_gae":
        return ref.step_gae(r, m, pad("values"), col("traj_uid"), col("step_index"), 1.0, 1.0)[0]
    if name == "token_gae_cross_step":
        return ref.token_gae_cross_step(r, m, pad("values"), col("traj_uid"), col("step_index"), 1.0, 1.0)[0]
    if name == "optimal_token_baseline":
        return ref.optimal_token_baseline(r, m, uids, pad("old_log_probs"), pad("sum_pi_squared"))[0]
    if name == "gdpo":
        comps = [torch.tensor(col("acc"), dtype=torch.float32), torch.tensor(col("fmt"), dtype=torch.float32)]
        return ref.gdpo(r, m, uids, comps, [1.0, 0.5], lengths)[0]
    if name == "remax":
        return ref.remax(r, m, torch.tensor(col("reward_baselines")))[0]
    raise KeyError(name)


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_every_estimator_recomputes_end_to_end(agent_run, name):
    argv = ["recompute", str(agent_run), "--estimator", name, "--save-tokens", "--no-progress", "--device", "cpu"]
    if name == "gdpo":
        argv += ["--set", "algorithm.gdpo_reward_keys=acc,fmt", "--set", "algorithm.gdpo_reward_weights=1,0.5"]
    assert main(argv) == 0
    # this estimator's scenario (the run is shared by the module's tests: rloo's is not rloo_vectorized's)
    ours = f"adv_estimator={name}"
    scen = next(p.name for p in (agent_run / "rldiag" / "scenarios").iterdir()
                if p.name == ours or p.name.startswith(ours + "__"))
    meta, table = read_scenario(agent_run, scen)
    assert meta["steps_done"] == [1, 2, 3] and meta["steps_failed"] == {}
    assert meta["settings"]["algorithm.adv_estimator"] == name
    assert np.isfinite(table.column("critic/advantages/mean").to_numpy()).all()
    try:
        want = _ref_for(name, agent_run, 2)
    except KeyError:
        return
    tok = pq.read_table(agent_run / "rldiag" / "scenarios" / scen / "tokens" / "step_000002.parquet")
    for i, row in enumerate(tok["advantages"].to_pylist()):
        torch.testing.assert_close(torch.tensor(row), want[i, : len(row)], rtol=1e-4, atol=1e-5)


def test_missing_columns_fail_the_steps_with_the_column_named(synth_run, capsys):
    assert main(["recompute", str(synth_run), "--estimator", "traj_grpo", "--no-progress"]) != 0
    meta, _ = read_scenario(synth_run, "adv_estimator=traj_grpo")
    assert meta["steps_done"] == [] and all("traj_uid" in m for m in meta["steps_failed"].values())
    assert "traj_uid" in capsys.readouterr().err


def test_check_lists_the_needs(synth_run, agent_run, capsys):
    assert main(["check", str(synth_run)]) in (0, 1)
    out = capsys.readouterr().out
    assert "sum_pi_squared" in out and "traj_uid" in out and "reward_baselines" in out
    main(["check", str(agent_run)])
    out = capsys.readouterr().out
    for name in ("step_gae", "tir_optimal_token_baseline", "remax"):
        line = next(ln for ln in out.splitlines() if name in ln)
        assert "ready" in line
