"""``rldiag recompute``: stream a run's steps through the engine and write a scenario.

Steps are loaded one at a time (CPU, Arrow), packed into batches up to a token budget, moved to
the device, recomputed, and their results written out before the next pack is loaded, so memory
does not grow with the number of steps. A step that fails (bad input, or an input on which verl
would raise) is recorded with its error and the others go on; what succeeded is written either way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from rldiag import __version__
from rldiag.config.settings import Settings, resolve_settings, scenario_slug
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.aggregation import AGG_MODES
from rldiag.engine.batch import Batch, pack
from rldiag.engine.kl import KL_ESTIMATORS
from rldiag.engine.pipeline import initial_kl_state, recompute_batch
from rldiag.engine.policy_loss import POLICY_LOSSES
from rldiag.errors import ConfigError, RldiagError
from rldiag.io.atomic import replace_dir, staging_dir, write_bytes_atomic
from rldiag.io.loader import StepData, load_step
from rldiag.io.outputs import json_safe, metrics_table, scenario_dir, sha256_file, tokens_table, write_parquet
from rldiag.io.rundir import RunDir, parse_steps

#: Pack steps together until this many (rows x width) token slots; one step may exceed it alone.
DEFAULT_PACK_TOKENS = 1 << 19

ProgressFn = Callable[[int, int, int], None]


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; ``cuda`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available (use --device cpu or auto)")
        return torch.device(device)
    raise ConfigError(f"--device {device!r}: expected auto, cpu or cuda")


def check_settings(settings: Settings) -> None:
    """Fail before any work on a setting whose registry key is unknown."""
    ESTIMATORS.get(settings.estimator)
    POLICY_LOSSES.get(settings["actor_rollout_ref.actor.policy_loss.loss_mode"])
    AGG_MODES.get(settings.actor_agg_mode)
    AGG_MODES.get(settings.critic_agg_mode)
    if settings["algorithm.use_kl_in_reward"]:
        KL_ESTIMATORS.get(settings["algorithm.kl_penalty"])
        initial_kl_state(settings)
    if settings["actor_rollout_ref.actor.use_kl_loss"]:
        KL_ESTIMATORS.get(settings["actor_rollout_ref.actor.kl_loss_type"])


def replay_kl_controller(files: dict, steps: list[int], settings: Settings, state) -> None:
    """Advance the adaptive KL controller over ``steps`` (run order) without recomputing them.

    Each step's reward-side KL (mean over rows of the per-row masked mean of the estimator on
    old vs reference log-probs, original mask) and its row count drive verl's update. A step
    whose batch cannot be read is skipped, as a trainer that never saw it.
    """
    from rldiag.engine.kl import kl_estimate
    from rldiag.engine.segments import MEAN_EPS
    from rldiag.io.loader import load_step, read_schema

    for step in steps:
        try:
            names = read_schema(files[step]).names
            score = "token_level_scores" if "token_level_scores" in names else "score"
            cols = ["uid", "response_mask", score] + [c for c in ("old_log_probs", "ref_log_prob") if c in names]
            sd = load_step(files[step], settings, columns=cols)
        except RldiagError:
            continue
        b = sd.batch
        if b.old_log_probs is None or b.ref_log_prob is None:
            continue
        m = b.response_mask
        kld = kl_estimate(settings["algorithm.kl_penalty"], b.old_log_probs, b.ref_log_prob) * m
        row_kl = (kld * m).sum(-1) / (m.sum(-1) + MEAN_EPS)
        state.advance(settings, row_kl.mean().reshape(1), torch.tensor([float(b.n_rows)]))


@dataclass
class ScenarioReport:
    name: str
    path: Path
    settings: Settings
    device: str
    steps_done: list[int] = field(default_factory=list)
    steps_failed: dict[int, str] = field(default_factory=dict)
    metrics: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    rows: int = 0
    tokens: int = 0

    @property
    def ok(self) -> bool:
        return not self.steps_failed


def _metric_rows(result, steps_ok: set[int]) -> list[dict[str, float]]:
    out = []
    names = list(result.metrics)
    values = {k: v.detach().to("cpu", torch.float64).tolist() for k, v in result.metrics.items()}
    for i, step in enumerate(result.steps):
        if step in steps_ok:
            row = {"step": step}
            row.update({k: values[k][i] for k in names})
            out.append(row)
    return out


def recompute(
    run: str | Path,
    overrides: Mapping[str, Any] | None = None,
    name: str | None = None,
    steps: str | None = None,
    device: str = "auto",
    save_tokens: bool = False,
    progress: ProgressFn | None = None,
    pack_tokens: int = DEFAULT_PACK_TOKENS,
) -> ScenarioReport:
    """Recompute a run under its own settings plus ``overrides`` and write the scenario.

    Returns the report; raises :class:`RldiagError` only for problems that stop the whole
    scenario (unknown settings, no batches). Failed steps are in ``report.steps_failed``.
    """
    t0 = time.perf_counter()
    rd = RunDir(run)
    overrides = dict(overrides or {})
    settings = resolve_settings(rd.path, overrides)
    check_settings(settings)
    dev = resolve_device(device)
    name = name or scenario_slug(overrides)
    if "/" in name or name.startswith(".") or not name.strip():
        raise ConfigError(f"--name {name!r}: a scenario name is one path component, not hidden")
    files = {sf.step: sf for sf in rd.require_steps()}
    chosen = parse_steps(steps, sorted(files))
    target = scenario_dir(rd.path, name)
    stage = staging_dir(target)
    report = ScenarioReport(name=name, path=target, settings=settings, device=str(dev))
    kl_state = initial_kl_state(settings) if settings["algorithm.use_kl_in_reward"] else None
    if kl_state is not None and settings["algorithm.kl_ctrl.type"] == "adaptive":
        # the coefficient of a step depends on every step before it: replay them first
        earlier = [s for s in sorted(files) if s < chosen[0]]
        replay_kl_controller(files, earlier, settings, kl_state)
    inputs = []
    try:
        if save_tokens:
            (stage / "tokens").mkdir()
        pending: list[StepData] = []
        pending_slots = 0
        done = 0

        def flush() -> None:
            nonlocal pending, pending_slots, done
            if not pending:
                return
            batch: Batch = pack([p.batch for p in pending]).to(dev)
            try:
                result = recompute_batch(batch, settings, kl_state)
            except RldiagError as exc:
                for p in pending:
                    report.steps_failed[p.step] = f"{type(exc).__name__}: {exc}"
                result = None
            if result is not None:
                for s, msg in result.failed.items():
                    report.steps_failed[s] = f"ComputeError: {msg}"
                ok = {p.step for p in pending} - set(result.failed)
                report.metrics.extend(_metric_rows(result, ok))
                if save_tokens:
                    row0 = 0
                    for i, p in enumerate(pending):
                        rows = slice(row0, row0 + p.n_rows)
                        row0 += p.n_rows
                        if p.step not in ok:
                            continue
                        width = int(p.batch.lengths.max()) if p.n_rows else 0
                        toks = {k: v[rows, : max(width, 1)] for k, v in result.tokens.items()}
                        write_parquet(tokens_table(toks, p.batch.lengths), stage / "tokens" / f"step_{p.step:06d}.parquet")
                for p in pending:
                    if p.step in ok:
                        report.steps_done.append(p.step)
                        report.rows += p.n_rows
                        report.tokens += p.n_tokens
            done += len(pending)
            if progress:
                progress(done, len(chosen), pending[-1].step)
            pending, pending_slots = [], 0

        for step in chosen:
            sf = files[step]
            inputs.append({"step": step, "file": str(sf.path.relative_to(rd.path)), "size": sf.path.stat().st_size,
                           "sha256": sha256_file(sf.path)})
            try:
                data = load_step(sf, settings)
            except RldiagError as exc:
                flush()  # keep step order for the KL controller
                report.steps_failed[step] = f"{type(exc).__name__}: {exc}"
                done += 1
                if progress:
                    progress(done, len(chosen), step)
                continue
            slots = data.n_rows * data.batch.width
            if pending and pending_slots + slots > pack_tokens:
                flush()
            pending.append(data)
            pending_slots += slots
        flush()

        report.steps_done.sort()
        write_parquet(metrics_table(report.metrics), stage / "metrics.parquet")
        report.seconds = time.perf_counter() - t0
        meta = {
            "name": name,
            "settings": settings.resolved(),
            "overrides": overrides,
            "config_file": settings.config_file,
            "rldiag_version": __version__,
            "device": str(dev),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "inputs": inputs,
            "steps_done": report.steps_done,
            "steps_failed": {str(k): v for k, v in sorted(report.steps_failed.items())},
            "save_tokens": save_tokens,
            "seconds": round(report.seconds, 3),
            "rows": report.rows,
            "tokens": report.tokens,
        }
        if settings.config_file:
            cf = Path(settings.config_file)
            meta["config_sha256"] = sha256_file(cf)
        write_bytes_atomic(stage / "scenario.json", json.dumps(json_safe(meta), indent=2, sort_keys=False).encode())
        replace_dir(stage, target)
    except BaseException:
        import shutil

        shutil.rmtree(stage, ignore_errors=True)
        raise
    return report
