"""One step: rows and groups from the batch, per-token outputs of scenarios, the checklist facts,
and batch files that cannot be opened (still being written)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from rldiag.scenario.recompute import recompute
from rldiag.store import Store, StoreError

RLOO = "adv_estimator=rloo"


def _write_batch(run, step, rows):
    """rows: dicts with uid, score, mask (list), optional loss_mask."""
    lengths = [len(r["mask"]) for r in rows]
    rng = np.random.default_rng(step)
    lp = [list(-np.abs(rng.normal(0.5, 0.2, n)).astype(np.float32)) for n in lengths]
    cols = {
        "uid": pa.array([r["uid"] for r in rows]),
        "score": pa.array([r["score"] for r in rows], pa.float32()),
        "response_mask": pa.array([r["mask"] for r in rows], pa.list_(pa.int8())),
        "old_log_probs": pa.array(lp, pa.list_(pa.float32())),
        "log_probs": pa.array([[v + 0.01 for v in x] for x in lp], pa.list_(pa.float32())),
        "ref_log_prob": pa.array([[v - 0.02 for v in x] for x in lp], pa.list_(pa.float32())),
        "rollout_log_probs": pa.array([[v + 0.05 for v in x] for x in lp], pa.list_(pa.float32())),
    }
    if any("loss_mask" in r for r in rows):
        cols["loss_mask"] = pa.array([r.get("loss_mask", r["mask"]) for r in rows], pa.list_(pa.int8()))
    (run / "batches").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), run / "batches" / f"step_{step}.parquet")


PLANTED = [
    # group a: identical scores (no signal)
    dict(uid="a", score=1.0, mask=[1, 1, 1, 1]),
    dict(uid="a", score=1.0, mask=[1, 1, 0, 0, 1, 1]),  # a tool span of 2 tokens
    # group b: signal
    dict(uid="b", score=1.0, mask=[1, 1, 1]),
    dict(uid="b", score=0.0, mask=[1, 0, 1, 1, 1]),  # a tool span of 1 token
    # group c: a singleton whose response_mask has a token its loss_mask leaves out
    dict(uid="c", score=0.0, mask=[1, 1, 1, 1, 1], loss_mask=[1, 1, 1, 1, 0]),
]


@pytest.fixture
def planted(tmp_path):
    run = tmp_path / "planted"
    _write_batch(run, 1, PLANTED)
    (run / "run.yaml").write_text("algorithm:\n  adv_estimator: grpo\n")
    recompute(run, save_tokens=True, device="cpu")
    return run


def test_step_rows_and_facts_on_a_planted_batch(planted):
    store = Store(planted)
    rows = store.step_rows(1, ["baseline"])
    assert rows["uid"].to_list() == ["a", "a", "b", "b", "c"]
    assert rows["length"].to_list() == [4, 6, 3, 5, 5]
    assert rows["actor_tokens"].to_list() == [4, 4, 3, 4, 5]
    assert rows["tool_tokens"].to_list() == [0, 2, 0, 1, 0]
    assert rows["score_total"].to_list() == [1.0, 1.0, 1.0, 0.0, 0.0]
    tok = pq.read_table(planted / "rldiag/scenarios/baseline/tokens/step_000001.parquet").to_pydict()
    for i, (adv, m) in enumerate(zip(tok["advantages"], tok["response_mask"])):
        want = np.mean([a for a, k in zip(adv, m) if k == 1])
        assert rows["adv:baseline"][i] == pytest.approx(want, abs=1e-6)
    f = store.step_facts(1, "baseline")
    assert (f.rows, f.groups, f.group_sizes) == (5, 3, {1: 1, 2: 2})
    assert (f.multi_groups, f.flat_groups) == (2, 1)
    assert (f.tool_rows, f.tool_tokens, f.actor_tokens) == (2, 3, 20)
    assert f.rows_outside_loss_mask == 1 and f.rejected_before_capture == 0
    assert f.score_zero_rows == 2 and f.score_max == 1.0
    # the recompute starts from loss_mask (the mask before rollout correction): row c's last
    # token, 0 there, stays 0, against 1 in the batch's response_mask
    assert f.rejected_tokens == 1 and f.unmasked_tokens == 0
    assert f.rewards_sign_flips == 0 and f.rewards_max_abs_change == 0.0
    assert f.adv_tokens == 19 and f.adv_nonfinite == 0
    assert f.ratio_tokens == 19 and f.ratio_min == pytest.approx(np.exp(0.01), rel=1e-4)


def test_a_capture_after_rejection_lies_within_its_loss_mask(tmp_path):
    """Captured after rollout rejection: response_mask has dropped tokens that loss_mask (the
    mask before correction) keeps. That is the legitimate direction, and the checklist says so."""
    from rldiag.viz import checklist

    run = tmp_path / "after-rejection"
    _write_batch(run, 1, [
        dict(uid="a", score=1.0, mask=[1, 0, 0, 1], loss_mask=[1, 1, 0, 1]),  # one token rejected
        dict(uid="a", score=0.0, mask=[0, 0, 0], loss_mask=[1, 1, 1]),  # a whole row rejected
        dict(uid="b", score=1.0, mask=[1, 1]),
    ])
    f = Store(run).step_facts(1, None)
    assert f.rows_outside_loss_mask == 0 and f.rejected_before_capture == 4
    c = next(c for c in checklist.evaluate(f, "grpo", 2) if c.order == 3)
    assert c.status != "fail"
    assert "4 tokens of loss_mask were rejected before the capture" in c.finding
    assert "response_mask lies within loss_mask" in c.finding


def test_rejection_and_kl_shaping_show_in_the_facts(planted):
    # a KL coefficient large enough to flip rewards; token rejection of every row drifting > 1.01
    recompute(planted, {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 200.0}, name="kl",
              save_tokens=True, device="cpu")
    f = Store(planted).step_facts(1, "kl")
    assert f.rewards_sign_flips == 3  # the three rows scoring 1
    recompute(planted, {"algorithm.rollout_correction.rollout_rs": "token_k1",
                        "algorithm.rollout_correction.rollout_rs_threshold": "0.99_1.01"},
              name="rs", save_tokens=True, device="cpu")
    g = Store(planted).step_facts(1, "rs")
    assert g.rejected_tokens == 20 and g.unmasked_tokens == 0


def test_groups_and_rewards_are_read_from_the_per_row_table(planted):
    """What the recompute wrote per row (uid, score, reward) is what the facts count: a scenario
    without tokens still gives the rewards facts; a planted per-row table moves them; without a
    per-row table the groups come from the batch; the token cache's per-row table serves too."""
    import rldiag

    recompute(planted, {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 200.0}, name="kl",
              device="cpu")  # no tokens
    store = Store(planted)
    f = store.step_facts(1, "kl")
    assert f.scenario == "kl" and (f.rewards_compared, f.rewards_sign_flips) == (5, 3)
    assert f.adv_tokens is None and f.rejected_tokens is None  # the token facts need the tokens
    assert (f.groups, f.group_sizes, f.multi_groups, f.flat_groups) == (3, {1: 1, 2: 2}, 2, 1)
    rows_file = planted / "rldiag/scenarios/kl/rows/step_000001.parquet"
    t = pq.read_table(rows_file)
    rows = store.step_rows(1, ["kl"])
    assert rows["reward:kl"].to_list() == t["reward"].to_pylist()
    assert rows["adv:kl"].to_list() == t["advantage_mean"].to_pylist()
    scores = t["score"].to_pylist()
    scores[3] = 1.0  # group b's second row now scores as its first: a flat group, and one more flip
    pq.write_table(t.set_column(t.column_names.index("score"), "score", pa.array(scores, pa.float64())), rows_file)
    g = store.step_facts(1, "kl")
    assert (g.flat_groups, g.rewards_sign_flips) == (2, 4)
    rows_file.unlink()  # a scenario written before per-row tables
    h = store.step_facts(1, "kl")
    assert (h.flat_groups, h.groups, h.scenario, h.rewards_compared) == (1, 3, None, None)
    rldiag.step_tokens(planted, 1, "kl")  # the Step page's one-step recompute into the token cache
    assert store.scenarios.rows_file("kl", 1) == planted / "rldiag/cache/kl/rows/step_000001.parquet"
    k = store.step_facts(1, "kl")
    assert (k.rewards_sign_flips, k.flat_groups, k.adv_tokens) == (3, 1, 19)


def test_row_tokens(planted):
    store = Store(planted)
    t = store.row_tokens(1, 1, "baseline")
    assert t["uid"] == "a"
    assert t["mask"] == [1, 1, 0, 0, 1, 1]
    assert len(t["advantages"]) == 6 and len(t["ratio"]) == 6 and t["post_mask"] == t["mask"]
    assert store.row_tokens(1, 1, None) == {"uid": "a", "mask": [1, 1, 0, 0, 1, 1]}


def test_batch_being_written_is_skipped_and_reported(run):
    p = run / "batches" / "step_2.parquet"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])  # footer not written yet
    store = Store(run)
    assert store.step_rows(1).height == 12
    with pytest.raises(StoreError, match="step_2.parquet"):
        store.step_rows(2)
    assert list(store.batches.problems) == [str(p)]
    assert list(store.batches.scan()) == [str(p)]
    p.write_bytes(data)  # the writer finished
    assert store.step_rows(2).height == 12
    assert store.batches.problems == {}


def test_arrow_ipc_batch_gives_the_same_rows(run, tmp_path):
    other = tmp_path / "arrow_run"
    (other / "batches").mkdir(parents=True)
    feather.write_feather(pq.read_table(run / "batches" / "step_3.parquet"), other / "batches" / "step_3.arrow",
                          compression="uncompressed")
    a = Store(run).step_rows(3)
    b = Store(other).step_rows(3)
    assert a.equals(b)


def test_is_weights_of_a_scenario(planted):
    recompute(planted, {"algorithm.rollout_correction.rollout_is": "token"}, name="is", save_tokens=True, device="cpu")
    store = Store(planted)
    assert store.scenarios_with_token_column("rollout_is_weights") == ["is"]
    w = store.is_weights("is", 1)
    assert w.height == 19  # one weight per actor token of loss_mask (the mask before correction)
    # old - rollout = -0.05 on every token: w = exp(-0.05) (float32 inputs)
    assert w["weight"].to_list() == pytest.approx([np.exp(-0.05)] * 19, rel=1e-4)
    q = store.is_quantiles("is")
    assert q["step"].to_list() == [1] and q["tokens"].to_list() == [19]
    assert q["q50"][0] == pytest.approx(np.exp(-0.05), rel=1e-4)
    assert store.is_weights("baseline", 1).height == 0
