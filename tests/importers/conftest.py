"""Offline W&B runs written by the real wandb SDK, once per test session.

One subprocess (``wandb_writer.py``) writes three offline runs in a hermetic environment
(HOME, WANDB_DIR, WANDB_DATA_DIR, WANDB_CACHE_DIR, WANDB_CONFIG_DIR under a temp dir;
WANDB_MODE=offline; WANDB_ERROR_REPORTING=false; WANDB_SILENT=true):

- ``main``: verl-style nested config and a later config update; 60 steps of verl metric names
  (flat with ``/``, nested dicts, ints, a 2**53+1 int, NaN, +-inf, tiny floats, a bool), one
  80 kB value so that a record spans several 32 KiB blocks (FIRST, MIDDLE..., LAST chunks),
  and a synthetic run's batches as an ``rl-batches`` artifact (files staged by wandb under
  random names);
- ``typed``: the same with wandb's typed history values (``x_history_value_encoding=json,typed``),
  exit code 3, and its staged artifact files moved away afterwards (to ``carried/``, renamed);
- ``export``: a synthetic run directory exported with ``rldiag.capture.wandb_export.export_run``.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rldiag.synth import SynthSpec, write_synth_run

WRITER = Path(__file__).with_name("wandb_writer.py")
STEPS = 60
BIG_STEP = 7
BIG_VALUE_LEN = 80_000


def hermetic_env(root: Path, **extra: str) -> dict[str, str]:
    """The environment for a wandb subprocess: no WANDB_* of the caller, everything under ``root``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    dirs = {"HOME": root / "home", "WANDB_DIR": root / "wandb-root", "WANDB_DATA_DIR": root / "data",
            "WANDB_CACHE_DIR": root / "cache", "WANDB_CONFIG_DIR": root / "config"}
    for p in dirs.values():
        p.mkdir(parents=True, exist_ok=True)
    env.update({k: str(v) for k, v in dirs.items()})
    env.update({"WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false", "WANDB_SILENT": "true",
                "WANDB_DISABLE_GIT": "true", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run_writer(root: Path, runs: list[dict], timeout: float = 240) -> dict:
    spec = {"runs": runs, "result": str(root / "result.json")}
    (root / "spec.json").write_text(json.dumps(spec, allow_nan=True))
    proc = subprocess.run([sys.executable, str(WRITER), str(root / "spec.json")], env=hermetic_env(root),
                          cwd=root, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"wandb writer failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads((root / "result.json").read_text())


def verl_rows(steps: int = STEPS, seed: int = 0) -> list[list]:
    """Metrics as verl logs them, plus the awkward values a W&B history can hold."""
    rng = random.Random(seed)
    rows = []
    for step in range(1, steps + 1):
        data = {
            "actor/pg_clipfrac": rng.random() * 0.3,
            "actor/ppo_kl": rng.gauss(0, 1e-3),
            "actor/pg_loss": rng.gauss(0, 1),
            "actor/entropy_loss": 1.0 + rng.random(),
            "critic/score/mean": rng.random(),
            "critic/advantages/max": rng.random() * 3,
            "response_length/mean": float(rng.randint(10, 500)),
            "response_length/max": rng.randint(10, 1024),  # an int
            "global_seqlen/sum": 2**53 + step,  # an int beyond float precision
            "timing_s/gen": rng.random() * 30,
            "training/epoch": 0,
            "val": {"acc": rng.random(), "reward": {"mean": rng.random()}},  # nested dicts
            "rldiag/flag": step % 2 == 0,
        }
        if step == 3:
            data["actor/grad_norm"] = math.nan
        elif step == 4:
            data["actor/grad_norm"] = math.inf
        elif step == 5:
            data["actor/grad_norm"] = -math.inf
        else:
            data["actor/grad_norm"] = rng.random() * 10
        if step == 6:
            data["actor/ppo_kl"] = 5e-324  # the smallest denormal
            data["critic/score/mean"] = 1e-300
        if step == BIG_STEP:
            data["rldiag/notes"] = "".join(rng.choice("abcdefghij") for _ in range(BIG_VALUE_LEN))
        rows.append([step, data])
    return rows


def flat_expected(data: dict, sep: str = ".") -> dict:
    """What a logged row becomes in metrics.jsonl (nested dicts joined with ``sep``)."""
    out = {}

    def put(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{prefix}{sep}{k}" if prefix else k, v)
        else:
            out[prefix] = value

    put("", data)
    return out


def same_value(a, b) -> bool:
    """Exact equality, NaN equal to NaN, and the float/int of a number equal (1.0 == 1)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


BASE_CONFIG = {
    "algorithm": {"adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True,
                  "kl_ctrl": {"type": "fixed", "kl_coef": 0.001}},
    "actor_rollout_ref": {"actor": {"loss_agg_mode": "token-mean", "clip_ratio": 0.2, "ppo_micro_batch_size": None,
                                    "policy_loss": {"loss_mode": "vanilla"}}},
    "data": {"max_response_length": 32, "train_files": ["a.parquet", "b.parquet"]},
    "trainer": {"total_training_steps": 100, "project_name": "rl", "logger": ["console", "wandb"]},
}
CONFIG_UPDATE = {"trainer": {"total_training_steps": 60, "project_name": "rl", "resumed": True},
                 "late_key": {"x": [1, 2.5, None]}}


@dataclass
class WandbRuns:
    root: Path
    result: dict
    rows: list
    synth: Path  # the batches logged as artifacts by main and typed
    export_src: Path  # the run directory exported by export_run
    carried: Path  # where typed's staged artifact files were moved to (renamed)

    def folder(self, key: str) -> Path:
        return Path(self.result[key]["run_dir"])

    def wandb_file(self, key: str) -> Path:
        return next(self.folder(key).glob("run-*.wandb"))


@pytest.fixture(scope="session")
def wandb_runs(tmp_path_factory) -> WandbRuns:
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("wandb-offline")
    synth = write_synth_run(root / "synth", SynthSpec(steps=3, seed=11, config=BASE_CONFIG, write_metrics=False))
    export_src = write_synth_run(root / "export-src", SynthSpec(steps=4, seed=5))
    rows = verl_rows()
    runs = [
        {"key": "main", "kind": "log", "config": BASE_CONFIG, "config_update": CONFIG_UPDATE, "rows": rows,
         "batches_dir": str(synth), "artifact_name": "batches", "exit_code": 0, "data_dir": str(root / "data-main")},
        {"key": "typed", "kind": "log", "config": BASE_CONFIG, "config_update": CONFIG_UPDATE, "rows": rows,
         "batches_dir": str(synth), "artifact_name": "batches-typed", "exit_code": 3, "encoding": "json,typed",
         "data_dir": str(root / "data-typed")},
        {"key": "export", "kind": "export", "run_dir": str(export_src), "data_dir": str(root / "data-export")},
    ]
    result = run_writer(root, runs)
    # typed: the staged artifact files leave their recorded place, under new names
    carried = root / "carried"
    carried.mkdir()
    staged = sorted(p for p in (root / "data-typed" / "artifacts" / "staging").rglob("*") if p.is_file())
    assert len(staged) == 3, staged
    for i, p in enumerate(staged):
        shutil.move(str(p), carried / f"copied-{i}.bin")
    return WandbRuns(root=root, result=result, rows=rows, synth=synth, export_src=export_src, carried=carried)


@pytest.fixture(autouse=True)
def _hermetic_wandb(tmp_path, monkeypatch):
    """In-process imports see no real W&B settings, key or folders."""
    for k in list(os.environ):
        if k.startswith("WANDB_"):
            monkeypatch.delenv(k)
    for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DIR"):
        d = tmp_path / "wandb-env" / name.lower()
        d.mkdir(parents=True)
        monkeypatch.setenv(name, str(d))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")


@pytest.fixture(scope="module")
def batch_files(tmp_path_factory):
    """A synthetic run (the config the online tests' fake run logs) and its batch files' bytes by step."""
    src = write_synth_run(tmp_path_factory.mktemp("synth"), SynthSpec(steps=3, seed=2, config={
        "algorithm": {"adv_estimator": "grpo", "gamma": 1.0, "kl_ctrl": {"kl_coef": 0.001}},
        "actor_rollout_ref": {"actor": {"loss_agg_mode": "token-mean", "clip_ratio": 0.2}},
        "data": {"max_response_length": 32}}))
    return src, {s: (src / "batches" / f"step_{s}.parquet").read_bytes() for s in (1, 2, 3)}
