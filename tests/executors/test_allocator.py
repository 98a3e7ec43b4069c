"""Host settings of a CPU recompute: glibc's malloc tuning (once per process, opt-out by env)
and the engine's intra-op threads (one core left to the loader, restored afterwards)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rldiag.executors import allocator
from rldiag.executors.allocator import engine_threads, tune_host_allocator, tuning_enabled, usable_cores

ROOT = Path(__file__).resolve().parents[2]

_PROBE = "from rldiag.executors.allocator import tune_host_allocator as t; a = t(); b = t(); print(a, b)"
_OFF = ["0", "false", "OFF", " no ", "Off "]


@pytest.fixture
def fresh_tuning(monkeypatch):
    """tune_host_allocator as in a new process: its kept answer forgotten before and after (the
    next caller then applies the settings again: mallopt with the same values changes nothing)."""
    monkeypatch.delenv("RLDIAG_MALLOC_TUNING", raising=False)
    tune_host_allocator.cache_clear()
    yield monkeypatch
    tune_host_allocator.cache_clear()


@pytest.fixture
def torch_threads():
    """Restore torch's intra-op thread count whatever the test does to it."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def _probe(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop("RLDIAG_MALLOC_TUNING", None)
    if env_value is not None:
        env["RLDIAG_MALLOC_TUNING"] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tune_host_allocator_applies_on_glibc_and_keeps_its_answer(fresh_tuning):
    assert tune_host_allocator() is True
    # the environment is read by the first call only: an opt-out afterwards changes nothing
    fresh_tuning.setenv("RLDIAG_MALLOC_TUNING", "0")
    assert tune_host_allocator() is True


def test_an_opt_out_read_first_is_kept(fresh_tuning):
    fresh_tuning.setenv("RLDIAG_MALLOC_TUNING", "0")
    assert tune_host_allocator() is False
    fresh_tuning.delenv("RLDIAG_MALLOC_TUNING")
    assert tune_host_allocator() is False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tune_host_allocator_fresh_process_default_on():
    assert _probe(None) == "True True"


@pytest.mark.slow
def test_tune_host_allocator_fresh_process_opt_out():
    assert _probe("0") == "False False"


@pytest.mark.parametrize("off", _OFF)
def test_tune_host_allocator_opt_out_spellings(fresh_tuning, off):
    assert tuning_enabled({"RLDIAG_MALLOC_TUNING": off}) is False
    fresh_tuning.setenv("RLDIAG_MALLOC_TUNING", off)
    assert tune_host_allocator() is False


@pytest.mark.parametrize("on", [None, "1", "true", "yes", "", "on"])
def test_tuning_enabled_unless_opted_out(on):
    assert tuning_enabled({} if on is None else {"RLDIAG_MALLOC_TUNING": on}) is True


def test_engine_threads_cpu_leaves_one_core(torch_threads):
    torch.set_num_threads(2)
    expected = max(1, min(2, usable_cores() - 1))
    with engine_threads("cpu") as n:
        assert n == expected
        assert torch.get_num_threads() == expected
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize(
    "before, cores, expected",
    [(4, 3, 2), (4, 16, 4), (2, 2, 1), (3, 1, 1), (1, 8, 1), (6, 7, 6)],
)
def test_engine_threads_formula(torch_threads, monkeypatch, before, cores, expected):
    monkeypatch.setattr(allocator, "usable_cores", lambda: cores)
    torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    with engine_threads("cpu") as n:
        assert n == expected == max(1, min(before, cores - 1))
        assert torch.get_num_threads() == expected
    assert torch.get_num_threads() == before


def test_engine_threads_restored_when_body_raises(torch_threads, monkeypatch):
    monkeypatch.setattr(allocator, "usable_cores", lambda: 2)
    torch.set_num_threads(3)
    with pytest.raises(RuntimeError, match="boom"):
        with engine_threads("cpu") as n:
            assert n == 1 and torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "meta"])
def test_engine_threads_leaves_other_devices_alone(torch_threads, monkeypatch, device):
    monkeypatch.setattr(allocator, "usable_cores", lambda: 2)
    torch.set_num_threads(3)
    with engine_threads(device) as n:
        assert n == 3
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == 3
    with pytest.raises(ValueError):
        with engine_threads(device):
            raise ValueError("x")
    assert torch.get_num_threads() == 3


def test_engine_threads_cpu_index_string(torch_threads, monkeypatch):
    monkeypatch.setattr(allocator, "usable_cores", lambda: 3)
    torch.set_num_threads(4)
    with engine_threads("cpu:0") as n:
        assert n == 2 and torch.get_num_threads() == 2
    assert torch.get_num_threads() == 4


def test_usable_cores_is_positive():
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def test_idle_cores_are_the_usable_ones_less_the_load(monkeypatch):
    monkeypatch.setattr(allocator.os, "getloadavg", lambda: (1.25, 0.0, 0.0))
    monkeypatch.setattr(allocator, "usable_cores", lambda: 4)
    assert allocator.idle_cores() == 2.75

    def no_load():
        raise OSError("no load average here")

    monkeypatch.setattr(allocator.os, "getloadavg", no_load)
    assert allocator.idle_cores() == 4.0


def test_spare_cores_are_what_the_other_processes_leave_beside_the_engine(monkeypatch):
    """SpareCores: the usable cores less the CPU the machine's other processes used since the last
    call (the machine's busy time less this process's own) less the engine's threads; a window
    too short to tell, or no /proc/stat, falls back to the load average's idle cores."""
    samples = iter([
        (100.0, 10.0, 0.0),  # at construction: machine busy s, own CPU s, monotonic s
        (101.5, 11.3, 1.0),  # 1 s later: the machine busy 1.5 cores, this process 1.3 of them
        (101.6, 11.4, 1.05),  # 50 ms later: too short a window
        (103.6, 13.9, 2.0),  # own ticks above the machine's (rounding): the others used nothing
        None,  # no /proc/stat
    ])
    monkeypatch.setattr(allocator, "cpu_sample", lambda: next(samples))
    monkeypatch.setattr(allocator, "usable_cores", lambda: 2)
    monkeypatch.setattr(allocator, "idle_cores", lambda: -7.0)
    spare = allocator.SpareCores(fewer=1)
    assert spare() == pytest.approx(2 - 0.2 - 1)
    assert spare() == -7.0  # 50 ms: the load average's answer, and the window goes on
    assert spare() == pytest.approx(2 - 0.0 - 1)  # from the last sample taken (1.0 s): 1 s window
    assert spare() == -7.0


@pytest.mark.parametrize("quiet, spare, want", [(True, 0.8, 3), (True, 0.3, 2), (False, 5.0, 2)])
def test_pack_threads_widens_only_for_a_quiet_loader_and_a_spare_core(quiet, spare, want):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert allocator.pack_threads(3, 2, quiet, lambda: spare) == want
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
