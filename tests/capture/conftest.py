"""Fixtures of the capture tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def capture_into(tmp_path):
    """``rldiag.capture.verl.install`` into ``tmp_path / "run"`` (keywords passed on); always undone."""
    import rldiag.capture.verl as capture

    run = tmp_path / "run"

    def start(**kw):
        # the tests wait for the writer and for the doctor's recompute (deterministic steps):
        # a fake trainer's step takes milliseconds, so the shares of a step would wait for nothing
        kw.setdefault("writer_options", {})
        kw["writer_options"] = {"max_wait_s": 120.0, "wait_share": None, **kw["writer_options"]}
        kw.setdefault("health_options", {"slow_s": 600.0})
        capture.install(run, **kw)
        return run

    yield start
    capture.uninstall()


def _wrapped_left(module) -> list[str]:
    marker = "__rldiag_capture__"
    left = []
    for name, obj in vars(module).items():
        if getattr(obj, marker, False):
            left.append(f"{module.__name__}.{name}")
        if isinstance(obj, type) and obj.__module__ == module.__name__:
            left += [f"{module.__name__}.{name}.{k}" for k, v in vars(obj).items() if getattr(v, marker, False)]
    return left


@pytest.fixture(autouse=True)
def verl_left_as_found():
    """After every capture test (and after its monkeypatch teardown: an autouse fixture is torn
    down last), no capture wrapper is left on verl's modules once the capture is uninstalled: a
    wrapper left behind makes the next ``install`` skip the function (found by test order)."""
    import sys

    yield
    capture = sys.modules.get("rldiag.capture.verl")
    if capture is None:
        return
    capture.uninstall()
    left = [n for name in capture.PATCHES if name in sys.modules for n in _wrapped_left(sys.modules[name])]
    assert not left, f"capture wrappers left on verl after uninstall: {left}"
