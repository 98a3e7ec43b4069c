"""Runs whose logged values are rldiag's own recompute of every step in order: what a trainer
would have logged under the run's settings, for settings the independent reference
(:mod:`tests.analysis.reference`) does not cover (an adaptive KL controller in the reward)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run

ADAPTIVE_KL = {"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": True,
                             "kl_ctrl": {"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.001, "horizon": 100}}}
LOGGED_COLUMNS = ("token_level_rewards", "advantages", "returns")


def write_self_logged_run(path: Path, config: dict, steps: int = 3, seed: int = 5) -> tuple[Path, list[dict]]:
    """A synthetic run under ``config`` whose batch files carry the recomputed logged columns and
    whose ``metrics.jsonl`` holds the recomputed metrics; returns it and those metric rows."""
    root = write_synth_run(path, SynthSpec(steps=steps, seed=seed, config=config, write_metrics=False))
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    rep = recompute(root, name="logged-by", save_tokens=True, device="cpu")
    tokens = root / "rldiag" / "scenarios" / "logged-by" / "tokens"
    for f in sorted((root / "batches").iterdir()):
        step = int(f.stem.split("_")[1])
        table = pq.read_table(f)
        saved = pq.read_table(tokens / f"step_{step:06d}.parquet")
        for name in LOGGED_COLUMNS:
            table = table.append_column(name, saved[name])
        pq.write_table(table, f)
    lines = [json.dumps({"step": int(r["step"]), "data": {k: v for k, v in r.items() if k != "step" and v is not None}})
             for r in rep.metrics]
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    shutil.rmtree(root / "rldiag")
    return root, rep.metrics
