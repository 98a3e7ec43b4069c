"""Capture from verl's own trainers (``rldiag.capture.verl``), tested with verl's own trainer-side
functions (advantages, KL in reward, rollout correction, data metrics) on synthetic batches, no
model and no GPU; then ``rldiag verify`` must find every logged number reproduced."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

pytest.importorskip("verl")
pytest.importorskip("omegaconf")

from omegaconf import OmegaConf  # noqa: E402

import rldiag.capture.verl as capture  # noqa: E402
from rldiag.analysis.verify import verify_run  # noqa: E402
from rldiag.capture.faults import CaptureWarning  # noqa: E402
from rldiag.errors import CaptureError  # noqa: E402
from tests.capture import verl_steps  # noqa: E402
from tests.capture.verl_steps import P, R  # noqa: E402

RC_RS = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1", "rollout_rs_threshold": 1.5,
         "bypass_mode": False}


def _config(estimator: str, n: int, kl_in_reward: bool = False, rollout_correction: dict | None = None,
            mode: str = "sync"):
    return OmegaConf.create({
        "algorithm": {"adv_estimator": estimator, "gamma": 0.99 if estimator == "gae" else 1.0,
                      "lam": 0.95 if estimator == "gae" else 1.0, "norm_adv_by_std_in_grpo": True,
                      "use_kl_in_reward": kl_in_reward, "kl_penalty": "kl",
                      "kl_ctrl": {"type": "fixed", "kl_coef": 0.05, "horizon": 10000, "target_kl": 0.1},
                      "rollout_correction": rollout_correction},
        "actor_rollout_ref": {"rollout": {"n": n, "calculate_log_probs": rollout_correction is not None}},
        "data": {"max_prompt_length": P, "max_response_length": R},
        "trainer": {"logger": ["console"], "use_v1": mode != "legacy", "v1": {"trainer_mode": mode}},
    })


def _trainer(cls, config, **attrs):
    from verl.trainer.ppo import core_algos
    from verl.utils.tracking import Tracking

    trainer = object.__new__(cls)  # no workers, no Ray: only what the advantage block reads
    trainer.config = config
    trainer.global_steps = 0
    trainer.use_critic = config.algorithm.adv_estimator == "gae"
    trainer.use_reference_policy = bool(config.algorithm.use_kl_in_reward)
    trainer.kl_ctrl_in_reward = core_algos.get_kl_controller(config.algorithm.kl_ctrl)
    trainer.logger = Tracking(project_name="p", experiment_name="e", default_backend=[])
    for k, v in attrs.items():
        setattr(trainer, k, v)
    return trainer


def _assert_match(run, *must_compare):
    report = verify_run(run, candidates=False)
    bad = {name: f.mismatches for name, f in report.fields.items() if f.mismatches}
    assert report.status == "match", bad
    compared = {name for name, f in report.fields.items() if f.compared}
    assert set(must_compare) <= compared, set(must_compare) - compared
    return report


# ---- legacy trainer ------------------------------------------------------------------------------


def test_legacy_gae_with_kl_in_reward_verifies_as_a_match(capture_into, monkeypatch):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=3, rows=8))
    run = capture_into()
    cfg = _config("gae", n=2, kl_in_reward=True, mode="legacy")
    _trainer(rt.RayPPOTrainer, cfg).fit()
    saved = yaml.safe_load((run / "run.yaml").read_text())
    import verl

    assert saved["rldiag"]["capture"] == {"verl_version": verl.__version__, "trainer": "legacy"}
    assert saved["algorithm"]["adv_estimator"] == "gae" and saved["algorithm"]["use_kl_in_reward"] is True
    table = pq.read_table(run / "batches" / "step_000002.parquet")
    assert {"values", "ref_log_prob", "token_level_rewards", "advantages", "returns", "prompt_length"} <= set(
        table.column_names)
    assert "loss_mask" not in table.column_names  # no rollout correction: response_mask is the rollout's
    _assert_match(run, "advantages", "returns", "token_level_rewards", "actor/reward_kl_penalty",
                  "critic/advantages/mean", "critic/returns/mean", "response_length/clip_ratio")


def test_legacy_rejection_sampling_keeps_the_rollout_mask_and_verifies(capture_into, monkeypatch):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=2, rows=8))
    run = capture_into()
    _trainer(rt.RayPPOTrainer, _config("grpo", n=4, rollout_correction=RC_RS, mode="legacy")).fit()
    table = pq.read_table(run / "batches" / "step_000001.parquet")
    kept = np.concatenate(table["loss_mask"].to_numpy(zero_copy_only=False))
    used = np.concatenate(table["response_mask"].to_numpy(zero_copy_only=False))
    assert kept.all() and not used.all()  # rejection removed tokens; loss_mask is the rollout's
    _assert_match(run, "response_mask", "advantages", "rollout_corr/rollout_rs_token_k1_masked_fraction",
                  "rollout_corr/rollout_is_mean")


def test_legacy_agent_loop_weight_versions_become_policy_version_columns(capture_into, monkeypatch):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=3, rows=8, versions=True))
    run = capture_into()
    _trainer(rt.RayPPOTrainer, _config("grpo", n=4, mode="legacy")).fit()
    for step in (1, 2, 3):
        table = pq.read_table(run / "batches" / f"step_{step:06d}.parquet")
        low, high = verl_steps.weight_versions(step, 8)
        assert table.schema.field("policy_version").type == pa.int64()
        assert table.schema.field("policy_version_min").type == pa.int64()
        assert table["policy_version"].to_pylist() == high and table["policy_version_min"].to_pylist() == low
        assert not {"max_global_steps", "min_global_steps"} & set(table.column_names)  # under rldiag's names only
    _assert_match(run, "advantages")  # the extra columns change nothing a recompute reads


def test_without_weight_versions_there_is_no_policy_version_column(capture_into, monkeypatch):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=1, rows=8))
    run = capture_into()
    _trainer(rt.RayPPOTrainer, _config("grpo", n=4, mode="legacy")).fit()
    names = set(pq.read_table(run / "batches" / "step_000001.parquet").column_names)
    assert not {"policy_version", "policy_version_min"} & names


# ---- V1 trainer ----------------------------------------------------------------------------------


@pytest.fixture
def v1(monkeypatch):
    return verl_steps.v1_trainer(monkeypatch)


def test_v1_grpo_with_rejection_sampling_verifies_as_a_match(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=3, rows=8))
    run = capture_into()
    Trainer_ = _trainer(Trainer, _config("grpo", n=4, rollout_correction=RC_RS))
    Trainer_.fit()
    saved = yaml.safe_load((run / "run.yaml").read_text())
    assert saved["rldiag"]["capture"]["trainer"] == "v1" and saved["rldiag"]["capture"]["trainer_mode"] == "sync"
    table = pq.read_table(run / "batches" / "step_000003.parquet")
    assert np.concatenate(table["loss_mask"].to_numpy(zero_copy_only=False)).all()
    assert not np.concatenate(table["response_mask"].to_numpy(zero_copy_only=False)).all()
    _assert_match(run, "response_mask", "advantages", "returns", "rollout_corr/rollout_rs_token_k1_masked_fraction",
                  "rollout_corr/rollout_is_mean", "critic/advantages/mean", "prompt_length/mean")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]


def test_v1_separate_async_parts_are_all_kept(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=2, rows=8, parts=4, padding=1))
    run = capture_into()
    _trainer(Trainer, _config("grpo", n=4, rollout_correction=RC_RS, mode="separate_async")).fit()
    table = pq.read_table(run / "batches" / "step_000002.parquet")
    # 4 parts of 8 rows, the last row of each a divisibility-padding row (dropped)
    assert table["part"].to_pylist() == [k for k in range(4) for _ in range(7)]
    assert table["uid"].to_pylist() == [f"s2-part{k}-p{i // 4}" for k in range(4) for i in range(7)]
    # each row's place in the trainer's padded batch, the parts one after the other
    assert table["batch_position"].to_pylist() == [8 * k + i for k in range(4) for i in range(7)]


def test_v1_row_tags_weight_versions_become_policy_version_columns(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=2, rows=8, parts=2, padding=1,
                                                              versions=True))
    run = capture_into()
    _trainer(Trainer, _config("grpo", n=4, mode="separate_async")).fit()
    table = pq.read_table(run / "batches" / "step_000002.parquet")
    low, high = verl_steps.weight_versions(2, 8)
    # two parts of 8 rows, the last a padding row (dropped): each part's first 7 rows' tags
    assert table["policy_version"].to_pylist() == high[:7] * 2
    assert table["policy_version_min"].to_pylist() == low[:7] * 2
    assert table.schema.field("policy_version").type == pa.int64()


def test_v1_rows_without_version_tags_get_no_policy_version_column(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=1, rows=4))
    run = capture_into()
    _trainer(Trainer, _config("grpo", n=2)).fit()
    names = set(pq.read_table(run / "batches" / "step_000001.parquet").column_names)
    assert not {"policy_version", "policy_version_min"} & names


def _overriding(Trainer, tq):
    class Overriding(Trainer):  # its own advantage step, not calling the base class's
        def _compute_advantage(self, batch, metrics):
            zeros = [r.float() * 0 for r in tq.kv_batch_get(keys=batch.keys, partition_id="train",
                                                           select_fields=["response_mask"])["response_mask"].unbind()]
            tq.put_rows(batch.keys, {"advantages": zeros, "returns": zeros})
            return batch

    return Overriding


def test_a_training_step_with_no_batch_captured_fails_loudly(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1

    Overriding = _overriding(Trainer, tq)
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=2, rows=8))
    run = capture_into()
    with pytest.warns(CaptureWarning, match="training step 1 ended with no batch captured") as seen:
        _trainer(Overriding, _config("grpo", n=4)).fit()  # training goes on to its last step
    assert sum("no batch captured" in str(w.message) for w in seen) == 1  # warned once
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    # counted in the trainer's metrics from the next log on (the fault is found at the end of step 1)
    assert "rldiag/capture/dropped_steps" not in lines[0]["data"]
    assert lines[1]["data"]["rldiag/capture/dropped_steps"] == 1 and lines[1]["data"]["rldiag/capture/errors"] == 0


def test_a_training_step_with_no_batch_captured_raises_when_asked(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1

    Overriding = _overriding(Trainer, tq)
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=1, rows=8))
    capture_into(on_error="raise")
    with pytest.raises(CaptureError, match="training step 1 ended with no batch captured"):
        _trainer(Overriding, _config("grpo", n=4)).fit()


def test_token_text_comes_from_the_trainers_tokenizer(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1

    class Vocab:
        def convert_ids_to_tokens(self, ids):
            return [f"<{i}>" for i in ids]

    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=1, rows=4))
    run = capture_into(tokens=True)
    _trainer(Trainer, _config("grpo", n=2), tokenizer=Vocab()).fit()
    table = pq.read_table(run / "batches" / "step_000001.parquet")
    keys = list(tq.rows)
    expected = [[f"<{int(i)}>" for i in tq.rows[k]["responses"]] for k in keys]
    assert table["response_tokens"].to_pylist() == expected
    # the prompts come back nested (unpadded) from the TransferQueue: each row's real tokens
    assert table["prompt_tokens"].to_pylist() == [[f"<{int(i)}>" for i in tq.rows[k]["prompts"]] for k in keys]
    assert [len(p) for p in table["prompt_tokens"].to_pylist()] == table["prompt_length"].to_pylist()


def test_v1_token_text_skips_the_padding_rows(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1

    class Vocab:
        def convert_ids_to_tokens(self, ids):
            return [f"<{i}>" for i in ids]

    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=1, rows=8, padding=2))
    run = capture_into(tokens=True)
    _trainer(Trainer, _config("grpo", n=2), tokenizer=Vocab()).fit()
    table = pq.read_table(run / "batches" / "step_000001.parquet")
    keys = list(tq.rows)[:6]  # the last two rows are the trainer's divisibility padding
    assert table["prompt_tokens"].to_pylist() == [[f"<{int(i)}>" for i in tq.rows[k]["prompts"]] for k in keys]
    assert table["response_tokens"].to_pylist() == [[f"<{int(i)}>" for i in tq.rows[k]["responses"]] for k in keys]
    _assert_match(run, "advantages")  # the text changes nothing a recompute reads


def test_legacy_token_text_of_prompts_and_responses(capture_into, monkeypatch):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")

    class Vocab:
        def convert_ids_to_tokens(self, ids):
            return [f"<{i}>" for i in ids]

    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=2, rows=8))
    run = capture_into(tokens=True)
    _trainer(rt.RayPPOTrainer, _config("grpo", n=4, mode="legacy"), tokenizer=Vocab()).fit()
    for step in (1, 2):
        table = pq.read_table(run / "batches" / f"step_{step:06d}.parquet")
        t = verl_steps.tensors(step, 8, 4)
        pl, rl = t["_lengths"]
        # verl left-pads the prompts: the real tokens are the last prompt_length ones
        assert table["prompt_tokens"].to_pylist() == [
            [f"<{int(i)}>" for i in t["prompts"][r, P - int(pl[r]):]] for r in range(8)]
        assert table["response_tokens"].to_pylist() == [
            [f"<{int(i)}>" for i in t["responses"][r, : int(rl[r])]] for r in range(8)]
        assert table["prompt_length"].to_pylist() == pl.tolist()
    _assert_match(run, "advantages")


def test_the_file_logger_on_the_capture_metrics_file_is_refused(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=1, rows=4))
    run = capture_into()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.jsonl"))
    cfg = _config("grpo", n=2)
    cfg.trainer.logger = ["console", "file"]
    with pytest.warns(CaptureWarning, match="VERL_FILE_LOGGER_PATH.*leaves metrics.jsonl to verl's file logger"):
        _trainer(Trainer, cfg).fit()
    assert (run / "batches" / "step_000001.parquet").is_file() and not (run / "metrics.jsonl").exists()


def test_the_file_logger_on_the_capture_metrics_file_raises_when_asked(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=1, rows=4))
    run = capture_into(on_error="raise")
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.jsonl"))
    cfg = _config("grpo", n=2)
    cfg.trainer.logger = ["console", "file"]
    with pytest.raises(CaptureError, match="VERL_FILE_LOGGER_PATH"):
        _trainer(Trainer, cfg).fit()


def test_uninstall_restores_verls_functions(monkeypatch, tmp_path, v1):
    tb, _, _ = v1
    import verl.trainer.ppo.rollout_corr_helper as rch
    from verl.utils.tracking import Tracking

    before = (tb.PPOTrainer.fit, tb.PPOTrainer._compute_advantage, Tracking.log,
              rch.compute_rollout_correction_and_add_to_batch)
    capture.install(tmp_path)
    assert tb.PPOTrainer._compute_advantage is not before[1] and Tracking.log is not before[2]
    capture.uninstall()
    assert (tb.PPOTrainer.fit, tb.PPOTrainer._compute_advantage, Tracking.log,
            rch.compute_rollout_correction_and_add_to_batch) == before


def test_two_environment_variables_turn_it_on_in_any_process_that_imports_verl(tmp_path):
    """verl imports the modules named in VERL_USE_EXTERNAL_MODULES in every process that imports
    it (its Ray actors included); with RLDIAG_CAPTURE_DIR set, the trainer modules are patched as
    they are imported, with no change to the training code."""
    import os
    import subprocess
    import sys

    code = ("import verl, sys\n"
            "assert 'rldiag.capture.verl' in sys.modules\n"
            "import verl.utils.tracking as t, verl.trainer.ppo.rollout_corr_helper as r\n"
            "import rldiag.capture.verl as c\n"
            "print(c._SESSION.run_dir, getattr(t.Tracking.log, '__rldiag_capture__', False),\n"
            "      getattr(r.compute_rollout_correction_and_add_to_batch, '__rldiag_capture__', False))\n")
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="rldiag.capture.verl", RLDIAG_CAPTURE_DIR=str(tmp_path / "run"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(tmp_path / "run"), "True", "True"]


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # never beside the executor tests' Ray cluster on 2 cores
def test_in_a_ray_actor_killed_mid_step_the_finished_steps_verify(tmp_path):
    """verl runs the trainer in a Ray actor: the capture is turned on there by the actor's
    environment alone, and an actor killed while step 3 is in flight (no exit hook, no close)
    leaves steps 1 and 2 complete on disk, verifying as a match."""
    pytest.importorskip("ray")
    pytest.importorskip("verl.trainer.ppo.ray_trainer")
    import subprocess
    import sys
    from pathlib import Path

    run, marker = tmp_path / "run", tmp_path / "step3-in-flight"
    script = Path(__file__).with_name("ray_trainer_actor.py")
    out = subprocess.run([sys.executable, str(script), str(run), str(marker)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "killed" in out.stdout, out.stderr[-3000:]
    from rldiag.io.rundir import RunDir, iter_metrics_lines

    assert [sf.step for sf in RunDir(run).step_files()][:2] == [1, 2]
    assert [s for s, _ in iter_metrics_lines(run / "metrics.jsonl")] == [1, 2]
    report = verify_run(run, steps="1:2", candidates=False)
    assert report.status == "match", {n: f.mismatches for n, f in report.fields.items() if f.mismatches}


# ---- faults in verl's own V1 loop: training goes on (rldiag.capture.faults) -------------------------


def _fault_lines(run):
    return {x["step"]: x["data"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_v1_a_full_disk_on_a_batch_write_is_warned_once_and_counted(capture_into, monkeypatch, v1):
    import errno
    import os

    from rldiag.capture.diskio import WriterDisk

    tb, tq, Trainer = v1
    real = WriterDisk.write_step

    def full(self, payload, compression, token_text):
        if payload.step in (2, 3):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(payload.path))
        return real(self, payload, compression, token_text)

    monkeypatch.setattr(WriterDisk, "write_step", full)
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=4, rows=8))
    run = capture_into(writer_options={"max_wait_s": 120.0})
    trainer = _trainer(Trainer, _config("grpo", n=4))
    with pytest.warns(CaptureWarning) as seen:
        trainer.fit()
    assert trainer.global_steps == 5  # every step trained
    faults = [str(w.message) for w in seen if issubclass(w.category, CaptureWarning)]
    assert len(faults) == 1 and "ENOSPC" in faults[0] and "step_000002.parquet" in faults[0]
    assert sorted(p.name for p in (run / "batches").iterdir()) == ["step_000001.parquet", "step_000004.parquet"]
    lines = _fault_lines(run)
    assert sorted(lines) == [1, 2, 3, 4]
    # a step's fault is in its own log when the writer got there first, else in the next one's
    # (the end-of-step barrier waits for it): never later
    counts = [lines[s].get("rldiag/capture/dropped_steps", 0) for s in (1, 2, 3, 4)]
    assert counts[0] == 0 and counts[1] in (0, 1) and counts[2] in (1, 2) and counts[3] == 2


def test_v1_a_capture_bug_drops_the_step_and_training_goes_on(capture_into, monkeypatch, v1):
    tb, tq, Trainer = v1
    real = capture.VerlCapture.capture_v1

    def buggy(self, tq_, meta):
        if self.step == 1:
            raise IndexError("a bug of the capture")
        return real(self, tq_, meta)

    monkeypatch.setattr(capture.VerlCapture, "capture_v1", buggy)
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=2, rows=8))
    run = capture_into()
    with pytest.warns(CaptureWarning, match="IndexError: a bug of the capture.*step 1's batch is not captured"):
        _trainer(Trainer, _config("grpo", n=4)).fit()
    assert sorted(p.name for p in (run / "batches").iterdir()) == ["step_000002.parquet"]
    lines = _fault_lines(run)
    assert lines[1]["rldiag/capture/dropped_steps"] == 1 and lines[2]["rldiag/capture/errors"] == 1


def test_v1_the_run_directory_removed_while_training_is_made_again(capture_into, monkeypatch, v1):
    import shutil

    tb, tq, Trainer = v1
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(tq, n_steps=3, rows=8))
    run = capture_into()
    from verl.utils.tracking import Tracking

    log = Tracking.log

    def log_then_remove(self, data, step, *args, **kwargs):
        out = log(self, data, step, *args, **kwargs)
        if step == 1:
            shutil.rmtree(run)
        return out

    # its own context: restored before the fixture's uninstall, or the teardown would put the
    # capture's wrapper back on verl's Tracking after uninstall took it off
    with monkeypatch.context() as mp, warnings.catch_warnings():
        mp.setattr(Tracking, "log", log_then_remove)
        warnings.simplefilter("error", CaptureWarning)  # nothing lost: nothing to warn
        _trainer(Trainer, _config("grpo", n=4)).fit()
    assert sorted(p.name for p in (run / "batches").iterdir()) == ["step_000002.parquet", "step_000003.parquet"]
    assert sorted(_fault_lines(run)) == [2, 3] and (run / "run.yaml").is_file()
