"""Fixtures of the capture tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def capture_into(tmp_path):
    """``rldiag.capture.verl.install`` into ``tmp_path / "run"`` (keywords passed on); always undone."""
    import rldiag.capture.verl as capture

    run = tmp_path / "run"

    def start(**kw):
        capture.install(run, **kw)
        return run

    yield start
    capture.uninstall()
