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
