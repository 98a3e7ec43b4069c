"""Every policy loss, rollout-correction and micro-batch setting through ``rldiag recompute --set``
on a synthetic run (which carries rollout_log_probs), and what ``rldiag check`` says each needs."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest

from rldiag.analysis.check import check_run
from rldiag.cli.main import main
from rldiag.engine.policy_loss import POLICY_LOSSES
from rldiag.io.outputs import read_scenario
from rldiag.synth import SynthSpec, write_synth_run

LM = "actor_rollout_ref.actor.policy_loss.loss_mode"
RC = "algorithm.rollout_correction."


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_synth_run(tmp_path_factory.mktemp("lm") / "run", SynthSpec(steps=2, prompts=2, n=3, seed=5))


def recompute(run, *sets, name, extra=()):
    args = ["recompute", str(run), "--no-progress", "--name", name, *extra]
    for s in sets:
        args += ["--set", s]
    return main(args)


@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_every_loss_mode_is_accepted(run, loss):
    sets = [f"{LM}={loss}"] + (["actor_rollout_ref.actor.policy_loss.dro_beta=0.05"] if loss == "dro" else [])
    assert recompute(run, *sets, name=f"lm-{loss}") == 0
    meta, table = read_scenario(run, f"lm-{loss}")
    assert meta["steps_done"] == [1, 2]
    assert meta["settings"][LM] == loss
    assert all(math.isfinite(v) for v in table.column("actor/pg_loss").to_pylist())
    has_clipfrac = "actor/pg_clipfrac" in table.column_names
    assert has_clipfrac == (loss not in ("gpg", "dro", "kl_cov"))


def test_rollout_correction_settings_and_tokens(run):
    rc = recompute(run, f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=0.5_2.0", f"{RC}rollout_is_batch_normalize=true",
                   f"{RC}rollout_rs=token_k1,seq_mean_k3", f"{RC}rollout_rs_threshold=0.9_1.1,0.01",
                   name="rc", extra=["--save-tokens"])
    assert rc == 0
    meta, table = read_scenario(run, "rc")
    assert meta["settings"][f"{RC}rollout_is_threshold"] == "0.5_2.0"  # stays a string: IcePop
    for col in ("rollout_corr/rollout_is_oob_ratio", "rollout_corr/rollout_is_batch_norm_factor",
                "rollout_corr/rollout_rs_token_k1_masked_fraction", "rollout_corr/rollout_rs_seq_mean_k3_seq_max",
                "rollout_corr/chi2_seq", "rollout_corr/log_ppl_abs_diff"):
        assert col in table.column_names, col
    t = pq.read_table(run / "rldiag" / "scenarios" / "rc" / "tokens" / "step_000001.parquet")
    assert "rollout_is_weights" in t.column_names
    masked = sum(map(sum, t["response_mask"].to_pylist()))
    original = sum(map(sum, pq.read_table(run / "batches" / "step_1.parquet")["response_mask"].to_pylist()))
    frac = table.column("rollout_corr/rollout_rs_masked_fraction").to_pylist()[0]
    assert masked == pytest.approx(original * (1 - frac), abs=0.5)  # rejection rewrote the saved mask


def test_bypass_mode_with_reinforce_and_micro_batches(run):
    rc = recompute(run, f"{RC}bypass_mode=true", f"{LM}=bypass_mode",
                   "actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type=reinforce",
                   "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=sequence",
                   "rldiag.micro_batch_size=2", "rldiag.dp_size=2", name="bypass")
    assert rc == 0
    _, table = read_scenario(run, "bypass")
    assert "actor/rollout_corr/rollout_is_mean" in table.column_names
    assert not any(c.startswith("rollout_corr/") for c in table.column_names)  # skipped in bypass mode


def test_bad_settings_fail_early_with_the_valid_keys(run, capsys):
    assert recompute(run, f"{RC}rollout_rs=token_k4", f"{RC}rollout_rs_threshold=2", name="bad") == 1
    assert "valid: binary_kl" in capsys.readouterr().err
    assert recompute(run, f"{RC}rollout_is=tok", name="bad") == 1
    assert "sequence, token" in capsys.readouterr().err
    assert recompute(run, f"{LM}=dro", name="bad") == 1
    assert "dro_beta" in capsys.readouterr().err
    assert recompute(run, "rldiag.dp_size=0", name="bad") == 1
    assert recompute(run, "algorithm.rollout_correction.loss_type=reinforce", name="bad") == 1
    assert "actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type" in capsys.readouterr().err


def test_check_lists_every_loss_mode_and_the_correction_needs(tmp_path):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=1, prompts=2, n=2))
    rep = check_run(run)
    for loss in POLICY_LOSSES.names():
        assert rep.metric_families[f"loss_mode={loss} (actor/*)"] == []
    path = run / "batches" / "step_1.parquet"
    t = pq.read_table(path)
    pq.write_table(t.drop(["rollout_log_probs", "log_probs"]), path)
    rep = check_run(run)
    assert rep.metric_families["loss_mode=gspo (actor/*)"] == ["log_probs"]
    assert rep.metric_families["algorithm.rollout_correction rollout_is / rollout_rs (IS weights, rejection)"] == [
        "rollout_log_probs"]
    assert rep.metric_families["algorithm.rollout_correction.bypass_mode (old_log_probs := rollout_log_probs)"] == [
        "rollout_log_probs", "log_probs"]
