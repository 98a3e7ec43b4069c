"""Temporary files and staging directories left by ``kill -9`` are removed by the next writer;
those of a process still running are never touched.

Each child process stops at a known point (it says so on stdout and waits on stdin), so the
tests synchronise on its output, never on time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rldiag.capture import RunWriter
from rldiag.io import atomic
from rldiag.io.atomic import owner_tag, remove_stale, temp_name
from rldiag.io.outputs import read_scenario
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run

ROOT = Path(__file__).resolve().parents[2]

# A recompute that stops at its first step (its staging directory exists by then) until told
# to go on: "go" on stdin.
HELD_RECOMPUTE = textwrap.dedent("""
    import sys
    from rldiag.scenario.recompute import recompute
    def hold(done, total, step):
        if done == 1:
            print("held", flush=True)
            sys.stdin.readline()
    rep = recompute(sys.argv[1], progress=hold, device="cpu")
    print("done", rep.steps_done, flush=True)
""")

# A capture-style atomic write that stops after its temporary file is written, before the rename.
HELD_WRITE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from rldiag.io.atomic import write_file_atomic
    def writer(tmp):
        tmp.write_bytes(b"x" * 1000)
        print("held", tmp.name, flush=True)
        sys.stdin.readline()
    write_file_atomic(Path(sys.argv[1]), writer)
    print("done", flush=True)
""")


def _start(script: str, arg: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", script, str(arg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    line = proc.stdout.readline()
    assert line.startswith("held"), line
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _hidden(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=3, prompts=2, n=3, seed=2))


@pytest.mark.slow
def test_kill_9_of_recompute_leaves_a_stage_the_next_recompute_removes(run):
    scenarios = run / "rldiag" / "scenarios"
    seen: list[str] = []
    for _ in range(3):  # each killed recompute removed the stage of the one killed before it
        _kill(_start(HELD_RECOMPUTE, run))
        (stale,) = _hidden(scenarios)
        assert stale.startswith(".baseline.") and stale.endswith(".tmp") and stale not in seen
        seen.append(stale)
    rep = recompute(run, device="cpu")
    assert rep.steps_done == [1, 2, 3]
    assert _hidden(scenarios) == []  # both stale stages gone, and the new one swapped in
    assert read_scenario(run, "baseline")[0]["steps_done"] == [1, 2, 3]


@pytest.mark.slow
def test_the_stage_of_a_running_recompute_is_left_alone(run):
    scenarios = run / "rldiag" / "scenarios"
    proc = _start(HELD_RECOMPUTE, run)
    try:
        live = _hidden(scenarios)
        assert len(live) == 1
        recompute(run, device="cpu")  # same scenario, concurrently: must not remove the other's stage
        assert _hidden(scenarios) == live
        out, _ = proc.communicate("go\n", timeout=600)
    finally:
        if proc.poll() is None:
            _kill(proc)
    assert proc.returncode == 0 and "done [1, 2, 3]" in out
    assert _hidden(scenarios) == []
    assert read_scenario(run, "baseline")[0]["steps_done"] == [1, 2, 3]


@pytest.mark.slow
def test_a_killed_capture_writer_leaves_a_temp_file_the_next_writer_removes(tmp_path):
    batches = tmp_path / "run" / "batches"
    batches.mkdir(parents=True)
    target = batches / "step_000001.parquet"
    _kill(_start(HELD_WRITE, target))
    (left,) = _hidden(batches)
    assert left.startswith(".step_000001.parquet.") and left.endswith(".tmp")
    RunWriter(tmp_path / "run").close()
    assert _hidden(batches) == [] and not target.exists()


@pytest.mark.slow
def test_the_temp_file_of_a_running_writer_is_left_alone(tmp_path):
    batches = tmp_path / "run" / "batches"
    batches.mkdir(parents=True)
    target = batches / "step_000001.parquet"
    proc = _start(HELD_WRITE, target)
    try:
        live = _hidden(batches)
        assert len(live) == 1
        RunWriter(tmp_path / "run").close()
        assert _hidden(batches) == live
        out, _ = proc.communicate("go\n", timeout=120)
    finally:
        if proc.poll() is None:
            _kill(proc)
    assert proc.returncode == 0 and out.strip() == "done"
    assert target.read_bytes() == b"x" * 1000 and _hidden(batches) == []


def test_remove_stale_judges_owners_by_pid_start_time_and_host(tmp_path, monkeypatch):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    me = owner_tag()
    host, pid, start = me.split("-")
    names = {
        "dead": f".step_1.parquet.{host}-{dead}-0-abc.tmp",  # the process has exited
        "reused": f".x.{host}-{os.getppid()}-1-abc.tmp",  # the pid lives but started at another time
        "mine": temp_name("step_2.parquet"),  # this process: alive
        "other-host": f".y.{'0' * 8 if host != '0' * 8 else '1' * 8}-{dead}-0-abc.tmp",
        "foreign": ".step_3.parquet.tmp",  # not a name rldiag makes
        "old-dir": f".baseline.{host}-{dead}-0-def.old",
    }
    for key, name in names.items():
        (tmp_path / name).mkdir() if key == "old-dir" else (tmp_path / name).write_text(key)
    (tmp_path / names["old-dir"] / "metrics.parquet").write_text("old")
    if atomic.process_start_time(os.getppid()) is None:  # no /proc: the start time cannot be checked
        names.pop("reused")
        (tmp_path / f".x.{host}-{os.getppid()}-1-abc.tmp").unlink()
    removed = remove_stale(tmp_path)
    gone = {"dead", "old-dir"} | ({"reused"} if "reused" in names else set())
    assert sorted(p.name for p in removed) == sorted(names[k] for k in gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[k] for k in names if k not in gone)
    assert remove_stale(tmp_path, "step_2.parquet") == []  # a name filter, and still alive
    assert pid == str(os.getpid()) and start == str(atomic.process_start_time(os.getpid()) or 0)


def test_a_zombie_owner_counts_as_gone(tmp_path):
    if atomic.process_start_time(os.getpid()) is None:
        pytest.skip("no /proc: zombies cannot be told apart")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # not reaped yet: a zombie once it has exited; waitid(WNOWAIT) waits for that without reaping
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    host = owner_tag().split("-")[0]
    name = f".z.{host}-{child.pid}-0-abc.tmp"
    (tmp_path / name).write_text("z")
    assert [p.name for p in remove_stale(tmp_path)] == [name]
    child.wait()


@pytest.mark.slow
def test_a_kept_tokens_file_of_a_stale_stage_does_not_break_the_scenario(run):
    """The stale stage holds hard links to the scenario's token files (reused steps); removing
    it leaves the scenario's own files intact."""
    recompute(run, device="cpu", save_tokens=True)
    tokens = run / "rldiag" / "scenarios" / "baseline" / "tokens"
    before = {p.name: p.read_bytes() for p in tokens.iterdir()}
    _kill(_start(HELD_RECOMPUTE.replace("progress=hold,", "progress=hold, save_tokens=True,"), run))
    recompute(run, device="cpu", save_tokens=True)
    assert {p.name: p.read_bytes() for p in tokens.iterdir()} == before
    assert all(pq.read_table(tokens / n).num_rows > 0 for n in before)
