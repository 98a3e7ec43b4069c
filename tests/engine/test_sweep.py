"""recompute_batch_many (rldiag/engine/sweep.py): for every settings of a grid, exactly what
recompute_batch gives (bit for bit on the CPU), with each stage run once for the scenarios that
agree on it; and the State fields each stage declares it uses and sets are those it touches."""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import replace

import pytest
import torch

from rldiag.config.settings import resolve_settings
from rldiag.engine.batch import pack
from rldiag.engine.kl_control import KLControllerState, PresetKLCoefficients, initial_kl_state
from rldiag.engine.pipeline import Result, recompute_batch
from rldiag.engine.stages import STAGES, Stage, State
from rldiag.engine.step_failures import StepErrors
from rldiag.engine.sweep import commute, iter_recompute_many, recompute_batch_many, stage_keys
from rldiag.errors import MissingInputError
from rldiag.io.loader import load_step, read_schema
from rldiag.io.rundir import RunDir
from tests.engine.test_stages import CASES, EVERYTHING, _run_stages, rich_run  # noqa: F401 - the fixture

A = "actor_rollout_ref.actor."
RC = "algorithm.rollout_correction."


def _batch(run, settings):
    """Every step of ``run`` packed, with every column of its files (what any scenario reads)."""
    return pack([load_step(sf, settings, read_schema(sf).names).batch for sf in RunDir(run).require_steps()])


def assert_same(got: Result, want: Result) -> None:
    """Every metric and token output bit for bit (NaN where NaN), the same failed steps."""
    assert got.steps == want.steps
    assert sorted(got.metrics) == sorted(want.metrics)
    for k in want.metrics:
        torch.testing.assert_close(got.metrics[k], want.metrics[k], rtol=0, atol=0, equal_nan=True, msg=k)
    assert sorted(got.tokens) == sorted(want.tokens)
    for k in want.tokens:
        torch.testing.assert_close(got.tokens[k], want.tokens[k], rtol=0, atol=0, equal_nan=True, msg=k)
    assert got.failed == want.failed


def _grid(run, grid: dict, base: dict | None = None):
    return [resolve_settings(run, {**EVERYTHING, **(base or {}), **dict(zip(grid, combo))})
            for combo in itertools.product(*grid.values())]


GRIDS = {
    "clip x estimator x agg x rollout_is": {
        A + "clip_ratio": [0.1, 0.28],
        "algorithm.adv_estimator": ["grpo", "rloo", "gae", "reinforce_plus_plus"],
        A + "loss_agg_mode": ["token-mean", "seq-mean-token-sum"],
        RC + "rollout_is": [None, "token", "sequence"],
    },
    "loss modes and both agg modes": {
        A + "policy_loss.loss_mode": ["vanilla", "gspo", "clip_cov", "kl_cov"],
        A + "loss_agg_mode": ["token-mean", "seq-mean-token-mean"],
        "critic.loss_agg_mode": [None, "token-mean"],
    },
    "filters x clip": {
        "algorithm.filter_groups.enable": [False, True],
        "rldiag.filter.drop_no_signal_from_denominator": [False, True],
        A + "clip_ratio": [0.1, 0.28],
        "algorithm.adv_estimator": ["grpo", "rloo"],
    },
    "bypass, verl versions, KL": {
        RC + "bypass_mode": [False, True],
        "rldiag.verl_version": ["0.8.0", None],
        "algorithm.kl_penalty": ["kl", "low_var_kl"],
        A + "use_kl_loss": [False, True],
    },
}


@pytest.mark.parametrize("name", list(GRIDS))
def test_each_result_is_the_recompute_of_its_settings(rich_run, name):  # noqa: F811
    settings = _grid(rich_run, GRIDS[name], {RC + "rollout_is_threshold": 2.0, "algorithm.filter_groups.metric": "acc"})
    batch = _batch(rich_run, settings[0])
    many = recompute_batch_many(batch, settings)
    assert len(many) == len(settings)
    for got, s in zip(many, settings):
        assert_same(got, recompute_batch(batch, s))


def test_a_clip_ratio_grid_shares_everything_but_the_policy_loss(rich_run):  # noqa: F811
    settings = _grid(rich_run, {A + "clip_ratio": [0.1, 0.2, 0.28, 0.4]})
    batch = _batch(rich_run, settings[0])
    runs: dict[str, list[list[int]]] = {}
    many = recompute_batch_many(batch, settings, on_stage=lambda stage, who: runs.setdefault(stage, []).append(who))
    for got, s in zip(many, settings):
        assert_same(got, recompute_batch(batch, s))
    per_scenario = {"actor_loss", "total_loss", "turns_loss", "rows_loss", "health"}  # the last three read the policy loss
    assert set(runs) == {s.name for s in STAGES}
    for stage, calls in runs.items():
        if stage in per_scenario:
            assert sorted(calls) == [[0], [1], [2], [3]], stage
        else:
            assert calls == [[0, 1, 2, 3]], stage  # advantages, data metrics, ref KL, rollout correction, ...


def test_equal_settings_share_one_leaf(rich_run):  # noqa: F811
    s = resolve_settings(rich_run, EVERYTHING)
    batch = _batch(rich_run, s)
    leaves = list(iter_recompute_many(batch, [s, replace(s), s]))
    assert [members for members, _ in leaves] == [[0, 1, 2]]
    assert_same(recompute_batch_many(batch, [s, s])[1], recompute_batch(batch, s))


def test_adaptive_kl_states_advance_per_scenario(rich_run):  # noqa: F811
    base = {"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.horizon": 100.0}
    settings = _grid(rich_run, {A + "clip_ratio": [0.1, 0.2], "algorithm.kl_ctrl.target_kl": [0.01, 0.5]}, base)
    batch = _batch(rich_run, settings[0])
    # one state each: each advanced once
    states = [initial_kl_state(s) for s in settings]
    want_states = [initial_kl_state(s) for s in settings]
    many = recompute_batch_many(batch, settings, states)
    for got, s, st in zip(many, settings, want_states):
        assert_same(got, recompute_batch(batch, s, st))
    assert [st.value for st in states] == [st.value for st in want_states]
    assert states[0].value != 0.2  # it moved
    # scenarios agreeing on the reward KL may share one state object: advanced once for both
    shared = initial_kl_state(settings[0])
    alone = initial_kl_state(settings[0])
    many = recompute_batch_many(batch, [settings[0], settings[2]], [shared, shared])  # clip 0.1 vs 0.2, same target
    assert_same(many[1], recompute_batch(batch, settings[2], alone))
    assert shared.value == alone.value
    # ... but not when they differ before it (it would advance twice)
    with pytest.raises(ValueError, match="advanced once for each"):
        recompute_batch_many(batch, [settings[0], settings[1]], [shared, shared])


def test_preset_and_fixed_kl(rich_run):  # noqa: F811
    settings = _grid(rich_run, {"algorithm.kl_ctrl.kl_coef": [0.001, 0.01]})
    batch = _batch(rich_run, settings[0])
    presets = [PresetKLCoefficients([0.1] * batch.n_steps), PresetKLCoefficients([0.2] * batch.n_steps)]
    for kls in ([None, None], presets, [KLControllerState(5.0), KLControllerState(7.0)]):
        many = recompute_batch_many(batch, settings, kls)
        for got, s, kl in zip(many, settings, kls):
            assert_same(got, recompute_batch(batch, s, kl))


def test_an_error_is_the_outcome_of_the_scenarios_that_raise_it(rich_run):  # noqa: F811
    s = resolve_settings(rich_run, EVERYTHING)
    batch = _batch(rich_run, s)
    batch = replace(batch, ref_log_prob=None)  # the reward KL (use_kl_in_reward) cannot run
    settings = [s, resolve_settings(rich_run, {**EVERYTHING, "algorithm.use_kl_in_reward": False})]
    with pytest.raises(MissingInputError):
        recompute_batch(batch, settings[0])
    out = dict((tuple(m), r) for m, r in iter_recompute_many(batch, settings, catch=(MissingInputError,)))
    assert isinstance(out[(0,)], MissingInputError)
    assert_same(out[(1,)], recompute_batch(batch, settings[1]))
    with pytest.raises(MissingInputError):
        recompute_batch_many(batch, settings)


def test_stage_keys_follow_the_declarations():
    adv = next(s for s in STAGES if s.name == "advantages")
    keys = ["algorithm.adv_estimator", "algorithm.gamma", A + "clip_ratio", "rldiag.capture.verl_version", "x.y"]
    assert stage_keys(adv, keys) == ("algorithm.adv_estimator", "algorithm.gamma", "rldiag.capture.verl_version")
    undeclared = Stage("x", "an undeclared stage", lambda st: None)
    assert not commute(undeclared, adv) and not commute(adv, undeclared)
    by = {s.name: s for s in STAGES}
    assert commute(by["ref_kl"], by["actor_loss"]) and not commute(by["total_loss"], by["actor_loss"])
    assert not commute(by["data_metrics"], by["advantages"])


# -- the declarations of the State fields each stage uses and sets --------------------------------


class _Outputs(dict):
    """The state's metrics (or rows) dict, logging each entry read as ``<prefix>:<name>``."""

    def __init__(self, values, log, prefix):
        super().__init__(values)
        self.log, self.prefix = log, prefix

    def __getitem__(self, key):
        self.log.add(f"{self.prefix}:{key}")
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.log.add(f"{self.prefix}:{key}")
        return super().get(key, default)

    def __contains__(self, key):
        self.log.add(f"{self.prefix}:{key}")
        return super().__contains__(key)


class _RecordingState(State):
    """A State that logs every field read and assigned (after it is set up)."""

    def __getattribute__(self, name):
        if not name.startswith("_") and name in State.__dataclass_fields__:
            log = object.__getattribute__(self, "__dict__").get("_read")
            if log is not None:
                log.add(name)
        return object.__getattribute__(self, name)

    def __setattr__(self, name, value):
        log = self.__dict__.get("_set")
        if log is not None:
            log.add(name)
        object.__setattr__(self, name, value)


def _fields_touched(run, overrides):
    s = resolve_settings(run, {**EVERYTHING, **overrides})
    batch = _batch(run, s)
    st = _RecordingState(batch, s, None, StepErrors(batch.steps))
    out = {}
    for stage in STAGES:
        read, assigned = set(), set()
        before = dict(st.errors.messages)
        st.__dict__["_read"], st.__dict__["_set"] = read, assigned
        st.__dict__["metrics"] = _Outputs(st.__dict__["metrics"], read, "metrics")
        st.__dict__["rows"] = _Outputs(st.__dict__["rows"], read, "rows")
        stage.run(st)
        st.__dict__["_read"] = st.__dict__["_set"] = None
        flagged = st.errors.messages != before
        out[stage.name] = (read - {"batch", "settings", "metrics", "tokens", "rows"}, assigned, flagged)
    return out


@pytest.fixture(scope="module")
def touched(rich_run):  # noqa: F811
    out: dict[str, tuple[set, set, bool]] = {s.name: (set(), set(), False) for s in STAGES}
    for overrides in CASES.values():
        for name, (read, assigned, flagged) in _fields_touched(rich_run, overrides).items():
            r, a, f = out[name]
            out[name] = (r | read, a | assigned, f or flagged)
    return out


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_each_stage_touches_only_the_fields_it_declares(touched, stage):
    assert stage.uses is not None and stage.sets is not None, f"{stage.name}: declare uses= and sets="
    read, assigned, flagged = touched[stage.name]
    sets = set(stage.sets)
    undeclared = sorted((read - {"errors"}) - set(stage.uses) - sets)
    assert not undeclared, f"stage {stage.name} reads fields its declaration lacks: {undeclared}"
    assert assigned - {"metrics", "tokens", "rows"} <= sets, f"stage {stage.name} sets {sorted(assigned - sets)}"
    if "errors" in read or flagged:
        assert "errors" in sets, f"stage {stage.name} flags steps: declare sets=(..., 'errors')"


@pytest.mark.parametrize("stage", [s for s in STAGES if s.settings_fn is not None], ids=lambda s: s.name)
def test_a_stage_reads_the_settings_its_settings_fn_names(rich_run, stage):  # noqa: F811
    """Where a stage's settings_fn narrows its keys under given settings, it reads no other key
    there (the sweep compares scenarios on those alone)."""
    for name, overrides in CASES.items():
        read = _run_stages(rich_run, overrides)[stage.name]["settings"]
        named = stage.settings_fn(resolve_settings(rich_run, {**EVERYTHING, **overrides}))
        extra = sorted(k for k in read if not any(fnmatch.fnmatchcase(k, p) for p in named))
        assert not extra, f"case {name}: stage {stage.name} reads {extra} beyond its settings_fn"
