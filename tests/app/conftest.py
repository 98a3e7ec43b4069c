"""Small runs for the app's tests."""

from __future__ import annotations

import pytest

from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run
from tests.app.helpers import logged_from_scenario


@pytest.fixture(autouse=True)
def rldiag_home(tmp_path, monkeypatch):
    """The user's rldiag directory (recent runs, mirrors of read-only runs) of each test, never ~/.cache."""
    home = tmp_path / "rldiag-home"
    monkeypatch.setenv("RLDIAG_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def baseline_worker_sync(monkeypatch):
    """The app's background baseline runs inline on the page's script thread (deterministic: the
    page is drawn after it); every worker is dropped after the test."""
    from rldiag.app import worker

    monkeypatch.setattr(worker, "MODE", "sync")
    yield
    worker.stop_all()


@pytest.fixture
def app_run(tmp_path):
    """6 steps, a baseline scenario with tokens, and logged metrics for steps 1-4 (training "ahead")."""
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=6, prompts=3, n=4, seed=11))
    recompute(run, save_tokens=True, device="cpu")
    lines = logged_from_scenario(run, steps={1, 2, 3, 4}, extra={"perf/throughput": 1234.0, "timing_s/step": 2.5})
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run
