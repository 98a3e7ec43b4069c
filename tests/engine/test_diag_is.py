"""The diagnostic IS weights (rldiag/engine/stages/diag_is.py): verl's token- and sequence-level
truncated IS at threshold 2.0, computed whatever the run's rollout-correction settings, equal to
rollout_corr/rollout_is_* of a run that sets them, and never in the loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rldiag.config.settings import resolve_settings
from rldiag.engine.batch import pack
from rldiag.engine.diag_is import tis_statistics
from rldiag.engine.layout import Rows
from rldiag.engine.pipeline import recompute_batch
from rldiag.engine.requirements import recompute_columns
from rldiag.engine.rollout_correction import CorrectionConfig, is_weights
from rldiag.engine.segments import step_token_bounds
from rldiag.engine.stages import STAGES, State
from rldiag.engine.stages.diag_is import DIAG_IS, STATS
from rldiag.engine.step_failures import StepErrors
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir
from rldiag.synth import SynthSpec, write_synth_run
from tests.conftest import make_batch, settings

RC = "algorithm.rollout_correction."
#: the sequence level's statistics taken in closed form per row (rldiag/engine/diag_is.py)
CLOSED_FORM = ("mean", "std", "eff_sample_size")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_synth_run(tmp_path_factory.mktemp("diag_is") / "run",
                           SynthSpec(steps=3, prompts=4, n=4, max_len=40, seed=5, drift=0.6))


def _batch(run, overrides):
    s = resolve_settings(run, overrides)
    return pack([load_step(sf, s, recompute_columns(s)).batch for sf in RunDir(run).require_steps()]), s


def _recompute(run, overrides):
    batch, s = _batch(run, overrides)
    return recompute_batch(batch, s)


def test_worked_example():
    # one row, log-ratios old - rollout = 0, log 3, log 0.25 -> token weights 1, 2 (truncated), 0.25;
    # the row's summed log-ratio log 0.75 -> sequence ratio and weight 0.75
    old = [[-1.0, -1.0, -1.0]]
    rollout = [[-1.0, -1.0 - math.log(3.0), -1.0 - math.log(0.25)]]
    b = make_batch(scores=[[0, 0, 1.0]], mask=[[1, 1, 1]], old_log_probs=old, log_probs=old, rollout_log_probs=rollout)
    r = recompute_batch(b, settings(estimator="grpo"))
    m = {k.removeprefix("rldiag/diag_is/"): v.item() for k, v in r.metrics.items() if k.startswith("rldiag/diag_is/")}
    assert m["token/mean"] == pytest.approx(3.25 / 3, rel=1e-6)
    assert (m["token/max"], m["token/min"]) == (pytest.approx(2.0), pytest.approx(0.25))
    assert m["token/ratio_fraction_high"] == pytest.approx(1 / 3) and m["token/ratio_fraction_low"] == pytest.approx(1 / 3)
    w = np.array([1.0, 2.0, 0.25])
    assert m["token/std"] == pytest.approx(w.std(), rel=1e-5)
    assert m["token/eff_sample_size"] == pytest.approx(1 / np.mean((w / w.mean()) ** 2), rel=1e-5)
    assert m["seq/mean"] == pytest.approx(0.75, rel=1e-6) and m["seq/max"] == pytest.approx(0.75, rel=1e-6)
    assert m["seq/ratio_fraction_high"] == 0.0 and m["seq/ratio_fraction_low"] == 0.0
    assert r.rows["is_ratio_seq"].tolist() == pytest.approx([0.75]) and r.rows["is_weight_seq"].tolist() == pytest.approx([0.75])
    assert "rollout_is_weights" not in r.tokens  # the run's own correction is off: no IS weight in the loss


def test_sequence_weight_is_truncated_and_ratio_is_not():
    old = [[-1.0, -1.0], [-1.0, -1.0]]
    rollout = [[-1.0 - math.log(3.0), -1.0 - math.log(2.0)], [-1.0, -1.0]]
    b = make_batch(scores=[[0, 1.0], [0, 0.0]], mask=[[1, 1], [1, 1]], old_log_probs=old, rollout_log_probs=rollout)
    r = recompute_batch(b, settings(estimator="grpo"))
    assert r.rows["is_ratio_seq"].tolist() == pytest.approx([6.0, 1.0], rel=1e-5)
    assert r.rows["is_weight_seq"].tolist() == pytest.approx([2.0, 1.0])
    assert r.metrics["rldiag/diag_is/seq/ratio_fraction_high"].item() == 0.5
    assert r.metrics["rldiag/diag_is/seq/max"].item() == pytest.approx(6.0, rel=1e-5)  # the untruncated ratio


@pytest.mark.parametrize("level,part", [("token", "token"), ("sequence", "seq")])
@pytest.mark.parametrize("rs", [None, "token_k1"], ids=["no rejection", "rejection"])
def test_equal_to_rollout_correction_under_the_same_settings(run, level, part, rs):
    overrides = {RC + "rollout_is": level, RC + "rollout_is_threshold": 2.0}
    if rs:
        overrides.update({RC + "rollout_rs": rs, RC + "rollout_rs_threshold": 1.5})
    r = _recompute(run, overrides)
    assert r.metrics["rldiag/diag_is/token/ratio_fraction_high"].sum() > 0  # the drift reaches the threshold
    for stat in STATS:
        got, verl = r.metrics[f"rldiag/diag_is/{part}/{stat}"], r.metrics[f"rollout_corr/rollout_is_{stat}"]
        if part == "seq" and stat in CLOSED_FORM:
            # closed form per row in float64 against verl's float32 sums of each row's weight token by token
            # (pieces of up to 64 equal float32 values, the rows added in float32): within those sums' rounding,
            # (63 + rows) x 2^-24 relative at most
            assert torch.allclose(got, verl, rtol=(63 + 16) * 2**-24, atol=0), stat
        else:
            assert torch.equal(got, verl), stat


def test_sequence_statistics_against_float64(run):
    """The sequence level's closed form per row against the definition over every actor token in float64."""
    r = _recompute(run, {})
    batch, _ = _batch(run, {})
    mask, sid = batch.response_mask.double(), batch.step_ids
    w = batch.rows.expand(r.rows["is_weight_seq"].double())
    tok_step = sid.index_select(0, batch.rows.row_ids)
    for s in range(batch.n_steps):
        on = (tok_step == s) & (mask > 0)
        x = w[on].numpy()
        want = {"mean": x.mean(), "std": x.std(), "eff_sample_size": 1 / np.mean((x / x.mean()) ** 2)}
        for stat, v in want.items():
            assert r.metrics[f"rldiag/diag_is/seq/{stat}"][s].item() == pytest.approx(v, rel=2**-23), stat


def test_the_loss_never_changes(run):
    """With and without the diagnostic's input (rollout_log_probs), and with and without the stage,
    the loss, the advantages and every actor metric are the same."""
    batch, s = _batch(run, {})
    with_diag = recompute_batch(batch, s)
    assert "rldiag/diag_is/token/mean" in with_diag.metrics
    batch.rollout_log_probs = None
    without = recompute_batch(batch, s)
    assert "rldiag/diag_is/token/mean" not in without.metrics
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/loss", "critic/advantages/mean"):
        assert torch.equal(with_diag.metrics[name], without.metrics[name]), name
    for name in ("advantages", "pg_losses", "ratio", "response_mask"):
        assert torch.equal(with_diag.tokens[name], without.tokens[name]), name


@pytest.mark.parametrize("overrides", [{}, {RC + "rollout_is": "token", RC + "rollout_is_threshold": 5.0,
                                            RC + "rollout_rs": "seq_mean_k1", RC + "rollout_rs_threshold": 1.3}],
                         ids=["no correction", "the run's own correction"])
def test_the_stage_touches_nothing_the_loss_reads(run, overrides):
    batch, s = _batch(run, overrides)
    states = []
    for skip in (False, True):
        state = State(batch, s, None, StepErrors(batch.steps))
        for stage in STAGES:
            if stage is DIAG_IS:
                before = (state.mask, state.is_weights)
                if skip:
                    continue
                stage.run(state)
                assert state.mask is before[0] and state.is_weights is before[1]
            else:
                stage.run(state)
        states.append(state)
    on, off = states
    assert "rldiag/diag_is/seq/mean" in on.metrics and "rldiag/diag_is/seq/mean" not in off.metrics
    for name, value in off.metrics.items():
        assert torch.equal(on.metrics[name], value) or (value.isnan().any() and torch.allclose(
            on.metrics[name], value, equal_nan=True, rtol=0, atol=0)), name
    for name, value in off.tokens.items():
        assert torch.equal(on.tokens[name], value), name


def test_not_in_bypass_mode(run):
    r = _recompute(run, {RC + "bypass_mode": True})
    assert not any(k.startswith("rldiag/diag_is/") for k in r.metrics)
    assert "is_weight_seq" not in r.rows and "rollout_kl" not in r.rows


def test_a_step_without_actor_tokens_gives_nan_and_does_not_fail():
    old = [[-1.0, -1.0], [-1.0, -1.0]]
    b = make_batch(scores=[[0, 1.0], [0, 0.0]], mask=[[1, 1], [0, 0]], steps=[1, 2], old_log_probs=old,
                   rollout_log_probs=[[-1.5, -1.0], [-1.0, -1.0]])
    r = recompute_batch(b, settings(estimator="grpo"))
    for part in ("token", "seq"):
        for stat in STATS:
            v = r.metrics[f"rldiag/diag_is/{part}/{stat}"]
            assert math.isfinite(v[0].item()) and math.isnan(v[1].item()), (part, stat)
    # the step fails for verl's rollout correction (its diagnostics raise on it), never for these
    assert all(m.startswith("rollout correction:") for m in r.failed.values())


def test_shared_pass_token_level_is_is_weights_to_the_bit():
    """rldiag/engine/diag_is.py's token level against is_weights on random rows (an empty step,
    a step whose every token is masked out, drift past both thresholds); a NaN off the mask takes
    is_weights' own path (None)."""
    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(0, 300, (40,), generator=gen)
    rows = Rows.from_lengths(lengths)
    sid = torch.repeat_interleave(torch.tensor([0, 1, 3]), torch.tensor([15, 10, 15]))  # step 2: no row
    mask = (torch.rand(rows.n_tokens, generator=gen) < 0.8).float()
    mask[rows.offsets[15]:rows.offsets[25]] = 0.0  # step 1: no actor token
    d = torch.randn(rows.n_tokens, generator=gen) * 0.7
    bounds = step_token_bounds(rows, sid, 4)
    assert bounds is not None
    got = tis_statistics(d, mask, rows, sid, 4, bounds, 2.0)
    assert got is not None
    w, want = is_weights(d, mask, CorrectionConfig("token", 2.0), rows, sid, 4, seq_stats=False)
    assert torch.equal(got.token_weights, w)
    for stat in STATS:
        a, b = got.token[f"rollout_is_{stat}"], want[f"rollout_is_{stat}"]
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), stat
    d[mask == 0] = float("nan")
    assert tis_statistics(d, mask, rows, sid, 4, bounds, 2.0) is None


def test_sequence_level_against_its_definition_per_step():
    """The sequence level (numpy over the rows) against each step's definition in torch: the rows'
    extreme ratios and fractions to the bit, the mean, std and effective sample size within float32
    rounding, a step without rows without extremes (rows in step order, as tis_statistics takes them)."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 50, (30,), generator=gen)
    rows = Rows.from_lengths(lengths)
    sid = torch.repeat_interleave(torch.tensor([0, 1, 3]), torch.tensor([12, 8, 10]))  # step 2: no row
    mask = (torch.rand(rows.n_tokens, generator=gen) < 0.9).float()
    d = torch.randn(rows.n_tokens, generator=gen) * 0.15
    d[rows.offsets[3]:rows.offsets[4]] = 30.0  # a row past the safety bound: its ratio clamped at exp(20)
    got = tis_statistics(d, mask, rows, sid, 4, step_token_bounds(rows, sid, 4), 2.0)
    assert got is not None
    row_log, count = rows.masked_sum(d, mask), rows.mask_count(mask)
    for s in range(4):
        on = sid == s
        v = {k: got.seq[f"rollout_is_{k}"][s].item() for k in ("max", "min", "ratio_fraction_high",
                                                                 "ratio_fraction_low", "mean", "std", "eff_sample_size")}
        if not on.any():  # no row: no extreme, no fraction (the stage makes every statistic NaN)
            assert all(math.isnan(v[k]) for k in ("max", "min", "ratio_fraction_high", "ratio_fraction_low")), v
            continue
        lg = row_log[on]
        assert v["max"] == torch.exp(lg.max().clamp(max=20.0)).item() and v["min"] == torch.exp(lg.min()).item()
        assert v["ratio_fraction_high"] == (lg > torch.log(torch.tensor(2.0))).float().mean().item()
        assert v["ratio_fraction_low"] == (lg < torch.log(torch.tensor(0.5))).float().mean().item()
        w = torch.exp(lg.clamp(-20.0, 20.0)).clamp(max=2.0).double()
        c = count[on].double()
        mean = (c * w).sum() / (c.sum() + 1e-8)
        std = ((c * (w - mean) ** 2).sum() / (c.sum() + 1e-8)).sqrt()
        ess = 1.0 / ((c * (w / (mean + 1e-8)) ** 2).sum() / (c.sum() + 1e-8))
        for k, want in (("mean", mean), ("std", std), ("eff_sample_size", ess)):
            assert v[k] == pytest.approx(want.item(), rel=2**-23), k
