"""``rldiag verify``: a run logged by an independent reference matches; planted setting
differences are caught, located and named; exit codes 0 / 1 / 2 through the CLI."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from rldiag.analysis.tolerance import Tol, Tolerances
from rldiag.analysis.verify import verify_run
from rldiag.cli.main import main
from tests.analysis.reference import logged_step, rewrite_column, write_logged_run

TOKEN_FIELDS = {"token_level_rewards", "advantages", "returns"}


def test_reference_run_matches(tmp_path, capsys):
    root = write_logged_run(tmp_path / "run", steps=3, seed=1)
    assert main(["verify", str(root)]) == 0
    rep = verify_run(root)
    assert rep.status == "match" and rep.exit_code == 0
    assert TOKEN_FIELDS <= set(rep.fields)
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "critic/advantages/mean", "actor/entropy_loss"):
        assert rep.fields[name].compared == 3, name
    total_tokens = sum(len(r) for f in sorted((root / "batches").iterdir())
                       for r in pq.read_table(f, columns=["response_mask"])["response_mask"].to_pylist())
    assert rep.fields["advantages"].compared == total_tokens
    assert rep.steps_checked == [1, 2, 3]
    assert rep.not_checked["timing/step"] == "rldiag does not compute this metric"
    assert rep.fields["advantages"].max_abs_err < 1e-6
    assert not rep.candidates and rep.first_mismatch is None


def test_wrong_std_normalisation_is_located_and_named(tmp_path):
    # the trainer ran Dr. GRPO (no std), the config says the default (std normalisation)
    root = write_logged_run(tmp_path / "run", steps=3, seed=2, logged={"norm_by_std": False})
    rep = verify_run(root)
    assert rep.exit_code == 1
    first = rep.first_mismatch
    assert first.field == "advantages" and first.step == 1
    # the located token really differs between the two settings, and has the logged value
    table = pq.read_table(root / "batches" / "step_1.parquet")
    logged = table["advantages"].to_pylist()[first.row][first.token]
    assert first.expected == pytest.approx(logged)
    cols, _ = logged_step(table, norm_by_std=True)
    assert first.actual == pytest.approx(cols["advantages"][first.row][first.token], rel=1e-5)
    assert rep.fields["token_level_rewards"].mismatches == 0
    assert rep.fields["actor/pg_clipfrac"].mismatches == 0  # scaling advantages keeps their signs
    best = rep.candidates[0]
    assert best.overrides == {"algorithm.norm_adv_by_std_in_grpo": False}
    assert best.matches_all and {"advantages", "returns", "actor/pg_loss"} <= set(best.fixes)
    assert "norm_adv_by_std_in_grpo=false" in best.describe()


def test_wrong_estimator_is_named(tmp_path, capsys):
    root = write_logged_run(tmp_path / "run", steps=2, seed=4, logged={"estimator": "rloo"})
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "adv_estimator=rloo" in out and "MISMATCH" in out
    rep = verify_run(root)
    full = [c.overrides for c in rep.candidates if c.matches_all]
    assert {"algorithm.adv_estimator": "rloo"} in full
    assert {"algorithm.norm_adv_by_std_in_grpo": False} not in full  # Dr. GRPO is not RLOO


def test_wrong_aggregation_mode_is_named(tmp_path):
    root = write_logged_run(tmp_path / "run", steps=2, seed=5, logged={"agg": "seq-mean-token-mean"})
    rep = verify_run(root)
    bad = {f.field for f in rep.fields.values() if f.mismatches}
    assert bad == {"actor/pg_loss", "actor/entropy_loss"}
    assert rep.first_mismatch.row is None and rep.first_mismatch.field == "actor/entropy_loss"
    full = [c.overrides for c in rep.candidates if c.matches_all]
    assert full == [{"actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"}]


def test_overrides_confirm_a_candidate(tmp_path):
    root = write_logged_run(tmp_path / "run", steps=2, seed=6, logged={"agg": "seq-mean-token-mean"})
    assert main(["verify", str(root), "--set", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]) == 0


def _ppo_terms(row, adv):
    """(per-token PPO loss with verl's dual clip, clipped?) of one row's masked tokens."""
    out = []
    for t, mk in enumerate(row["response_mask"]):
        if mk:
            a = adv[t]
            ratio = np.exp(row["log_probs"][t] - row["old_log_probs"][t])
            l1, l2 = -a * ratio, -a * np.clip(ratio, 0.8, 1.2)
            loss = max(l1, l2)
            if a < 0:
                loss = min(loss, -a * 3.0)
            out.append((loss, l2 > l1))
    return out


def _relog(root, metrics_of) -> None:
    """Rewrite the run's metrics.jsonl: each step's ``metrics_of(rows, per-token PPO terms)``, the
    terms (loss, clipped?) of every row's masked tokens under the reference's advantages."""
    lines = []
    for f in sorted((root / "batches").iterdir()):
        rows = pq.read_table(f).to_pylist()
        cols, _ = logged_step(pq.read_table(f))
        terms = [_ppo_terms(r, a) for r, a in zip(rows, cols["advantages"])]
        lines.append(json.dumps({"step": int(f.stem.split("_")[1]), "data": metrics_of(rows, terms)}))
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_micro_batch_averaged_clipfrac_is_named(tmp_path):
    root = write_logged_run(tmp_path / "run", steps=2, seed=7, drift=0.3)
    # verl: the clip fraction of each micro-batch of 4 rows, then their plain mean
    _relog(root, lambda rows, terms: {"actor/pg_clipfrac": float(np.mean(
        [np.mean([c for row in terms[s:s + 4] for _, c in row]) for s in range(0, len(rows), 4)]))})
    rep = verify_run(root)
    assert rep.fields["actor/pg_clipfrac"].mismatches >= 1
    assert any(c.overrides == {"rldiag.micro_batch_size": 4} and c.matches_all for c in rep.candidates)


def test_bf16_tolerances(tmp_path):
    root = write_logged_run(tmp_path / "run", steps=2, seed=8, metrics=False)
    for name in ("advantages", "returns"):  # the logged values went through ~bf16 rounding
        rewrite_column(root, name, lambda step, rows, table: [[v * (1 + 3e-3) for v in r] for r in rows])
    assert main(["verify", str(root), "--no-candidates"]) == 1
    assert main(["verify", str(root), "--bf16"]) == 0
    assert main(["verify", str(root), "--rtol", "1e-2"]) == 0
    assert main(["verify", str(root), "--tol", "advantages=1e-2", "--no-candidates"]) == 1  # returns still tight
    assert main(["verify", str(root), "--tol", "advantages=1e-2", "--tol", "ret*=1e-2,0"]) == 0
    tols = Tolerances(fields={"ret*": Tol(1e-2, 0.0)})
    rep = verify_run(root, tolerances=tols, candidates=False)
    assert rep.fields["returns"].ok and not rep.fields["advantages"].ok
    assert rep.fields["advantages"].max_rel_err == pytest.approx(3e-3 / (1 + 3e-3), rel=1e-4)  # relative to the logged value


def test_masked_only_ignores_tool_tokens(tmp_path):
    root = write_logged_run(tmp_path / "run", steps=2, seed=9, metrics=False, tool_prob=0.8)

    def plant(step, rows, table):  # a trainer that wrote garbage at tool-observation tokens
        masks = table["response_mask"].to_pylist()
        return [[v if m else 7.0 for v, m in zip(r, mk)] for r, mk in zip(rows, masks)]

    rewrite_column(root, "advantages", plant)
    rep = verify_run(root, candidates=False)
    assert rep.fields["advantages"].mismatches > 0
    row, tok = rep.first_mismatch.row, rep.first_mismatch.token
    assert pq.read_table(root / "batches" / "step_1.parquet")["response_mask"].to_pylist()[row][tok] == 0
    assert rep.first_mismatch.expected == 7.0
    assert verify_run(root, masked_only=True).status == "match"


def test_json_report(tmp_path, capsys):
    root = write_logged_run(tmp_path / "run", steps=2, seed=10, logged={"norm_by_std": False})
    assert main(["verify", str(root), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["status"] == "mismatch" and d["exit_code"] == 1
    fm = d["first_mismatch"]
    assert {"step", "row", "token", "field", "expected", "actual"} <= set(fm) and fm["field"] == "advantages"
    adv = d["fields"]["advantages"]
    assert adv["mismatches"] > 0 and adv["max_abs_err"] > 0.1 and adv["rtol"] == 1e-5 and adv["atol"] == 1e-6
    assert any(c["overrides"] == {"algorithm.norm_adv_by_std_in_grpo": False} and c["matches_all"] for c in d["candidates"])


def test_loss_mask_makes_the_mask_an_exact_field(tmp_path):
    root = write_logged_run(tmp_path / "run", steps=1, seed=11, metrics=False)
    f = root / "batches" / "step_1.parquet"
    table = pq.read_table(f)
    table = table.append_column("loss_mask", table["response_mask"])
    pq.write_table(table, f)
    rep = verify_run(root)
    assert rep.fields["response_mask"].kind == "exact" and rep.fields["response_mask"].rtol == 0
    assert rep.fields["response_mask"].compared > 0 and rep.status == "match"


# ---- exit 2: the run cannot be verified -------------------------------------------------------


def test_nothing_logged_exits_2(tmp_path, capsys):
    root = write_logged_run(tmp_path / "run", steps=2, columns=(), metrics=False)
    assert main(["verify", str(root)]) == 2
    rep = verify_run(root)
    assert rep.status == "unverifiable" and rep.compared == 0
    assert rep.not_checked["advantages"] == "not in the batch files"


def test_missing_estimator_input_exits_2(tmp_path):
    # gae needs `values`, which this run does not have
    root = write_logged_run(tmp_path / "run", steps=2, critic=False, run_settings={"algorithm": {"adv_estimator": "gae"}})
    assert main(["verify", str(root)]) == 2
    rep = verify_run(root)
    assert set(rep.steps_unverifiable) == {1, 2} and "values" in rep.steps_unverifiable[1]


def test_malformed_logged_column_exits_2(tmp_path):
    root = write_logged_run(tmp_path / "run", steps=2, metrics=False)
    rewrite_column(root, "returns", lambda step, rows, t: [r + [0.0] if i == 3 and step == 2 else r for i, r in enumerate(rows)])
    rep = verify_run(root)
    assert rep.exit_code == 2 and rep.steps_checked == [1]
    assert "row 3" in rep.steps_unverifiable[2] and "returns" in rep.steps_unverifiable[2]


def test_bad_input_and_unknown_setting_exit_2(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "missing")]) == 2
    root = write_logged_run(tmp_path / "run", steps=1)
    assert main(["verify", str(root), "--estimator", "nope"]) == 2
    assert "unknown advantage estimator" in capsys.readouterr().err
    assert main(["verify", str(root), "--json", "--tol", "bad"]) == 2


def test_a_mismatch_wins_over_an_unverifiable_step(tmp_path):
    root = write_logged_run(tmp_path / "run", steps=2, seed=12, logged={"norm_by_std": False}, metrics=False)
    f = root / "batches" / "step_2.parquet"
    f.write_bytes(f.read_bytes()[:100])  # truncated file
    rep = verify_run(root)
    assert 2 in rep.steps_unverifiable and rep.exit_code == 1


def test_the_verl_release_that_matches_is_named(tmp_path):
    # REINFORCE++ on tool spans, logged by verl 0.8.0 (the reset at mask 0), the run recording no
    # version: verify under the snapshot mismatches and names rldiag.verl_version=0.8.0
    from rldiag.scenario.recompute import recompute
    from rldiag.synth import SynthSpec, write_synth_run

    cfg = {"algorithm": {"adv_estimator": "reinforce_plus_plus", "gamma": 0.9}}
    root = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=5, tool_prob=0.8, config=cfg, write_metrics=False))
    recompute(root, {"rldiag.verl_version": "0.8.0"}, name="old", save_tokens=True)
    tokens = {int(p.stem.split("_")[1]): pq.read_table(p) for p in (root / "rldiag/scenarios/old/tokens").glob("*.parquet")}
    for f in sorted((root / "batches").iterdir()):
        table = pq.read_table(f)
        t = tokens[int(f.stem.split("_")[1])]
        for name in ("advantages", "returns"):
            table = table.append_column(name, t[name])
        pq.write_table(table, f)
    rep = verify_run(root)
    assert rep.exit_code == 1 and rep.fields["advantages"].mismatches > 0
    full = [c.overrides for c in rep.candidates if c.matches_all]
    assert full[0] == {"rldiag.verl_version": "0.8.0"}
    assert "rldiag.verl_version=0.8.0" in rep.candidates[0].describe()
    assert verify_run(root, overrides={"rldiag.verl_version": "0.8.0"}).exit_code == 0
    # a run that records its release (a top-level verl_version in run.yaml) verifies untouched
    (root / "run.yaml").write_text(yaml.safe_dump({**cfg, "verl_version": "0.8.0"}))
    assert verify_run(root).exit_code == 0


def test_a_later_first_step_replays_the_adaptive_kl_controller(tmp_path, capsys):
    # the reward-KL coefficient of step 3 depends on steps 1 and 2: verify --steps 3: replays them
    # (as the recompute does), so the logged token-level rewards and coefficient match
    from tests.analysis.logged_runs import ADAPTIVE_KL, write_self_logged_run

    root, logged = write_self_logged_run(tmp_path / "run", ADAPTIVE_KL)
    coef = {int(r["step"]): r["actor/reward_kl_penalty_coeff"] for r in logged}
    assert coef[1] == pytest.approx(0.1) and coef[3] == pytest.approx(0.1 * 0.968 * 0.968, rel=1e-4)
    rep = verify_run(root, steps="3:")
    assert rep.status == "match" and rep.steps_checked == [3] and not rep.steps_unverifiable
    assert rep.fields["actor/reward_kl_penalty_coeff"].compared == 1
    assert rep.fields["token_level_rewards"].compared > 0 and rep.fields["token_level_rewards"].mismatches == 0
    assert main(["verify", str(root), "--steps", "2:", "--no-progress"]) == 0
    assert "all compared values match" in capsys.readouterr().out


def test_the_layout_a_config_does_not_name_is_found(tmp_path, capsys):
    # logged under mini-batches of 8 rows and micro-batches of 2 (16 rows a step): the clip fraction
    # is the mean over micro-batches, pg_loss each mini-batch's token mean, then their mean; the
    # run's config names no batch size, so only the two together match
    root = write_logged_run(tmp_path / "run", steps=2, seed=11, drift=0.3)

    def metrics_of(rows, terms):
        fracs = [np.mean([c for row in terms[s:s + 2] for _, c in row]) for s in range(0, len(rows), 2)]
        losses = [np.mean([x for row in terms[s:s + 8] for x, _ in row]) for s in range(0, len(rows), 8)]
        return {"actor/pg_clipfrac": float(np.mean(fracs)), "actor/pg_loss": float(np.mean(losses))}

    _relog(root, metrics_of)
    rep = verify_run(root)
    assert rep.status == "mismatch" and rep.layout == "V1, dp 1; actor: whole step, one micro-batch"
    full = [c for c in rep.candidates if c.matches_all]
    assert [c.overrides for c in full] == [{"rldiag.mini_batch_size": 8, "rldiag.micro_batch_size": 2}]
    assert full[0].describe().endswith("(layout: V1, dp 1, padded to a multiple of 8; actor: mini 8 rows, micro 2 rows)")
    assert main(["verify", str(root)]) == 1
    assert "batch layout: V1, dp 1" in capsys.readouterr().out


def test_layout_candidates_follow_what_the_config_says():
    from rldiag.analysis.candidates import candidate_overrides
    from rldiag.config.settings import resolve_settings

    a = "actor_rollout_ref.actor."
    fields = {"actor/pg_clipfrac"}
    bare = candidate_overrides(resolve_settings(overrides={"rldiag.dp_size": 2}), fields, set(), 16)
    assert {a + "use_dynamic_bsz": True} in bare and {a + "shuffle": True} in bare
    assert {a + "use_dynamic_bsz": True, a + "ppo_max_token_len_per_gpu": 8192} in bare
    assert {"rldiag.rows_balanced": True} in bare  # V1 balances every step: the rows as stored instead
    assert {"trainer.balance_batch": False} not in bare  # which V1 does not read
    assert {"rldiag.mini_batch_size": 8, "rldiag.micro_batch_size": 2} in bare
    said = resolve_settings(config={"actor_rollout_ref": {"actor": {
        "use_dynamic_bsz": False, "shuffle": False, "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 2}}},
        overrides={"rldiag.dp_size": 2, "trainer.use_v1": False})
    told = candidate_overrides(said, fields, set(), 16)
    assert not [c for c in told if a + "use_dynamic_bsz" in c or a + "shuffle" in c]
    assert not [c for c in told if len(c) == 2 and c.get("rldiag.mini_batch_size")]
    assert {"trainer.balance_batch": False} in told  # the legacy trainer reads it


# ---- an exactly tied group: the whitened constant is rounding noise ---------------------------

TIE, VERL_NOISE = 0.1, -0.007393687  # verl 0.9.1's GRPO on 16 rows of 0.1 (rldiag: -0.0147)


def _tied_run(tmp_path, logged_value):
    """A GRPO run (groups of 16) whose first group scores 0.1 on every row and whose logged
    advantages and returns there are ``logged_value(row, token)`` at mask-1 tokens (0 elsewhere)."""
    root = write_logged_run(tmp_path / "run", steps=1, seed=21, metrics=False, prompts=3, n=16)
    f = root / "batches" / "step_1.parquet"
    table = pq.read_table(f)
    first = table["uid"][0].as_py()
    tied = [u == first for u in table["uid"].to_pylist()]
    masks = table["response_mask"].to_pylist()

    def scores(_step, rows, _table):
        return [[0.0] * (len(r) - 1) + [TIE] if t else r for r, t in zip(rows, tied)]

    def advantages(_step, rows, _table):
        return [[logged_value(i, j) * m for j, m in enumerate(masks[i])] if t else r
                for i, (r, t) in enumerate(zip(rows, tied))]

    def row_score(_step, rows, _table):
        return [TIE if t else r for r, t in zip(rows, tied)]

    for name, fn in (("score", row_score), ("token_level_rewards", scores), ("advantages", advantages),
                     ("returns", advantages)):
        rewrite_column(root, name, fn)
    return root, sum(sum(m) for m, t in zip(masks, tied) if t)


def test_a_whitened_tie_is_rounding_noise_not_a_mismatch(tmp_path, capsys):
    root, tied_tokens = _tied_run(tmp_path, lambda i, j: VERL_NOISE)
    rep = verify_run(root)
    adv = rep.fields["advantages"]
    assert rep.status == "match" and adv.mismatches == 0
    assert adv.noise == tied_tokens and rep.fields["returns"].noise == tied_tokens
    assert 1e-3 < adv.noise_max_abs_err < 0.05 and adv.max_abs_err < 1e-5
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"advantages: {tied_tokens} values differ by rounding noise of a whitened constant" in out


@pytest.mark.parametrize("logged_value", [lambda i, j: VERL_NOISE * (1 + i % 2), lambda i, j: 1.5],
                         ids=["not one constant", "not below 1"])
def test_a_tied_group_logged_otherwise_is_a_mismatch(tmp_path, logged_value):
    root, tied_tokens = _tied_run(tmp_path, logged_value)
    rep = verify_run(root, candidates=False)
    assert rep.status == "mismatch" and rep.fields["advantages"].noise == 0
    assert rep.fields["advantages"].mismatches == tied_tokens


def test_whitened_constant_noise_needs_one_constant_per_side_on_two_rows():
    from rldiag.analysis.tolerance import whitened_constant_noise

    # positions: segment 0 = rows 0, 1 (tied); segment 1 = row 2 alone; segment 2 = rows 3, 4 not constant
    seg = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    rows = np.array([0, 0, 1, 1, 2, 2, 3, 4])
    expected = np.array([-0.0074, -0.0074, -0.0074, 0.0, 0.3, 0.3, 0.2, -0.2])
    actual = np.array([-0.0147, -0.0147, -0.0147, 0.0, 0.5, 0.5, 0.25, -0.25])
    on = np.array([True, True, True, False, True, True, True, True])
    got = whitened_constant_noise(expected, actual, on, rows, seg)
    assert got.tolist() == [True, True, True, False, False, False, False, False]
    assert not whitened_constant_noise(expected, actual, np.zeros(8, bool), rows, seg).any()
