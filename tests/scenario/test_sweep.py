"""``rldiag sweep`` (rldiag/scenario/sweep.py, rldiag/executors/sweep.py): every scenario written
as a separate recompute writes it, from one read of each step file, with the engine's shared
stages run once; reuse, names, the summary, the disk check, failures of one scenario."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rldiag
from rldiag.errors import ConfigError, DiskSpaceError
from rldiag.executors.sweep import SweepHooks, open_content
from rldiag.io.outputs import TOKEN_OUTPUTS
from rldiag.io.run_layout import RunLayout
from rldiag.io.rundir import RunDir
from rldiag.scenario.recompute import recompute
from rldiag.scenario.sweep import estimate_token_bytes, sweep, sweep_name, yaml_text
from rldiag.synth import SynthSpec, write_synth_run

A = "actor_rollout_ref.actor."
RC = "algorithm.rollout_correction."
CLIP = A + "clip_ratio"


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=3, prompts=3, n=4, min_len=6, max_len=20, seed=11))


def scenario_dir(run: Path, name: str) -> Path:
    return RunLayout(run).scenario(name).dir


def assert_metrics_close(a: Path, b: Path) -> None:
    """Two metrics.parquet files: the same columns and steps, values within rtol 1e-6, atol 1e-7
    (NaN equal to NaN, null to null)."""
    ta, tb = pq.read_table(a), pq.read_table(b)
    assert ta.column_names == tb.column_names
    assert ta["step"].to_pylist() == tb["step"].to_pylist()
    for name in ta.column_names:
        x, y = ta[name].to_pylist(), tb[name].to_pylist()
        assert [v is None for v in x] == [v is None for v in y], name
        xs = np.array([np.nan if v is None else v for v in x], dtype=float)
        ys = np.array([np.nan if v is None else v for v in y], dtype=float)
        np.testing.assert_allclose(xs, ys, rtol=1e-6, atol=1e-7, equal_nan=True, err_msg=name)


class Reads:
    """The sweep's reader seam: counts the reads of each step file (from any thread), and keeps
    the files it opened (as the default reader does, a local file is opened, not read whole)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.count: dict[str, int] = {}
        self.opened: list = []

    def __call__(self, path):
        with self.lock:
            self.count[Path(str(path)).name] = self.count.get(Path(str(path)).name, 0) + 1
            f = open_content(path)
            self.opened.append(f)
        return f


# -- (b) every scenario is its own recompute -------------------------------------------------------

#: keys and values the random grids draw from (with rollout_is, a threshold is set for all)
CHOICES = {
    CLIP: [0.1, 0.2, 0.28],
    "algorithm.adv_estimator": ["grpo", "rloo", "reinforce_plus_plus", "gae", "grpo_passk"],
    A + "loss_agg_mode": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
    "critic.loss_agg_mode": [None, "token-mean"],
    RC + "rollout_is": [None, "token", "sequence"],
    A + "policy_loss.loss_mode": ["vanilla", "gspo", "clip_cov"],
    "algorithm.kl_ctrl.type": ["fixed", "adaptive"],
    "algorithm.norm_adv_by_std_in_grpo": [True, False],
}
FIXED = {RC + "rollout_is_threshold": 2.0, "algorithm.use_kl_in_reward": True, "critic.enable": True}


@st.composite
def grids(draw):
    keys = draw(st.lists(st.sampled_from(sorted(CHOICES)), min_size=1, max_size=3, unique=True))
    grid = {k: draw(st.lists(st.sampled_from(CHOICES[k]), min_size=1, max_size=3, unique=True)) for k in keys}
    steps = draw(st.sampled_from([None, "2:", "1,3"]))
    return grid, steps


@pytest.fixture(scope="module")
def prop_run(tmp_path_factory):
    return write_synth_run(tmp_path_factory.mktemp("sweep-prop") / "run",
                           SynthSpec(steps=3, prompts=2, n=4, min_len=4, max_len=14, seed=2))


@settings(max_examples=15, derandomize=True, deadline=None)
@given(grids())
def test_every_scenario_equals_its_own_recompute(prop_run, drawn):
    grid, steps = drawn
    rep = sweep(prop_run, grid, FIXED, steps=steps, reuse=False, name="prop")
    assert len(rep.scenarios) == int(np.prod([len(v) for v in grid.values()]))
    for name, overrides in rep.scenarios.items():
        assert overrides == {**FIXED, **{k: overrides[k] for k in grid}}
        ref = recompute(prop_run, overrides, name="reference", steps=steps, reuse=False)
        assert rep.steps_done[name] == ref.steps_done and rep.steps_failed[name] == ref.steps_failed
        assert_metrics_close(scenario_dir(prop_run, name) / "metrics.parquet",
                             scenario_dir(prop_run, "reference") / "metrics.parquet")
        meta = json.loads((scenario_dir(prop_run, name) / "scenario.json").read_text())
        want = json.loads((scenario_dir(prop_run, "reference") / "scenario.json").read_text())
        assert meta["settings"] == want["settings"] and meta["overrides"] == want["overrides"]
        assert [{k: v for k, v in i.items() if k != "hashed_ns"} for i in meta["inputs"]] == [
            {k: v for k, v in i.items() if k != "hashed_ns"} for i in want["inputs"]]


def test_tokens_equal_a_recompute_with_tokens(run):
    rep = sweep(run, {CLIP: [0.1, 0.3]}, estimators=["grpo", "rloo"], save_tokens=True)
    for name, overrides in rep.scenarios.items():
        recompute(run, overrides, name="ref", save_tokens=True)
        files = sorted(p.name for p in (scenario_dir(run, name) / "tokens").iterdir())
        assert files == sorted(p.name for p in (scenario_dir(run, "ref") / "tokens").iterdir()) and len(files) == 3
        for f in files:
            assert pq.read_table(scenario_dir(run, name) / "tokens" / f).equals(
                pq.read_table(scenario_dir(run, "ref") / "tokens" / f)), (name, f)
        rows = sorted(p.name for p in RunLayout(run).scenario(name).rows_dir.iterdir())
        assert rows == sorted(p.name for p in RunLayout(run).scenario("ref").rows_dir.iterdir()) and len(rows) == 3
        for f in rows:
            got = pq.read_table(RunLayout(run).scenario(name).rows_dir / f)
            want = pq.read_table(RunLayout(run).scenario("ref").rows_dir / f)
            assert got.column_names == want.column_names, (name, f)
            for col in want.column_names:
                x, y = got[col].to_pylist(), want[col].to_pylist()
                assert all(a == b or (a != a and b != b) for a, b in zip(x, y)) and len(x) == len(y), (name, f, col)


# -- (c) read once, (d) shared stages --------------------------------------------------------------


def test_each_step_file_is_read_once_for_eight_scenarios(run):
    reads = Reads()
    rep = sweep(run, {CLIP: [0.1, 0.2, 0.3, 0.4]}, estimators=["grpo", "rloo"], hooks=SweepHooks(read=reads))
    assert len(rep.scenarios) == 8 and rep.ok
    assert reads.count == {sf.path.name: 1 for sf in RunDir(run).step_files()}
    assert reads.opened and all(f.closed for f in reads.opened)  # opened, parsed, hashed in pieces, closed
    again = Reads()  # unchanged files, hashes known from the records: nothing to read at all
    rep = sweep(run, {CLIP: [0.1, 0.2, 0.3, 0.4]}, estimators=["grpo", "rloo"], hooks=SweepHooks(read=again))
    assert again.count == {} and all(r == [1, 2, 3] for r in rep.steps_reused.values())


def test_the_fetcher_reads_once_for_every_scenario_and_the_row_tables(run):
    from rldiag.config.settings import resolve_settings
    from rldiag.executors.steps import Job, StepTask
    from rldiag.executors.sweep import fetch_many

    sf = RunDir(run).require_steps()[0]
    jobs = [Job(resolve_settings(run, {"algorithm.adv_estimator": e}), "cpu", False) for e in ("grpo", "rloo", "remax")]
    task = StepTask(step=sf.step, file=str(sf.path), rel=sf.path.name, chunk=0)
    reads = Reads()
    got = fetch_many([task] * 3, jobs, read=reads)
    assert reads.count == {sf.path.name: 1}
    assert got[0].data is got[1].data is not None and got[2].data is None and "reward_baselines" in str(got[2].error)
    assert isinstance(got[0].row_columns, pa.Table) and got[0].row_columns is got[1].row_columns
    assert got[0].record()["sha256"] == got[2].record()["sha256"] == hashlib.sha256(sf.path.read_bytes()).hexdigest()
    assert got[0].record()["size"] == sf.path.stat().st_size and reads.opened[0].closed


def test_scenarios_loading_other_columns_still_read_each_file_once(tmp_path):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, prompts=2, n=4, max_len=12, seed=4, extra_columns=True))
    reads = Reads()
    rep = sweep(run, None, estimators=["grpo", "remax", "gdpo"], overrides={"algorithm.gdpo_reward_keys": "acc,fmt"},
                hooks=SweepHooks(read=reads))
    assert rep.ok and set(reads.count.values()) == {1}
    for name, overrides in rep.scenarios.items():
        recompute(run, overrides, name="ref")
        assert_metrics_close(scenario_dir(run, name) / "metrics.parquet", scenario_dir(run, "ref") / "metrics.parquet")


def test_a_clip_ratio_grid_runs_the_advantages_once_per_step(run):
    runs: dict[str, list[list[int]]] = {}
    hooks = SweepHooks(on_stage=lambda stage, who: runs.setdefault(stage, []).append(who))
    rep = sweep(run, {CLIP: [0.1, 0.2, 0.3, 0.4]}, pack_tokens=1, hooks=hooks)  # one step a pack
    assert rep.ok and len(rep.scenarios) == 4
    for stage in ("advantages", "data_metrics", "ref_kl", "rollout_correction", "critic"):
        assert runs[stage] == [[0, 1, 2, 3]] * 3, stage
    assert sorted(map(tuple, runs["actor_loss"])) == sorted([(i,) for i in range(4)] * 3)


# -- (e) reuse ---------------------------------------------------------------------------------


def test_a_second_sweep_reuses_every_step_and_a_changed_file_only_its_step(run):
    grid = {CLIP: [0.1, 0.2]}
    first = sweep(run, grid, estimators=["grpo", "rloo"])
    assert all(r == [] for r in first.steps_reused.values())
    second = sweep(run, grid, estimators=["grpo", "rloo"])
    assert all(r == [1, 2, 3] for r in second.steps_reused.values())
    f = next(sf.path for sf in RunDir(run).step_files() if sf.step == 2)
    table = pq.read_table(f)
    scores = table["score"].to_pylist()
    scores[0] = scores[0] + 1.0
    pq.write_table(table.set_column(table.column_names.index("score"), "score", pa.array(scores, pa.float32())), f)
    third = sweep(run, grid, estimators=["grpo", "rloo"])
    assert all(r == [1, 3] for r in third.steps_reused.values()) and third.ok
    for name, overrides in third.scenarios.items():
        recompute(run, overrides, name="ref", reuse=False)
        assert_metrics_close(scenario_dir(run, name) / "metrics.parquet", scenario_dir(run, "ref") / "metrics.parquet")
    fourth = sweep(run, grid, estimators=["grpo", "rloo"], reuse=False)
    assert all(r == [] for r in fourth.steps_reused.values())


# -- (f) names, (g) the summary ----------------------------------------------------------------------


def test_keys_sharing_their_last_part_are_named_in_full(run):
    rep = sweep(run, {A + "loss_agg_mode": ["token-mean", "seq-mean-token-sum"],
                      "critic.loss_agg_mode": ["token-mean", "seq-mean-token-mean"]})
    assert sorted(rep.scenarios) == sorted(
        f"actor_rollout_ref.actor.loss_agg_mode={a}__critic.loss_agg_mode={c}"
        for a in ("token-mean", "seq-mean-token-sum") for c in ("token-mean", "seq-mean-token-mean"))
    assert all(scenario_dir(run, n).is_dir() for n in rep.scenarios)


def test_the_default_name_is_the_sorted_grids_hash(run):
    import hashlib

    grid = {CLIP: [0.2, 0.1], "algorithm.adv_estimator": ["grpo", "rloo"]}
    text = json.dumps([["actor_rollout_ref.actor.clip_ratio", [0.2, 0.1]], ["algorithm.adv_estimator", ["grpo", "rloo"]]])
    assert sweep_name(grid) == "sweep-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    assert sweep_name(dict(reversed(grid.items()))) == sweep_name(grid)
    rep = sweep(run, {CLIP: [0.2, 0.1]}, estimators=["grpo", "rloo"])
    assert rep.name == sweep_name(grid) and rep.path == RunLayout(run).sweep(rep.name).dir


def test_the_summary_is_every_scenarios_metrics_long(run):
    rep = sweep(run, {CLIP: [0.1, 0.2], RC + "rollout_is": [None, "token"]}, {RC + "rollout_is_threshold": 2.0},
                name="s")
    layout = RunLayout(run).sweep("s")
    table = pq.read_table(layout.summary)
    assert table.schema == pa.schema([("scenario", pa.string()), ("step", pa.int64()), ("metric", pa.string()),
                                      ("value", pa.float64()), (CLIP, pa.string()), (RC + "rollout_is", pa.string())])
    rows = table.to_pylist()
    assert {r["scenario"] for r in rows} == set(rep.scenarios)
    for name, overrides in rep.scenarios.items():
        mine = [r for r in rows if r["scenario"] == name]
        assert {(r[CLIP], r[RC + "rollout_is"]) for r in mine} == {(yaml_text(overrides[CLIP]),
                                                                  yaml_text(overrides[RC + "rollout_is"]))}
        metrics = pq.read_table(scenario_dir(run, name) / "metrics.parquet").to_pylist()
        want = {(m["step"], k): v for m in metrics for k, v in m.items() if k != "step" and v is not None}
        got = {(r["step"], r["metric"]): r["value"] for r in mine}
        assert got.keys() == want.keys()
        assert all(got[k] == want[k] or (got[k] != got[k] and want[k] != want[k]) for k in want)
    assert {r[RC + "rollout_is"] for r in rows} == {"null", "token"} and {r[CLIP] for r in rows} == {"0.1", "0.2"}
    meta = json.loads(layout.meta.read_text())
    assert meta["grid"] == {CLIP: [0.1, 0.2], RC + "rollout_is": [None, "token"]}
    assert meta["overrides"] == {RC + "rollout_is_threshold": 2.0} and meta["steps"] == [1, 2, 3]
    assert meta["scenarios"] == json.loads(json.dumps(rep.scenarios)) and "created" in meta
    assert rep.summary_frame().height == table.num_rows
    frame = rep.table_frame(["actor/pg_loss"])
    assert frame.columns == ["scenario", CLIP, RC + "rollout_is", "actor/pg_loss"] and frame.height == 4


def test_yaml_text():
    assert [yaml_text(v) for v in (0.1, None, True, "grpo", 3, "a b")] == ["0.1", "null", "true", "grpo", "3", "a b"]


# -- (h) the disk check ---------------------------------------------------------------------------


def test_save_tokens_refuses_what_would_not_fit(run):
    with pytest.raises(DiskSpaceError, match=r"about [0-9.]+ MiB of token tables .* more than the 0.0 MiB free"):
        sweep(run, {CLIP: [0.1, 0.2]}, save_tokens=True, disk_usage=lambda path: SimpleNamespace(free=1000))
    assert not RunLayout(run).scenarios_dir.exists() and not RunLayout(run).sweeps_dir.exists()
    rep = sweep(run, {CLIP: [0.1, 0.2]}, save_tokens=True, disk_usage=lambda path: SimpleNamespace(free=2**40))
    assert rep.ok
    tokens = sum(len(m) for m in pq.read_table(RunLayout(run).scenario(next(iter(rep.scenarios))).tokens_file(1))
                 ["response_mask"].to_pylist())
    assert estimate_token_bytes([tokens], 2) == tokens * len(TOKEN_OUTPUTS) * 4 * 2


# -- failures, errors ------------------------------------------------------------------------------


def test_a_failed_step_of_one_scenario_leaves_the_others(run):
    # remax needs reward_baselines, which this run lacks: its steps fail, grpo's are written
    rep = sweep(run, None, estimators=["grpo", "remax"])
    assert not rep.ok
    assert rep.steps_done["adv_estimator=grpo"] == [1, 2, 3] and rep.steps_failed["adv_estimator=grpo"] == {}
    assert sorted(rep.steps_failed["adv_estimator=remax"]) == [1, 2, 3]
    ref = recompute(run, {"algorithm.adv_estimator": "remax"}, name="ref")
    assert rep.steps_failed["adv_estimator=remax"] == ref.steps_failed


@pytest.mark.parametrize("grid, estimators, overrides, match", [
    (None, None, None, "nothing to sweep"),
    ({CLIP: []}, None, None, "no values"),
    ({CLIP: [0.1, 0.1]}, None, None, "given twice"),
    ({"algorithm.adv_estimator": ["grpo"]}, ["rloo"], None, "give one of them"),
    ({CLIP: [0.1]}, None, {CLIP: 0.2}, "swept .* and fixed"),
    ({"actor_rollout_ref.actor.clip_ratioo": [0.1]}, None, None, "unknown setting"),
    ({CLIP: [-1.0]}, None, None, "clip_ratio"),
    ({CLIP: 0.1}, None, None, "expected a list"),
])
def test_a_wrong_grid_is_a_config_error(run, grid, estimators, overrides, match):
    with pytest.raises(ConfigError, match=match):
        sweep(run, grid, overrides, estimators=estimators)


def test_a_name_is_one_path_component_and_not_the_layout_audits(run):
    for name, match in (("a/b", "one path component"), (".x", "not hidden"), ("layout-audit", "layout-audit's")):
        with pytest.raises(ConfigError, match=match):
            sweep(run, {CLIP: [0.1, 0.2]}, name=name)


# -- the API and (i) the command line --------------------------------------------------------------


def test_the_api(run):
    calls = []
    res = rldiag.sweep(run, {CLIP: [0.1, 0.2]}, estimators=["grpo", "rloo"], progress=lambda *a: calls.append(a))
    assert isinstance(res, rldiag.SweepResult) and res.ok and len(res.scenarios) == 4
    assert calls[-1][:2] == (12, 12) and calls[-1][2].startswith("step ")
    d = res.to_dict()
    assert set(d["scenarios"]) == set(res.scenarios) and d["grid"] == {CLIP: [0.1, 0.2],
                                                                          "algorithm.adv_estimator": ["grpo", "rloo"]}


def test_cli_json(run, capsys):
    from rldiag.cli.main import main

    code = main(["sweep", str(run), "--estimators", "grpo,rloo", "--grid", f"{CLIP}=0.1,0.2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["name"].startswith("sweep-") and out["ok"] is True and out["steps"] == [1, 2, 3]
    assert out["grid"] == {CLIP: [0.1, 0.2], "algorithm.adv_estimator": ["grpo", "rloo"]}
    assert len(out["scenarios"]) == 4
    sc = out["scenarios"]["clip_ratio=0.1__adv_estimator=rloo"]
    assert sc["overrides"] == {CLIP: 0.1, "algorithm.adv_estimator": "rloo"}
    assert sc["steps_done"] == [1, 2, 3] and sc["steps_failed"] == {}
    assert set(sc["metrics"]) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "critic/advantages/mean"}


def test_cli_table_and_errors(run, capsys):
    from rldiag.cli.main import main

    assert main(["sweep", str(run), "--grid", f"{CLIP}=0.1,0.2", "--set", "algorithm.adv_estimator=rloo",
                 "--metrics", "actor/pg_loss", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "clip_ratio=0.1__adv_estimator=rloo" in out and "actor/pg_loss" in out
    assert main(["sweep", str(run), "--grid", "no_equals_sign"]) == 1
    assert "ConfigError: --grid 'no_equals_sign'" in capsys.readouterr().err
    assert main(["sweep", str(run), "--estimators", "grpo,remax", "--no-progress"]) == 1  # remax's steps fail
