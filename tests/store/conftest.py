"""Runs for the store tests: a synthetic run with logged metrics and recomputed scenarios."""

from __future__ import annotations

import json

import pytest

from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run


def write_logged(run, rows: dict[int, dict[str, float]]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in sorted(rows.items())))


@pytest.fixture
def run(tmp_path):
    """4 steps; logged values for steps 1-3 only (training is "ahead" of nothing here), with a
    logged-only metric; baseline and an rloo scenario recomputed with tokens."""
    r = write_synth_run(tmp_path / "run", SynthSpec(steps=4, prompts=3, n=4, seed=5))
    write_logged(r, {s: {"critic/score/mean": 0.1 * s, "actor/lr": 1e-3, "perf/throughput": 100.0 + s} for s in (1, 2, 3)})
    recompute(r, save_tokens=True, device="cpu")
    recompute(r, {"algorithm.adv_estimator": "rloo"}, save_tokens=True, device="cpu")
    return r
