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
from rldiag.executors.allocator import engine_threads, tune_host_allocator, usable_cores

ROOT = Path(__file__).resolve().parents[2]

_PROBE = "from rldiag.executors.allocator import tune_host_allocator as t; a = t(); b = t(); print(a, b)"


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
def test_tune_host_allocator_applies_once_and_caches():
    if os.environ.get("RLDIAG_MALLOC_TUNING", "1").strip().lower() in ("0", "false", "no", "off"):
        pytest.skip("tuning disabled in this environment")
    first = tune_host_allocator()
    assert first is True
    assert allocator._tuned is True
    assert tune_host_allocator() is True
    assert allocator._tuned is True


def test_tune_host_allocator_returns_cached_value(monkeypatch):
    # the cache decides, not the environment: a cached False stays False even if tuning is allowed
    monkeypatch.setattr(allocator, "_tuned", False)
    monkeypatch.delenv("RLDIAG_MALLOC_TUNING", raising=False)
    assert tune_host_allocator() is False
    monkeypatch.setattr(allocator, "_tuned", True)
    monkeypatch.setenv("RLDIAG_MALLOC_TUNING", "0")
    assert tune_host_allocator() is True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tune_host_allocator_fresh_process_default_on():
    assert _probe(None) == "True True"


@pytest.mark.slow
def test_tune_host_allocator_fresh_process_opt_out():
    assert _probe("0") == "False False"


@pytest.mark.parametrize("off", ["0", "false", "OFF", " no ", "Off "])
def test_tune_host_allocator_opt_out_spellings(monkeypatch, off):
    # in this process, with the cache cleared (monkeypatch restores it afterwards)
    monkeypatch.setattr(allocator, "_tuned", None)
    monkeypatch.setenv("RLDIAG_MALLOC_TUNING", off)
    assert tune_host_allocator() is False
    assert allocator._tuned is False
    monkeypatch.setenv("RLDIAG_MALLOC_TUNING", "1")
    assert tune_host_allocator() is False  # cached: the environment is read once


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
