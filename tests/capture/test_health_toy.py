"""The doctor in the toy trainer's loop (the hook ``rldiag.capture.verl`` runs with
``RLDIAG_DOCTOR=1``): health keys in its ``metrics.jsonl`` and a critical finding ending the loop
after its step, through the same ``total_training_steps`` contract as verl's V1 loop."""

from __future__ import annotations

import json
import logging

import torch

from rldiag.capture.health import FINDINGS_KEY, PREFIX
from rldiag.toy.config import PRESETS
from rldiag.toy.trainer import ToyTrainer

#: a user's rules file making vf_explained_var_negative critical from the critic's first steps
#: (the built-in rule waits out a warm-up, at warning: docs/calibration.md)
STRICT_CRITIC = """
rules:
  - id: vf_explained_var_negative
    below: 0.0
    stat: each
    min_fraction: 0.5
    min_steps: 3
    warmup: 0
    severity: critical
"""


def test_a_critical_finding_stops_the_toy_trainer_after_its_step(tmp_path, caplog):
    torch.set_num_threads(1)
    trainer = ToyTrainer(PRESETS["ppo-gae"](steps=8))
    run = tmp_path / "run"
    rules = tmp_path / "rules.yaml"
    rules.write_text(STRICT_CRITIC)
    with caplog.at_level(logging.WARNING, logger="rldiag.capture.health"):
        summary = trainer.run(run, doctor=True, stop_at=2, rules_files=[rules])
    lines = {x["step"]: x["data"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    # vf_explained_var_negative (critical): below 0 at >= half the last 10 steps, from 3 steps on
    ev = [lines[s]["critic/vf_explained_var"] for s in sorted(lines)]
    first = next(n for n in range(3, 9) if sum(v < 0 for v in ev[:n]) >= n / 2)
    assert summary.stopped_after == first == trainer.total_training_steps
    assert sorted(lines) == list(range(1, first + 1))
    assert sorted(p.name for p in (run / "batches").glob("*.parquet")) == [
        f"step_{s:06d}.parquet" for s in range(1, first + 1)]
    assert [lines[s][PREFIX + "vf_explained_var_negative"] for s in sorted(lines)] == [0] * (first - 1) + [2]
    for data in lines.values():
        levels = {k: v for k, v in data.items() if k.startswith(PREFIX) and k != FINDINGS_KEY}
        assert data[FINDINGS_KEY] == sum(1 for v in levels.values() if v > 0)
    stops = [r.getMessage() for r in caplog.records if "stopping training" in r.getMessage()]
    assert len(stops) == 1 and "vf_explained_var_negative (critical)" in stops[0] and f"step {first}" in stops[0]


def test_without_the_doctor_the_toy_trainer_logs_no_health_keys_and_runs_every_step(tmp_path):
    torch.set_num_threads(1)
    summary = ToyTrainer(PRESETS["ppo-gae"](steps=4)).run(tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4] and summary.stopped_after is None
    assert not any(k.startswith(PREFIX) for x in lines for k in x["data"])
