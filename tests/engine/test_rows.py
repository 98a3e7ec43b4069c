"""Per-row outputs (Result.rows; rldiag/engine/stages/rows.py) and their table
(rldiag.io.outputs.rows_table): values against a per-row Python reference, each row's share of the
loss adding up to the loss, the clipped tokens to actor/pg_clipfrac, the group flags to
rldiag/groups/no_signal_fraction."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given

from rldiag.config.settings import resolve_settings
from rldiag.engine.aggregation import AGG_MODES, AggNorm, aggregate, token_weights
from rldiag.engine.batch import pack
from rldiag.engine.kl import k3_from_diff
from rldiag.engine.layout import Rows
from rldiag.engine.pipeline import recompute_batch
from rldiag.engine.policy_loss import POLICY_LOSSES
from rldiag.engine.requirements import recompute_columns
from rldiag.engine.segments import seg_sum
from rldiag.engine.stages import STAGES, State
from rldiag.engine.step_failures import StepErrors
from rldiag.errors import OutputError
from rldiag.io.loader import load_step
from rldiag.io.outputs import INT_ROW_OUTPUTS, ROW_OUTPUTS, rows_table, tokens_table
from rldiag.io.rundir import RunDir
from rldiag.synth import SynthSpec, write_synth_run
from tests.engine.test_turns import HS, _batch, _tokens_per_row, turn_batches, turns_ref
from tests.engine.test_turns import _worked as worked_turns

LOSS = "actor_rollout_ref.actor.policy_loss."
AGG = "actor_rollout_ref.actor.loss_agg_mode"
ONE_SEGMENT = {"rldiag.dp_size": 1, "rldiag.mini_batch_size": None, "rldiag.micro_batch_size": None}
MICRO = {"rldiag.dp_size": 2, "rldiag.mini_batch_size": 8, "rldiag.micro_batch_size": 2}
LOSS_SETTINGS = {LOSS + "dro_beta": 0.1, LOSS + "kl_cov_ratio": 0.05, LOSS + "clip_cov_ratio": 0.05}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_synth_run(tmp_path_factory.mktemp("rows") / "run",
                           SynthSpec(steps=2, prompts=4, n=4, max_len=30, seed=11, drift=0.3))


def _state(run, overrides) -> State:
    s = resolve_settings(run, {**LOSS_SETTINGS, **overrides})
    batch = pack([load_step(sf, s, recompute_columns(s)).batch for sf in RunDir(run).require_steps()])
    state = State(batch, s, None, StepErrors(batch.steps))
    for stage in STAGES:
        stage.run(state)
    return state


# ---- the table --------------------------------------------------------------------------------


def test_rows_table_columns_types_and_order():
    rows = {"group_size": torch.tensor([2, 2, 1]), "length": torch.tensor([3, 4, 5]),
            "advantage_mean": torch.tensor([0.5, float("nan"), -1.0]),
            "group_has_signal": torch.tensor([1, 1, 0], dtype=torch.int8), "not_an_output": torch.zeros(3)}
    t = rows_table(rows, step=12, row_offset=10)
    assert t.column_names == ["step", "row", "length", "advantage_mean", "group_has_signal", "group_size"]
    assert t.schema.field("step").type == pa.int64() and t.schema.field("row").type == pa.int64()
    assert t.schema.field("length").type == pa.int64() and t.schema.field("group_has_signal").type == pa.int64()
    assert t.schema.field("advantage_mean").type == pa.float64()
    assert t["step"].to_pylist() == [12, 12, 12] and t["row"].to_pylist() == [10, 11, 12]
    assert math.isnan(t["advantage_mean"][1].as_py())
    with pytest.raises(OutputError, match="score"):
        rows_table({"length": torch.zeros(3), "score": torch.zeros(2)}, step=1)
    assert rows_table({}, step=1).num_rows == 0


def test_every_declared_row_output_has_a_column():
    declared = {name for stage in STAGES for name in stage.rows}
    assert declared == set(ROW_OUTPUTS) and len(ROW_OUTPUTS) == len(set(ROW_OUTPUTS))
    assert INT_ROW_OUTPUTS <= set(ROW_OUTPUTS)


def test_the_whole_result_as_a_table(run):
    st = _state(run, {})
    t = rows_table(st.rows, step=3)
    assert t.num_rows == st.batch.n_rows
    assert t.column_names == ["step", "row"] + list(ROW_OUTPUTS)  # a run with every input: every column
    for name in ROW_OUTPUTS:
        assert t.schema.field(name).type == (pa.int64() if name in INT_ROW_OUTPUTS else pa.float64())


def test_the_turn_token_output_goes_out_as_int32_lists():
    _, r = worked_turns()
    t = tokens_table(r.tokens, torch.tensor([9, 9]))
    assert t.schema.field("turn").type == pa.list_(pa.int32())
    assert t["turn"].to_pylist() == [[1, 1, 0, 0, 2, 2, 2, 0, 3], [1] * 9]


# ---- by hand ----------------------------------------------------------------------------------


def test_worked_example():
    """tests/engine/test_turns.py's two rows: row 0 six actor tokens in three turns, its last
    one with rollout ratio 3; turn 2's three tokens clipped."""
    _, r = worked_turns()
    a = float(r.tokens["advantages"][0])
    rows = {k: v.tolist() for k, v in r.rows.items()}
    assert rows["length"] == [9, 9] and rows["actor_tokens"] == [6, 9] and rows["turns"] == [3, 1]
    assert rows["score"] == [1.0, 0.0] and rows["reward"] == [1.0, 0.0]
    assert rows["advantage_mean"] == pytest.approx([a, -a]) and rows["advantage_last"] == pytest.approx([a, -a])
    assert rows["is_ratio_seq"] == pytest.approx([3.0, 1.0], rel=1e-5) and rows["is_weight_seq"] == pytest.approx([2.0, 1.0])
    assert rows["rollout_kl"] == pytest.approx([math.log(3.0) / 6, 0.0], rel=1e-5)
    k3 = float(k3_from_diff(torch.tensor(math.log(3.0))))
    assert rows["rollout_kl_k3"] == pytest.approx([k3 / 6, 0.0], rel=1e-5)
    assert rows["clipped_tokens"] == [3.0, 0.0]
    assert rows["loss_weight"] == pytest.approx([6 / 15, 9 / 15])
    assert rows["group_has_signal"] == [1, 1] and rows["group_size"] == [2, 2]


def test_a_row_without_actor_tokens():
    from tests.conftest import make_batch, settings

    b = make_batch(scores=[[0, 1.0], [0, 2.0]], mask=[[1, 1], [0, 0]], uids=["A", "A"])
    r = recompute_batch(b, settings(estimator="grpo"))
    assert r.rows["actor_tokens"].tolist() == [2, 0] and r.rows["turns"].tolist() == [1, 0]
    assert math.isnan(r.rows["advantage_mean"][1].item()) and math.isnan(r.rows["advantage_last"][1].item())
    assert r.rows["score"].tolist() == [1.0, 2.0]


# ---- against a per-row reference ---------------------------------------------------------------


@HS
@given(turn_batches())
def test_row_values_match_a_per_row_reference(rows):
    from tests.conftest import settings

    r = recompute_batch(_batch(rows), settings(estimator="grpo"))
    toks = _tokens_per_row(r, rows)
    got = {k: v.to(torch.float64).numpy() for k, v in r.rows.items()}
    groups: dict[tuple[int, int], list[float]] = {}
    for row in rows:
        groups.setdefault((row["step"], row["uid"]), []).append(sum(row["score"]))
    for i, (row, t) in enumerate(zip(rows, toks)):
        m = np.array(row["mask"], dtype=bool)
        adv = t["advantages"]
        d = np.array(row["old"], dtype=np.float32).astype(np.float64) - np.array(row["rollout"], dtype=np.float32)
        assert got["length"][i] == len(m) and got["actor_tokens"][i] == m.sum()
        assert got["turns"][i] == max(turns_ref(row["mask"]), default=0)
        assert got["score"][i] == pytest.approx(sum(row["score"])) and got["reward"][i] == pytest.approx(sum(row["score"]))
        seq = d[m].sum()
        assert got["is_ratio_seq"][i] == pytest.approx(math.exp(seq), rel=1e-5)
        assert got["is_weight_seq"][i] == pytest.approx(min(math.exp(seq), 2.0), rel=1e-5)
        if m.any():
            assert got["advantage_mean"][i] == pytest.approx(adv[m].mean(), rel=1e-5, abs=1e-6)
            assert got["advantage_last"][i] == adv[np.flatnonzero(m)[-1]]
            assert got["rollout_kl"][i] == pytest.approx(d[m].mean(), rel=1e-5, abs=1e-6)
            assert got["rollout_kl_k3"][i] == pytest.approx(np.mean(np.exp(-d[m]) + d[m] - 1), rel=1e-4, abs=1e-6)
        else:
            assert math.isnan(got["advantage_mean"][i]) and math.isnan(got["advantage_last"][i])
        scores = groups[(row["step"], row["uid"])]
        assert got["group_size"][i] == len(scores)
        assert got["group_has_signal"][i] == (len(scores) > 1 and len(set(scores)) > 1)


# ---- each row's share of the loss --------------------------------------------------------------


def _norms(rows: Rows, seg: torch.Tensor, n: int, given: bool, scale: float | None) -> AggNorm:
    mask_rows = torch.bincount(seg, minlength=n).to(torch.float32)
    return AggNorm(seg_ids=seg, n_seg=n, horizon=torch.full((n,), 7.0), rows=rows,
                   batch_num_tokens=torch.tensor([13.0, 5.0])[:n] if given else None,
                   global_batch_size=mask_rows + 1 if given else None, loss_scale_factor=scale)


@pytest.mark.parametrize("mode", AGG_MODES.names())
@pytest.mark.parametrize("given_norms", [True, False], ids=["global normalisers", "verl's fallbacks"])
@pytest.mark.parametrize("scale", [None, 3.0])
def test_token_weights_reproduce_every_aggregation(mode, given_norms, scale):
    g = torch.Generator().manual_seed(0)
    rows = Rows.from_lengths(torch.tensor([3, 0, 5, 2, 4]))
    seg = torch.tensor([0, 0, 1, 1, 1])
    mask = (torch.rand(rows.n_tokens, generator=g) > 0.3).float()
    loss = torch.randn(rows.n_tokens, generator=g)
    norm = _norms(rows, seg, 2, given_norms, scale)
    w = token_weights(mode, mask, norm)
    assert torch.equal(w * (1 - mask), torch.zeros_like(w))  # nothing outside the mask
    assert torch.allclose(seg_sum(rows.sum(w * loss), seg, 2), aggregate(mode, loss, mask, norm), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_mode", POLICY_LOSSES.names())
@pytest.mark.parametrize("layout", [ONE_SEGMENT, MICRO], ids=["one segment a step", "micro-batches"])
def test_loss_weights_give_back_pg_loss(run, loss_mode, layout):
    """Summed over a step's tokens, weight x token loss is actor/pg_loss: the weights are the
    loss's own aggregation (its override of loss_agg_mode included), over micro- and mini-batches."""
    overrides = {LOSS + "loss_mode": loss_mode, **layout}
    if loss_mode == "bypass_mode":
        overrides["algorithm.rollout_correction.bypass_mode"] = True
    st = _state(run, overrides)
    assert st.loss_weights is not None
    batch = st.batch
    total = seg_sum(batch.rows.sum((st.loss_weights * st.tokens["pg_losses"]).to(torch.float64)), batch.step_ids,
                    batch.n_steps)
    assert torch.allclose(total.float(), st.metrics["actor/pg_loss"], rtol=1e-4, atol=1e-6)
    # the rows' shares add up to the turns' and to the step's total weight
    rows_total = seg_sum(st.rows["loss_weight"].to(torch.float64), batch.step_ids, batch.n_steps)
    turns_total = sum(st.metrics[f"rldiag/turns/{k}/loss_weight"].to(torch.float64)
                      for k in ("1", "2", "3", "4", "5", "6", "7", "8", "9plus"))
    assert torch.allclose(rows_total, turns_total, rtol=1e-5)


@pytest.mark.parametrize("agg", AGG_MODES.names())
@pytest.mark.parametrize("layout", [ONE_SEGMENT, MICRO], ids=["one segment a step", "micro-batches"])
def test_loss_weights_sum_to_the_total_aggregation_weight(run, agg, layout):
    st = _state(run, {AGG: agg, **layout})
    batch = st.batch
    total = st.segs.loss(aggregate(agg, torch.ones(batch.n_tokens), st.mask, st.actor_norm))
    got = seg_sum(st.rows["loss_weight"].to(torch.float64), batch.step_ids, batch.n_steps)
    assert torch.allclose(got.float(), total, rtol=1e-5)
    if agg == "token-mean":
        assert torch.allclose(got.float(), torch.ones_like(total), rtol=1e-5)  # no rejection: the whole loss


def test_loss_scale_is_loss(run):
    st = _state(run, MICRO)
    x = torch.rand(st.segs.n_seg, dtype=torch.float32)
    assert torch.allclose(st.segs.loss(x), st.segs.total(x * st.segs.loss_scale()))
    assert st.segs.loss_scale().min() < 1  # several mini-batches a step


# ---- clipped tokens and group flags -------------------------------------------------------------


@pytest.mark.parametrize("loss_mode", [n for n in POLICY_LOSSES.names() if n not in ("up",)])
def test_clipped_tokens_give_back_pg_clipfrac(run, loss_mode):
    overrides = {LOSS + "loss_mode": loss_mode, **ONE_SEGMENT}
    if loss_mode == "bypass_mode":
        overrides["algorithm.rollout_correction.bypass_mode"] = True
    st = _state(run, overrides)
    if "actor/pg_clipfrac" not in st.metrics:  # gpg, dro, kl_cov and bypass's reinforce: no clip fraction
        assert "clipped_tokens" not in st.rows
        return
    batch = st.batch
    clipped = seg_sum(st.rows["clipped_tokens"].to(torch.float64), batch.step_ids, batch.n_steps)
    tokens = seg_sum(st.rows["actor_tokens"].to(torch.float64), batch.step_ids, batch.n_steps)
    assert torch.allclose((clipped / tokens).float(), st.metrics["actor/pg_clipfrac"], rtol=1e-5, atol=1e-7)
    if loss_mode == "vanilla":
        assert clipped.sum() > 0


def test_up_counts_clipped_tokens_among_its_non_positive_ones(run):
    st = _state(run, {LOSS + "loss_mode": "up", **ONE_SEGMENT})
    batch = st.batch
    non_pos = seg_sum(batch.rows.masked_sum((st.adv <= 0).float(), st.mask).to(torch.float64), batch.step_ids,
                      batch.n_steps)
    clipped = seg_sum(st.rows["clipped_tokens"].to(torch.float64), batch.step_ids, batch.n_steps)
    assert torch.allclose((clipped / non_pos).float(), st.metrics["actor/pg_clipfrac"], rtol=1e-5, atol=1e-7)


def test_group_flags_give_back_no_signal_fraction(run):
    st = _state(run, {})
    batch = st.batch
    size, signal = st.rows["group_size"], st.rows["group_has_signal"].to(torch.float64)
    for s in range(batch.n_steps):
        first = {}  # one row per group
        for i in torch.nonzero(batch.step_ids == s).flatten().tolist():
            first.setdefault(int(batch.group_ids[i]), i)
        multi = [i for i in first.values() if size[i] > 1]
        expect = 1.0 - sum(float(signal[i]) for i in multi) / len(multi)
        assert st.metrics["rldiag/groups/no_signal_fraction"][s].item() == pytest.approx(expect)
