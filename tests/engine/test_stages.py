"""The engine's stages and their declarations (rldiag/engine/stages/): docs/metrics.md is the
table the declarations generate; on rich synthetic runs, with every optional path and every
registry entry switched on in turn, each stage writes only the metrics, token outputs and per-row
outputs it declares and reads only the settings keys it declares, every declared metric is written by some
configuration, and the columns the planner loads are all a recompute needs."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rldiag.config import schema
from rldiag.config.settings import resolve_settings
from rldiag.config.verl_versions import RELEASES
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.batch import pack
from rldiag.engine.pipeline import recompute_batch
from rldiag.engine.policy_loss import POLICY_LOSSES
from rldiag.engine.requirements import recompute_columns
from rldiag.engine.rollout_correction import IS_LEVELS, RS_OPTIONS
from rldiag.engine.stages import STAGES, State, expand, markdown_table, pattern_regex
from rldiag.engine.step_failures import StepErrors
from rldiag.io.loader import load_step, read_schema
from rldiag.io.rundir import RunDir
from rldiag.synth import SynthSpec, write_synth_run

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
RC = "algorithm.rollout_correction."
LOSS = "actor_rollout_ref.actor.policy_loss."
#: every optional path on: KL in the reward and as a loss, a critic, IS weights (IcePop, batch
#: normalised), two rejection options, micro-batches over two DP ranks
EVERYTHING = {
    "algorithm.use_kl_in_reward": True,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.entropy_coeff": 0.001,
    "critic.enable": True,
    RC + "rollout_is": "token",
    RC + "rollout_is_threshold": "0.5_2.0",
    RC + "rollout_is_batch_normalize": True,
    RC + "rollout_rs": "token_k1,seq_mean_k3",
    RC + "rollout_rs_threshold": "0.5_2.0,4.0",
    "rldiag.dp_size": 2,
    "rldiag.mini_batch_size": 8,
    "rldiag.micro_batch_size": 2,
    LOSS + "dro_beta": 0.1,
    LOSS + "rollout_correction.rollout_is": "token",
    LOSS + "rollout_correction.rollout_rs": "token_k1",
    LOSS + "rollout_correction.rollout_rs_threshold": 4.0,
    "algorithm.gdpo_reward_keys": "acc,fmt",
    "rldiag.reward_components": "acc,fmt",
}
CASES: dict[str, dict] = {"everything": {}}
for _name in ESTIMATORS.names():
    CASES[f"estimator={_name}"] = {"algorithm.adv_estimator": _name}
for _name in POLICY_LOSSES.names():
    CASES[f"loss_mode={_name}"] = {LOSS + "loss_mode": _name}
CASES["bypass_mode"] = {RC + "bypass_mode": True, LOSS + "loss_mode": "bypass_mode"}
for _name in IS_LEVELS.names():
    CASES[f"rollout_is={_name}"] = {RC + "rollout_is": _name, RC + "rollout_is_threshold": 2.0}
CASES["rollout_rs=all"] = {RC + "rollout_rs": ",".join(RS_OPTIONS.names()), RC + "rollout_rs_threshold": 4.0}
for _version in RELEASES:
    CASES[f"verl={_version}"] = {"rldiag.verl_version": _version}
CASES["legacy trainer"] = {"trainer.use_v1": False, "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm"}
CASES["gae, adaptive KL"] = {"algorithm.adv_estimator": "gae", "critic.enable": None, "algorithm.kl_ctrl.type": "adaptive"}
CASES["filters"] = {"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
                    "rldiag.filter.gate_column": "fmt", "rldiag.filter.gate_min": 0.5,
                    "rldiag.filter.drop_no_signal_from_denominator": True}
CASES["nothing optional"] = {k: v for k, v in resolve_settings().values.items() if k in EVERYTHING}

#: keys the engine reads from a run's config beyond the settings schema: what rldiag's capture
#: records (docs/capture.md), verl's rollout.n (the mini-batch size in rows)
RUN_CONFIG_KEYS = ("rldiag.capture.trainer", "rldiag.capture.verl_version", "actor_rollout_ref.rollout.n")
#: the keys verl_versions.has reads: a stage asking ``settings.has(change)`` reads the release
VERSION_KEYS = {"verl_version": "rldiag.verl_version", "rldiag.capture.verl_version": "rldiag.verl_version"}


@pytest.fixture(scope="module")
def rich_run(tmp_path_factory):
    """Every column rldiag reads: the synthetic run's, with the estimator-specific ones, plus a
    loss_mask, the agent loop's per-row counts and each row's policy version (lags 0..2)."""
    run = write_synth_run(tmp_path_factory.mktemp("stages") / "run",
                          SynthSpec(steps=2, prompts=4, n=4, max_len=40, seed=3, extra_columns=True))
    rng = np.random.default_rng(0)
    for f in sorted((run / "batches").glob("*.parquet")):
        t = pq.read_table(f)
        rows = t.num_rows
        t = t.append_column("loss_mask", t["response_mask"])
        t = t.append_column("num_turns", pa.array(rng.integers(1, 5, rows), pa.int64()))
        t = t.append_column("tool_call_counts", pa.array(rng.integers(0, 3, rows), pa.int64()))
        step = int(t["step"][0].as_py())
        t = t.append_column("policy_version", pa.array(step - 1 - rng.integers(0, 3, rows), pa.int64()))
        lengths = pc.list_value_length(t["response_mask"]).to_numpy()  # each row's text, one string per token
        t = t.append_column("response_tokens", pa.array([["ab "] * int(n) for n in lengths], pa.list_(pa.string())))
        pq.write_table(t, f)
    return run


class _Recording(dict):
    """Settings values that log every key read."""

    def __init__(self, values):
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(VERSION_KEYS.get(key, key))
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(VERSION_KEYS.get(key, key))
        return super().get(key, default)


def _run_stages(run: Path, overrides: dict) -> dict[str, dict[str, set[str]]]:
    """Each stage's metrics, token outputs and settings keys read, on every step of ``run``
    packed, run stage by stage as recompute_batch runs them."""
    base = resolve_settings(run, {**EVERYTHING, **overrides})
    batch = pack([load_step(sf, base, recompute_columns(base)).batch for sf in RunDir(run).require_steps()])
    values = _Recording(base.values)
    settings = replace(base, values=values)
    state = State(batch, settings, None, StepErrors(batch.steps))
    out = {}
    for stage in STAGES:
        metrics, tokens, rows = dict(state.metrics), dict(state.tokens), dict(state.rows)
        values.read.clear()
        stage.run(state)
        out[stage.name] = {
            "metrics": {k for k, v in state.metrics.items() if metrics.get(k) is not v},
            "tokens": {k for k, v in state.tokens.items() if tokens.get(k) is not v},
            "rows": {k for k, v in state.rows.items() if rows.get(k) is not v},
            "settings": set(values.read),
        }
    reference = recompute_batch(batch, base)
    assert set(reference.metrics) == set(state.metrics) and set(reference.tokens) == set(state.tokens)
    assert set(reference.rows) == set(state.rows)
    return out


@pytest.fixture(scope="module")
def written(rich_run):
    """stage -> the metrics, token outputs and settings keys it writes or reads over every case."""
    out: dict[str, dict[str, set[str]]] = {s.name: {"metrics": set(), "tokens": set(), "rows": set(), "settings": set()}
                                           for s in STAGES}
    for overrides in CASES.values():
        for stage, got in _run_stages(rich_run, overrides).items():
            for kind, names in got.items():
                out[stage][kind] |= names
    return out


def _declared(stage, name: str) -> bool:
    return any(pattern_regex(m.name).match(name) for m in stage.metrics)


def test_the_docs_table_is_the_declarations():
    text = DOC.read_text()
    table = re.search(r"<!-- metrics-table:start -->\n(.*)<!-- metrics-table:end -->", text, re.S)
    assert table, "docs/metrics.md has lost its generated table's markers"
    assert table.group(1) == markdown_table(), "regenerate it: python -m rldiag.engine.stages"


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_each_stage_writes_only_what_it_declares(written, stage):
    got = written[stage.name]
    undeclared = sorted(n for n in got["metrics"] if not _declared(stage, n))
    assert not undeclared, f"stage {stage.name} writes metrics its declaration lacks: {undeclared}"
    assert got["tokens"] == set(stage.tokens), f"stage {stage.name}: token outputs {got['tokens']} declared {stage.tokens}"
    assert got["rows"] == set(stage.rows), f"stage {stage.name}: per-row outputs {got['rows']} declared {stage.rows}"


@pytest.mark.parametrize("stage", [s for s in STAGES if s.metrics], ids=lambda s: s.name)
def test_every_declared_metric_is_written(written, stage):
    names = written[stage.name]["metrics"]
    never = [p for m in stage.metrics for p in expand(m.name) if not any(pattern_regex(p).match(n) for n in names)]
    assert not never, f"stage {stage.name} declares metrics no configuration writes: {never}"


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_each_stage_reads_only_the_settings_it_declares(written, stage):
    read = written[stage.name]["settings"]
    undeclared = sorted(k for k in read if not any(fnmatch.fnmatchcase(k, p) for p in stage.settings))
    assert not undeclared, f"stage {stage.name} reads settings its declaration lacks: {undeclared}"


def test_declared_settings_are_real_keys():
    keys = [s.key for s in schema.SETTINGS] + list(RUN_CONFIG_KEYS)
    for stage in STAGES:
        for pattern in stage.settings:
            assert any(fnmatch.fnmatchcase(k, pattern) for k in keys), f"{stage.name}: no setting {pattern!r}"


def test_metric_names_are_declared_once():
    patterns = [(s.name, p) for s in STAGES for m in s.metrics for p in expand(m.name)]
    literal = [p for _, p in patterns if not re.search(r"[<*]", p)]
    assert len(literal) == len(set(literal))


@pytest.mark.parametrize("case", ["everything", "bypass_mode", "loss_mode=kl_cov", "gae, adaptive KL", "filters"])
def test_the_planned_columns_are_all_a_recompute_needs(rich_run, case):
    """A batch loaded with only the planner's columns recomputes exactly as one with every column
    of the file: a stage reading an undeclared column would differ (or fail) here."""
    settings = resolve_settings(rich_run, {**EVERYTHING, **CASES[case]})
    files = RunDir(rich_run).require_steps()
    every = read_schema(files[0]).names
    planned = recompute_batch(pack([load_step(sf, settings, recompute_columns(settings)).batch for sf in files]), settings)
    full = recompute_batch(pack([load_step(sf, settings, every).batch for sf in files]), settings)
    assert planned.metrics.keys() == full.metrics.keys() and planned.tokens.keys() == full.tokens.keys()
    assert planned.rows.keys() == full.rows.keys()
    for name, value in full.metrics.items():
        assert np.array_equal(planned.metrics[name].numpy(), value.numpy(), equal_nan=True), name
    for name, value in full.tokens.items():
        assert np.array_equal(planned.tokens[name].numpy(), value.numpy(), equal_nan=True), name
    for name, value in full.rows.items():
        assert np.array_equal(planned.rows[name].numpy(), value.numpy(), equal_nan=True), name
