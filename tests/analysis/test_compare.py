"""``rldiag compare``: numbers against a direct numpy computation, a collapsed group named,
effective weights across aggregation modes, scenarios recomputed when their tokens are missing."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from rldiag.analysis.agreement import average_ranks, pearson, spearman
from rldiag.analysis.compare import compare, compare_estimators
from rldiag.cli.main import main
from rldiag.engine.advantage import ESTIMATORS
from rldiag.io.run_layout import RunLayout
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run
from tests.analysis.reference import rewrite_column, write_logged_run


def _tokens(run, scenario, step):
    t = pq.read_table(run / "rldiag" / "scenarios" / scenario / "tokens" / f"step_{step:06d}.parquet")
    return (np.concatenate([np.asarray(r, np.float64) for r in t["advantages"].to_pylist()]),
            np.concatenate([np.asarray(r, np.float64) for r in t["response_mask"].to_pylist()]))


def _ranks(x):  # average ranks the slow way
    return np.array([np.mean([j + 1 for j, y in enumerate(sorted(x)) if y == v]) for v in x])


def test_rank_statistics():
    x = np.array([3.0, 1.0, 3.0, 2.0, 3.0, -1.0])
    assert average_ranks(x).tolist() == _ranks(x).tolist() == [5.0, 2.0, 5.0, 3.0, 5.0, 1.0]
    y = np.array([0.5, 0.1, 0.7, 0.2, 0.9, 0.0])
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert spearman(x, y) == pytest.approx(np.corrcoef(_ranks(x), _ranks(y))[0, 1])
    assert math.isnan(pearson(np.ones(4), y[:4])) and math.isnan(spearman(x[:1], y[:1]))


def test_estimator_pairs_match_numpy(tmp_path, capsys):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=3, seed=21, prompts=6, n=4))
    assert main(["compare", str(run), "--estimators", "grpo,gae"]) == 0
    assert "adv_estimator=grpo" in capsys.readouterr().out
    rep = compare_estimators(run, ["grpo", "gae"])  # reuses both scenarios
    assert rep.recomputed == [] and len(rep.pairs) == 1
    pair = rep.pairs[0]
    out = RunLayout(run).comparison("adv_estimator=grpo", "adv_estimator=gae").dir
    per_step = pq.read_table(out / "tokens.parquet").to_pylist()
    assert [r["step"] for r in per_step] == [1, 2, 3]
    uids_by_step = {}
    for row in per_step:
        s = row["step"]
        a, ma = _tokens(run, "adv_estimator=grpo", s)
        b, mb = _tokens(run, "adv_estimator=gae", s)
        both = (ma > 0) & (mb > 0)
        a, b = a[both], b[both]
        sa = np.where(np.abs(a) <= 1e-6, 0, np.sign(a))
        sb = np.where(np.abs(b) <= 1e-6, 0, np.sign(b))
        assert row["n_tokens"] == both.sum()
        assert row["sign_agreement"] == pytest.approx(np.mean(sa == sb))
        assert row["sign_flip_fraction"] == pytest.approx(np.mean(sa * sb < 0))
        assert row["pearson"] == pytest.approx(np.corrcoef(a, b)[0, 1])
        assert row["spearman"] == pytest.approx(np.corrcoef(_ranks(a), _ranks(b))[0, 1])
        assert row["adv_mean_abs_change"] == pytest.approx(np.mean(np.abs(b - a)))
        # token-mean in both: the effective weight is the advantage itself
        assert row["weight_mean_abs_change"] == pytest.approx(np.mean(np.abs(b - a)), rel=1e-6)
        batch = pq.read_table(run / "batches" / f"step_{s}.parquet").to_pylist()
        uids = [r["uid"] for r in batch]
        uids_by_step[s] = uids
        scores = {u: {r["score"] for r in batch if r["uid"] == u} for u in set(uids)}
        flat = sum(1 for v in scores.values() if len(v) == 1)
        assert row["groups"] == len(scores)
        assert row["groups_signal_a"] == len(scores) - flat  # GRPO: flat groups have no signal
        assert row["groups_signal_b"] == len(scores)  # GAE: the critic baseline gives every group some
        assert row["groups_signal_only_b"] == flat and row["groups_signal_only_a"] == 0
    total = sum(r["n_tokens"] for r in per_step)
    assert pair.summary["tokens"] == total
    assert pair.summary["sign_agreement"] == pytest.approx(sum(r["sign_agreement"] * r["n_tokens"] for r in per_step) / total)
    assert pair.summary["pearson_mean"] == pytest.approx(np.mean([r["pearson"] for r in per_step]))
    # metric deltas are B - A of the two scenarios' metrics
    ma = pq.read_table(run / "rldiag/scenarios/adv_estimator=grpo/metrics.parquet").to_pylist()
    mb = pq.read_table(run / "rldiag/scenarios/adv_estimator=gae/metrics.parquet").to_pylist()
    deltas = pq.read_table(out / "metrics.parquet").to_pylist()
    d = {(r["step"], r["metric"]): r["delta"] for r in deltas}
    for ra, rb in zip(ma, mb):
        want = rb["critic/advantages/mean"] - ra["critic/advantages/mean"]
        assert d[(ra["step"], "critic/advantages/mean")] == pytest.approx(want)
    meta = json.loads((out / "comparison.json").read_text())
    assert meta["settings_b"]["algorithm.adv_estimator"] == "gae" and meta["token_steps"] == [1, 2, 3]


def test_collapsed_group_signal_is_named(tmp_path):
    root = write_logged_run(tmp_path / "run", steps=2, seed=22, prompts=6, metrics=False)
    recompute(root, name="baseline", save_tokens=True)
    # the trainer's advantages: one group with signal (p1 of step 1) had its advantages zeroed
    uid_hit = None

    def collapse(step, rows, table):
        nonlocal uid_hit
        uids = table["uid"].to_pylist()
        live = [u for u in dict.fromkeys(uids) if any(abs(v) > 0 for r, uu in zip(rows, uids) if uu == u for v in r)]
        if step == 1:
            uid_hit = live[0]
        return [[0.0] * len(r) if (step == 1 and u == uid_hit) else r for r, u in zip(rows, uids)]

    rewrite_column(root, "advantages", collapse)
    rep = compare(root, "logged", "baseline")
    s1 = next(t for t in rep.tokens if t.step == 1)
    s2 = next(t for t in rep.tokens if t.step == 2)
    assert s1.groups_signal_only_b == 1 and s1.groups_signal_only_a == 0
    assert s2.groups_signal_only_a == s2.groups_signal_only_b == 0 and s2.sign_agreement == 1.0
    assert s1.sign_agreement < 1.0 and s1.sign_flip_fraction == 0.0
    groups = pq.read_table(rep.path / "groups.parquet").to_pylist()
    named = [g for g in groups if g["signal_a"] != g["signal_b"]]
    assert named == [{"step": 1, "uid": uid_hit, "signal_a": False, "signal_b": True}]
    # the batch files changed after "baseline" was computed, so compare recomputed it first
    assert rep.recomputed == ["baseline"]


def test_effective_weight_follows_the_aggregation_mode(tmp_path):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=1, seed=23, prompts=4, n=4))
    recompute(run, name="tm", save_tokens=True)
    recompute(run, {"actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"}, name="smtm", save_tokens=True)
    rep = compare(run, "tm", "smtm")
    t = rep.tokens[0]
    assert t.adv_mean_abs_change == 0.0 and t.sign_agreement == 1.0 and t.pearson == pytest.approx(1.0)
    table = pq.read_table(run / "rldiag/scenarios/tm/tokens/step_000001.parquet").to_pylist()
    n_tok = sum(sum(r["response_mask"]) for r in table)
    rows = len(table)
    changes = []
    for r in table:
        cnt = sum(r["response_mask"])
        for a, m in zip(r["advantages"], r["response_mask"]):
            if m:  # token-mean weight 1 vs seq-mean-token-mean's N / (B * T_i)
                changes.append(abs(a * n_tok / (rows * cnt) - a))
    assert t.weight_mean_abs_change == pytest.approx(np.mean(changes), rel=1e-5)
    assert t.weight_mean_abs_change > 0.01


def test_missing_tokens_are_recomputed(tmp_path):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=24))
    recompute(run, name="a")
    recompute(run, {"algorithm.adv_estimator": "rloo"}, name="b")
    with pytest.raises(Exception, match="no scenario"):
        compare(run, "a", "missing")
    rep = compare(run, "a", "b", recompute_missing=False)
    assert rep.tokens == [] and rep.steps_without_tokens == {"a": [1, 2], "b": [1, 2]} and rep.metrics
    rep = compare(run, "a", "b")
    assert rep.recomputed == ["a", "b"] and rep.token_steps == [1, 2]
    meta = json.loads((run / "rldiag/scenarios/b/scenario.json").read_text())
    assert meta["save_tokens"] and meta["overrides"] == {"algorithm.adv_estimator": "rloo"}
    assert compare(run, "a", "b").recomputed == []  # now up to date


def test_cli_compare_errors(tmp_path, capsys):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=1, seed=25))
    assert main(["compare", str(run), "baseline", "logged"]) == 1
    assert "no scenario 'baseline'" in capsys.readouterr().err
    assert main(["compare", str(run), "only-one"]) == 1
    assert main(["compare", str(run), "--estimators", "grpo,not_an_estimator"]) == 1
    assert "unknown advantage estimator" in capsys.readouterr().err


@pytest.mark.skipif("reinforce_plus_plus" not in ESTIMATORS, reason="reinforce_plus_plus not registered")
def test_three_estimators_json(tmp_path, capsys):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=1, seed=26))
    assert main(["compare", str(run), "--estimators", "grpo,rloo,reinforce_plus_plus", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [(p["a"], p["b"]) for p in d["pairs"]] == [
        ("adv_estimator=grpo", "adv_estimator=rloo"),
        ("adv_estimator=grpo", "adv_estimator=reinforce_plus_plus"),
        ("adv_estimator=rloo", "adv_estimator=reinforce_plus_plus"),
    ]
    grpo_rloo = d["pairs"][0]["summary"]
    assert grpo_rloo["sign_flip_fraction"] == 0.0 and grpo_rloo["spearman_mean"] == pytest.approx(1.0)
