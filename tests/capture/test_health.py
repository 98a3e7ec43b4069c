"""The doctor in the capture hook (``RLDIAG_DOCTOR=1``): health keys in the metrics verl's own
``Tracking`` logs (its file backend read back), the one-step lag of recomputed signals, a failing
rule skipped, ``RLDIAG_DOCTOR_STOP`` ending verl's loops, and no keys without the switch."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("omegaconf")

import rldiag.capture.verl as capture  # noqa: E402
from rldiag.capture.health import FINDINGS_KEY, PREFIX, single_thread_torch  # noqa: E402
from rldiag.capture.writer import RunWriter  # noqa: E402
from rldiag.doctor.live import LiveDoctor  # noqa: E402
from rldiag.doctor.rule import Rule  # noqa: E402
from rldiag.errors import CaptureError  # noqa: E402
from tests.capture import verl_steps  # noqa: E402
from tests.capture.test_verl import _config, _trainer  # noqa: E402

CLIPFRAC = {1: 0.1, 2: 0.9, 3: 0.9, 4: 0.05}  # clipfrac_high: > 0.3 at >= half the steps so far


def clipfrac(step: int) -> dict:
    return {"actor/pg_clipfrac": CLIPFRAC.get(step, 0.05), "actor/ppo_kl": 0.01}


@pytest.fixture
def logged(tmp_path, monkeypatch):
    """A trainer factory whose ``Tracking`` has verl's console and file backends; ``lines()`` reads
    the file backend's output back."""
    path = tmp_path / "verl_file_logger.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))

    def make(cls, config, **attrs):
        from verl.utils.tracking import Tracking

        trainer = _trainer(cls, config, **attrs)
        trainer.logger = Tracking(project_name="p", experiment_name="e", default_backend=["console", "file"])
        return trainer

    def lines() -> dict[int, dict]:
        return {x["step"]: x["data"] for x in map(json.loads, path.read_text().splitlines())}

    make.lines = lines
    return make


def _health(data: dict) -> dict:
    return {k: v for k, v in data.items() if k.startswith(PREFIX)}


def test_a_rule_on_logged_metrics_shows_in_the_log_of_the_step_it_fires(capture_into, logged, monkeypatch):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=4, rows=8, extra=clipfrac))
    monkeypatch.setenv("RLDIAG_DOCTOR", "1")
    run = capture_into()
    logged(rt.RayPPOTrainer, _config("grpo", n=4, mode="legacy")).fit()
    lines = logged.lines()
    assert sorted(lines) == [1, 2, 3, 4]
    # clipfrac_high (warning): 0/1, 1/2, 2/3, 2/4 of the steps above 0.3; it fires from 1/2 on
    assert [lines[s][PREFIX + "clipfrac_high"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert [lines[s][PREFIX + "ppo_kl_high"] for s in (1, 2, 3, 4)] == [0, 0, 0, 0]
    for s in (1, 2, 3, 4):
        levels = {k: v for k, v in _health(lines[s]).items() if k != FINDINGS_KEY}
        # every finding counted once per active rule (no rule here gives more than one)
        assert lines[s][FINDINGS_KEY] == sum(1 for v in levels.values() if v > 0)
        assert set(levels.values()) <= {0, 1, 2}
    assert lines[2][FINDINGS_KEY] == lines[1][FINDINGS_KEY] + 1  # clipfrac_high is the one that came
    # the capture's metrics.jsonl holds what the trainer logged, health keys included
    own = {x["step"]: x["data"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert {s: _health(d) for s, d in own.items()} == {s: _health(d) for s, d in lines.items()}


def test_a_critical_rule_logs_level_two(capture_into, logged, monkeypatch):
    tb, tq, Trainer = verl_steps.v1_trainer(monkeypatch)
    kl = {1: 0.01, 2: 0.01, 3: 0.5}  # ppo_kl_high (critical): |kl| > 0.1 at >= 30 % of the steps
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(
        tq, n_steps=3, rows=8, extra=lambda s: {"actor/ppo_kl": kl[s], "actor/pg_clipfrac": 0.1}))
    capture_into(doctor=True)
    logged(Trainer, _config("grpo", n=4)).fit()
    lines = logged.lines()
    assert [lines[s][PREFIX + "ppo_kl_high"] for s in (1, 2, 3)] == [0, 0, 2]
    assert lines[3][FINDINGS_KEY] == lines[2][FINDINGS_KEY] + 1


class Recording(LiveDoctor):
    """The default doctor, keeping what it was given (the recomputed values with their step)."""

    def __init__(self, settings, rules):
        super().__init__(settings, rules)
        self.calls: list[tuple[str, int]] = []

    def add_recomputed(self, step, values):
        self.calls.append(("recomputed", step))
        super().add_recomputed(step, values)

    def add_logged(self, step, values):
        self.calls.append(("logged", step))
        super().add_logged(step, values)


CENTRE = "rldiag/advantages/centre_offset"


def test_a_recomputed_signal_rule_shows_one_step_later_with_that_steps_value(capture_into, logged, monkeypatch):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=3, rows=8))
    # fires as soon as one recomputed value exists
    rule = Rule(id="centre_seen", kind="threshold", title="t", why="w", metric=CENTRE, source="recomputed",
                params={"above": -1.0, "stat": "last", "abs": True})
    doctors: list[Recording] = []

    def make(settings, rules):
        doctors.append(Recording(settings, rules))
        return doctors[-1]

    run = capture_into(doctor=True, rules=[rule], make_doctor=make)
    logged(rt.RayPPOTrainer, _config("grpo", n=4, mode="legacy")).fit()
    lines = logged.lines()
    assert [lines[s][PREFIX + "centre_seen"] for s in (1, 2, 3)] == [0, 1, 1]
    assert [lines[s][FINDINGS_KEY] for s in (1, 2, 3)] == [0, 1, 1]
    # step N's recompute is taken in at the log of N + 1, before that step's logged metrics
    assert doctors[0].calls == [("logged", 1), ("recomputed", 1), ("logged", 2), ("recomputed", 2), ("logged", 3)]
    # the values are step 1's and step 2's own, as `rldiag recompute` gives them
    from rldiag.scenario.recompute import recompute

    full = {int(r["step"]): r[CENTRE] for r in recompute(run, {}).metrics}
    seen = doctors[0].table.series(CENTRE, "recomputed")
    assert seen.steps.tolist() == [1, 2] and seen.values.tolist() == [full[1], full[2]]


def test_a_rule_that_raises_is_skipped_and_reported_once(capture_into, logged, monkeypatch, caplog):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=4, rows=8, extra=clipfrac))
    broken = Rule(id="broken", kind="threshold", title="t", why="w", metric="actor/pg_clipfrac",
                  params={"above": "not a number"})  # built in code, unchecked: comparing raises
    clip = Rule(id="clipfrac_high", kind="threshold", title="t", why="w", metric="actor/pg_clipfrac",
                params={"above": 0.3, "min_fraction": 0.5})
    capture_into(doctor=True, rules=[broken, clip])
    with caplog.at_level(logging.WARNING, logger="rldiag.capture.health"):
        logged(rt.RayPPOTrainer, _config("grpo", n=4, mode="legacy")).fit()
    lines = logged.lines()
    assert sorted(lines) == [1, 2, 3, 4]  # training went on
    assert [lines[s][PREFIX + "clipfrac_high"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert [lines[s][PREFIX + "broken"] for s in (1, 2, 3, 4)] == [0, 0, 0, 0]
    assert [lines[s][FINDINGS_KEY] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    reports = [r for r in caplog.records if "rule broken failed" in r.getMessage()]
    assert len(reports) == 1 and "step 1" in reports[0].getMessage()


def test_a_failed_recompute_is_reported_once_and_training_goes_on(capture_into, logged, monkeypatch, caplog):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=3, rows=8, extra=clipfrac))
    import rldiag.capture.health as health

    def broken_recompute(self, step):
        raise RuntimeError(f"no engine for step {step}")

    monkeypatch.setattr(health.StepRecompute, "__call__", broken_recompute)
    capture_into(doctor=True)
    with caplog.at_level(logging.WARNING, logger="rldiag.capture.health"):
        logged(rt.RayPPOTrainer, _config("grpo", n=4, mode="legacy")).fit()
    lines = logged.lines()
    assert [lines[s][PREFIX + "clipfrac_high"] for s in (1, 2, 3)] == [0, 1, 1]  # logged rules still run
    assert [lines[s][PREFIX + "advantages_not_centred"] for s in (1, 2, 3)] == [0, 0, 0]
    reports = [r.getMessage() for r in caplog.records if "recompute of step" in r.getMessage()]
    assert len(reports) == 1 and "no engine for step 1" in reports[0]


def test_without_rldiag_doctor_no_key_is_added(capture_into, logged, monkeypatch):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=2, rows=8, extra=clipfrac))
    monkeypatch.delenv("RLDIAG_DOCTOR", raising=False)
    monkeypatch.setenv("RLDIAG_DOCTOR_STOP", "warning")  # no doctor: nothing to stop on
    run = capture_into()
    logged(rt.RayPPOTrainer, _config("grpo", n=4, mode="legacy")).fit()
    lines = logged.lines()
    assert sorted(lines) == [1, 2] and not any(_health(d) for d in lines.values())
    own = [json.loads(x)["data"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert not any(_health(d) for d in own)


# ---- stopping -------------------------------------------------------------------------------------


def test_stop_on_critical_ends_the_v1_loop_after_that_step(capture_into, logged, monkeypatch, caplog):
    tb, tq, Trainer = verl_steps.v1_trainer(monkeypatch)
    kl = {3: 0.5}
    monkeypatch.setattr(tb.PPOTrainer, "fit", verl_steps.v1_fit(
        tq, n_steps=6, rows=8, extra=lambda s: {"actor/ppo_kl": kl.get(s, 0.01), "actor/pg_clipfrac": 0.9}))
    monkeypatch.setenv("RLDIAG_DOCTOR", "1")
    monkeypatch.setenv("RLDIAG_DOCTOR_STOP", "critical")
    run = capture_into()
    trainer = logged(Trainer, _config("grpo", n=4))
    with caplog.at_level(logging.WARNING, logger="rldiag.capture.health"):
        trainer.fit()
    lines = logged.lines()
    # clipfrac_high (a warning) is active from step 1 and does not stop; ppo_kl_high (critical) does
    assert [lines[s][PREFIX + "clipfrac_high"] for s in sorted(lines)] == [1, 1, 1]
    assert sorted(lines) == [1, 2, 3] and lines[3][PREFIX + "ppo_kl_high"] == 2
    assert trainer.total_training_steps == 3 and trainer.global_steps == 4
    assert sorted(int(p.stem.split("_")[1]) for p in (run / "batches").glob("*.parquet")) == [1, 2, 3]
    stops = [r.getMessage() for r in caplog.records if "stopping training" in r.getMessage()]
    assert len(stops) == 1 and "ppo_kl_high" in stops[0] and "step 3" in stops[0]


def test_stop_on_warning_ends_the_legacy_loop_after_the_next_step(capture_into, logged, monkeypatch, caplog):
    rt = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    monkeypatch.setattr(rt.RayPPOTrainer, "fit", verl_steps.legacy_fit(n_steps=6, rows=8, extra=clipfrac))
    rules = [Rule(id="clipfrac_high", kind="threshold", title="Clip fraction high", why="w",
                  metric="actor/pg_clipfrac", params={"above": 0.3, "min_fraction": 0.5})]
    capture_into(doctor=True, stop="warning", rules=rules)
    trainer = logged(rt.RayPPOTrainer, _config("grpo", n=4, mode="legacy"))
    with caplog.at_level(logging.WARNING, logger="rldiag.capture.health"):
        trainer.fit()
    # fires at step 2; verl's legacy loop took is_last_step at the start of step 3, which then ends it
    assert sorted(logged.lines()) == [1, 2, 3]
    assert trainer.total_training_steps == 2
    stops = [r.getMessage() for r in caplog.records if "stopping training" in r.getMessage()]
    assert "clipfrac_high" in stops[0] and "step 2" in stops[0] and "next step" in stops[0]


def test_a_bad_stop_value_is_refused_at_install(tmp_path, monkeypatch):
    monkeypatch.setenv("RLDIAG_DOCTOR_STOP", "severe")
    with pytest.raises(CaptureError, match="RLDIAG_DOCTOR_STOP='severe'"):
        capture.install(tmp_path / "run", doctor=True)
    capture.uninstall()


# ---- threads --------------------------------------------------------------------------------------


def test_the_writer_thread_runs_torch_single_threaded_and_no_other_thread_changes(tmp_path):
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's thread pool here is shared by the whole process: the recompute leaves it alone")
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # this thread's count, and the one new threads start from
    try:
        with RunWriter(tmp_path / "run") as writer:
            on_writer = writer.run_on_writer(lambda: (single_thread_torch(), torch.get_num_threads())).result()
            again = writer.run_on_writer(torch.get_num_threads).result()
        fresh: list[int] = []
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert on_writer == (True, 1) and again == 1  # the writer thread stays at 1
        assert torch.get_num_threads() == 2 and fresh == [2]  # this thread, and a thread started later
    finally:
        torch.set_num_threads(before)
