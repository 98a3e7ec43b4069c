"""``doctor --follow``'s loop (rldiag.doctor.follow): a run written step by step between explicit
``poll_once()`` calls, a torn metrics line, a batch file still being written, counterfactuals
from an injected function, the idle timeout on an injected clock."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from rldiag.doctor.evaluators import metrics_read
from rldiag.doctor.follow import CounterfactualWorker, DoctorFollower
from rldiag.doctor.rules import load_rules
from rldiag.io.rundir import MetricsTail
from tests.doctor.runs import write_run


def clip_and_entropy(step: int, s) -> dict:
    """pg_clipfrac above 0.3 at steps 1-2 only; entropy_loss falls to 1 % from step 7."""
    return {"actor/pg_clipfrac": 0.5 if step <= 2 else 0.1, "actor/entropy_loss": 1.0 if step <= 6 else 0.01}


class Growing:
    """A run copied step by step from a complete one: ``line(k)`` appends metrics line k (or
    part of it), ``batch(k)`` copies batch file k."""

    def __init__(self, tmp: Path, steps: int = 10, **kw) -> None:
        self.src = write_run(tmp / "src", steps=steps, prompts=2, n=4, logged=clip_and_entropy, **kw)
        self.dst = tmp / "run"
        (self.dst / "batches").mkdir(parents=True)
        shutil.copy(self.src / "run.yaml", self.dst / "run.yaml")
        self.lines = (self.src / "metrics.jsonl").read_bytes().splitlines(keepends=True)

    def write(self, data: bytes) -> None:
        with open(self.dst / "metrics.jsonl", "ab") as fh:
            fh.write(data)

    def line(self, step: int, upto: int | None = None) -> None:
        self.write(self.lines[step - 1][:upto])

    def batch(self, step: int) -> Path:
        name = f"step_{step}.parquet"
        return Path(shutil.copy(self.src / "batches" / name, self.dst / "batches" / name))


def events(evs) -> list[tuple[str, int, str]]:
    return [(e.event, e.step, e.finding.rule) for e in evs]


def test_logged_lines_give_events_at_the_steps_they_happen(tmp_path):
    run = Growing(tmp_path)
    f = DoctorFollower(run.dst, recompute=False, counterfactual=False)
    assert f.poll_once() == [] and f.caught_up  # nothing yet: caught up with an empty run
    run.line(1)
    assert events(f.poll_once()) == [("fired", 1, "clipfrac_high")]
    run.line(2)
    run.line(3)
    run.line(4, upto=25)  # torn: the trainer is still writing step 4
    assert f.poll_once() == [] and f.doctor.step == 3
    run.write(run.lines[3][25:])  # step 4 complete: 2 of 4 steps above 0.3 still holds (min_fraction 0.5)
    run.line(5)  # 2 of 5 does not
    assert events(f.poll_once()) == [("cleared", 5, "clipfrac_high")]
    run.write(b"not json\n")
    for step in range(6, 11):  # several steps in one look: each is evaluated in turn
        run.line(step)
    assert events(f.poll_once()) == [("fired", 9, "entropy_collapse")]
    assert f.poll_once() == []
    s = f.summary("idle")
    assert (s.step, s.logged_steps, s.recomputed_steps, s.skipped_lines) == (10, 10, 0, 1)
    assert s.events == {"fired": 2, "changed": 0, "cleared": 1}
    assert [a.rule for a in s.active] == ["entropy_collapse"] and not s.healthy
    assert s.levels["entropy_collapse"] == 1 and s.levels["clipfrac_high"] == 0


def test_catching_up_reports_what_holds_once_at_the_step_it_began(tmp_path):
    run = Growing(tmp_path)
    for step in range(1, 11):
        run.line(step)
    f = DoctorFollower(run.dst, recompute=False, counterfactual=False)
    # clipfrac_high fired at 1 and cleared at 5 on the way: history, not reported
    assert events(f.poll_once()) == [("fired", 9, "entropy_collapse")]
    assert f.summary("idle").events == {"fired": 1, "changed": 0, "cleared": 0}


def test_metrics_tail_keeps_a_torn_line_and_restarts_on_a_rewritten_file(tmp_path):
    p = tmp_path / "metrics.jsonl"
    tail = MetricsTail(p)
    assert tail.read() == []
    p.write_bytes(b'{"step": 1, "data": {"a": 1}}\n{"step": 2, "da')
    assert tail.read() == [(1, {"a": 1})]
    assert tail.offset == p.stat().st_size
    with open(p, "ab") as fh:
        fh.write(b'ta": {"a": 2, "s": "x", "b": true}}\n\n{"step": -1}\n')
    assert tail.read() == [(2, {"a": 2})]  # numbers only
    assert tail.skipped == [(4, "step -1 is not a step number (an integer from 0 to 9223372036854775807)")]
    p.write_bytes(b'{"step": 7, "a": 3}\n')  # rewritten, shorter
    assert tail.read() == [(7, {"a": 3})]


def test_a_batch_file_is_recomputed_once_complete(tmp_path):
    run = Growing(tmp_path, steps=3)
    run.line(1)
    run.batch(1)
    f = DoctorFollower(run.dst, counterfactual=False)
    f.poll_once()
    assert (f.doctor.table.logged_steps, f.doctor.table.recomputed_steps) == (1, 1)
    run.line(2)
    whole = (run.src / "batches" / "step_2.parquet").read_bytes()
    (run.dst / "batches" / "step_2.parquet").write_bytes(whole[: len(whole) // 2])  # still being written
    f.poll_once()
    assert list(f.recompute_failed) == [2] and f.doctor.table.recomputed_steps == 1 and f.doctor.step == 2
    f.poll_once()  # nothing changed: no recompute
    assert list(f.recompute_failed) == [2]
    run.batch(2)
    f.poll_once()  # complete now: recomputed, and evaluated at the last step (it was logged already)
    assert f.recompute_failed == {} and f.doctor.table.recomputed_steps == 2 and f.doctor.step == 2
    assert f.doctor.table.series("rldiag/advantages/centre_offset").steps.tolist() == [1, 2]
    run.batch(3)  # a batch before its metrics line: step 3 is evaluated from it
    f.poll_once()
    assert f.doctor.step == 3 and f.doctor.table.recomputed_steps == 3 and f.doctor.table.logged_steps == 2


def test_after_catching_up_a_look_recomputes_only_its_new_steps_in_the_packs_of_a_full_recompute(tmp_path,
                                                                                                   monkeypatch):
    """The follower's work and what it keeps per look do not grow with the run: after the first
    look (which writes the scenario), each look computes only the steps new since the last one,
    the scenario is not rewritten, and each step's metrics are those the old follower took from a
    whole-scenario recompute (reusing every other step) at the same look, bit for bit; what it
    keeps per step is one value per metric column and the file's state."""
    from rldiag.doctor import follow as follow_mod
    from rldiag.scenario.recompute import recompute

    run = Growing(tmp_path, steps=12)
    full, changed = [], []
    real_full, real_changed = follow_mod.run_recompute, follow_mod.recompute_changed
    monkeypatch.setattr(follow_mod, "run_recompute", lambda *a, **k: full.append(1) or real_full(*a, **k))
    monkeypatch.setattr(follow_mod, "recompute_changed",
                        lambda rd, settings, steps, **k: changed.append(list(steps)) or real_changed(rd, settings, steps, **k))
    reference: dict[int, dict] = {}  # the old follower's: the whole scenario recomputed (reusing) at each look

    def look() -> None:
        f.poll_once()
        rep = recompute(run.dst, name="reference", device="cpu")
        reference.update({int(r["step"]): r for r in rep.metrics if int(r["step"]) not in reference})

    for s in (1, 2, 3):
        run.line(s)
        run.batch(s)
    f = DoctorFollower(run.dst, counterfactual=False)
    look()
    meta = run.dst / "rldiag" / "scenarios" / "baseline" / "scenario.json"
    written = meta.read_bytes()
    assert json.loads(written)["steps_done"] == [1, 2, 3]
    looks = [(4,), (5, 6), (8,), (7, 9), (10, 11, 12)]  # 7 late: 7 and 9 are not one pack (8 lies between)
    for batch in looks:
        for s in batch:
            run.batch(s)
            run.line(s)
        look()
    assert full == [1] and changed == [list(b) for b in looks]
    assert meta.read_bytes() == written  # not rewritten after the first look
    table = f.doctor.table
    assert table.recomputed_steps == 12 and len(f._fed) == 12
    given = {k for row in reference.values() for k, v in row.items() if k != "step" and v is not None}
    names = given & metrics_read(f.doctor.rules)  # only the metrics the rules read are kept
    assert set(table.recomputed) == names and 5 < len(names) < len(given) / 3
    for name in names:
        col = table.recomputed[name]
        want = [(s, reference[s][name]) for s in sorted(reference) if reference[s].get(name) is not None]
        assert col.steps.tolist() == [s for s, _ in want], name
        assert np.array_equal(col.values, np.array([v for _, v in want], dtype=np.float64)), name  # bit for bit
        assert col.n == len(want) <= 12  # one value per step, no more


def test_a_counterfactual_arrives_as_a_change_at_the_fired_step(tmp_path):
    run = Growing(tmp_path)
    calls = []
    cf = [{"settings": {"actor_rollout_ref.actor.clip_ratio": 0.3}, "metric": "actor/pg_clipfrac",
           "statistic": "mean", "window": [1, 1], "with": 0.1, "without": 0.5}]

    def fake(run_path, rule, finding, overrides=None, device="cpu"):
        calls.append((Path(run_path), rule.id, finding.rule, overrides, device))
        return cf

    seen = []
    f = DoctorFollower(run.dst, {"algorithm.gamma": 1.0}, recompute=False, counterfactual_fn=fake, on_event=seen.append)
    run.line(1)
    assert events(f.poll_once()) == [("fired", 1, "clipfrac_high")]
    assert f.worker is not None and f.worker.wait(timeout=60)
    run.line(2)
    got = f.poll_once()
    assert events(got) == [("changed", 1, "clipfrac_high")]
    assert got[0].to_dict()["finding"]["counterfactual"] == cf
    assert calls == [(run.dst, "clipfrac_high", "clipfrac_high", {"algorithm.gamma": 1.0}, "cpu")]
    assert events(seen) == [("fired", 1, "clipfrac_high"), ("changed", 1, "clipfrac_high")]
    assert f.summary("idle").events == {"fired": 1, "changed": 1, "cleared": 0}
    f.close()


def test_a_counterfactual_finished_within_the_poll_that_fired_it_arrives_with_the_next_one(tmp_path):
    """The events of a poll do not depend on the worker thread's speed: here the counterfactual has
    finished before the poll that fired it returns (its event hook waits for the worker), and it
    still arrives as a change with the next poll (it once arrived in the same poll, by chance)."""
    run = Growing(tmp_path)
    cf = [{"settings": {"actor_rollout_ref.actor.clip_ratio": 0.3}, "metric": "actor/pg_clipfrac",
           "statistic": "mean", "window": [1, 1], "with": 0.1, "without": 0.5}]
    box: dict = {}

    def finish_the_counterfactual(ev):
        if ev.event == "fired":
            assert box["f"].worker.wait(timeout=60)

    f = DoctorFollower(run.dst, {"algorithm.gamma": 1.0}, recompute=False,
                       counterfactual_fn=lambda *a, **k: cf, on_event=finish_the_counterfactual)
    box["f"] = f
    run.line(1)
    assert events(f.poll_once()) == [("fired", 1, "clipfrac_high")]
    assert events(f.poll_once()) == [("changed", 1, "clipfrac_high")]
    f.close()


def test_the_worker_runs_one_at_a_time_the_latest_first_and_reports_errors():
    rules = {r.id: r for r in load_rules()}
    started, release = threading.Event(), threading.Event()
    order = []

    def fn(run, rule, finding, overrides=None, device="cpu"):
        order.append(rule.id)
        started.set()
        release.wait(60)
        if rule.id == "ppo_kl_high":
            raise ValueError("no batches")
        return [{"rule": rule.id}]

    w = CounterfactualWorker(fn, Path("run"), {}, "cpu")
    w.submit(("clipfrac_high", None), rules["clipfrac_high"], None)
    assert started.wait(60)  # the first is running
    w.submit(("ppo_kl_high", None), rules["ppo_kl_high"], None)
    w.submit(("entropy_collapse", None), rules["entropy_collapse"], None)
    assert w.pending == 3
    release.set()
    assert w.wait(timeout=60) and w.pending == 0
    assert order == ["clipfrac_high", "entropy_collapse", "ppo_kl_high"]
    assert w.results() == [(("clipfrac_high", None), [{"rule": "clipfrac_high"}], None),
                           (("entropy_collapse", None), [{"rule": "entropy_collapse"}], None),
                           (("ppo_kl_high", None), None, "ValueError: no batches")]
    w.close()


def test_follow_ends_after_the_idle_timeout_on_its_clock(tmp_path):
    run = Growing(tmp_path)
    now = [0.0]
    sleeps = []

    def sleep(dt):
        sleeps.append(dt)
        now[0] += dt
        if len(sleeps) <= 2:  # a line at t = 1 and t = 2, then silence
            run.line(len(sleeps))

    f = DoctorFollower(run.dst, recompute=False, counterfactual=False, clock=lambda: now[0])
    s = f.follow(poll_seconds=1.0, idle_timeout=2.5, sleep=sleep)
    # news at t = 1 and 2; at t = 5, 3 s without any: stop
    assert (s.reason, s.step, now[0], sleeps) == ("idle", 2, 5.0, [1.0] * 5)
    assert json.loads(json.dumps(s.to_dict()))["events"] == {"fired": 1, "changed": 0, "cleared": 0}


def test_follow_stops_when_asked(tmp_path):
    run = Growing(tmp_path)
    run.line(1)
    stop = threading.Event()
    f = DoctorFollower(run.dst, recompute=False, counterfactual=False, on_event=lambda ev: stop.set())
    s = f.follow(poll_seconds=1000.0, stop=stop, sleep=lambda dt: pytest.fail("slept after stop"))
    assert s.reason == "stopped" and s.events["fired"] == 1
