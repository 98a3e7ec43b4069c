"""``rldiag recompute``: stream a run's steps through the engine and write a scenario.

Steps are loaded one at a time (CPU, Arrow), packed into batches up to a token budget, moved to
the device, recomputed, and their results written out before the next pack is loaded, so memory
does not grow with the number of steps. A step that fails (bad input, or an input on which verl
would raise) is recorded with its error and the others go on; what succeeded is written either way.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rldiag import __version__
from rldiag.config.settings import Settings, resolve_settings, scenario_slug
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.aggregation import AGG_MODES
from rldiag.engine.batch import Batch, pack
from rldiag.engine.kl import KL_ESTIMATORS
from rldiag.engine.pipeline import initial_kl_state, recompute_batch
from rldiag.engine.microbatch import check_microbatch_settings
from rldiag.engine.policy_loss import POLICY_LOSSES, check_policy_loss_settings
from rldiag.engine.rollout_correction import CorrectionConfig
from rldiag.errors import ConfigError, RldiagError, RunDirError
from rldiag.io.atomic import replace_dir, staging_dir, write_bytes_atomic
from rldiag.io.loader import StepData, load_step
from rldiag.io.outputs import json_safe, metrics_table, scenario_dir, sha256_file, tokens_table, write_parquet
from rldiag.io.rundir import RunDir, parse_steps

#: Steps read ahead on the loader thread (bounded: memory stays flat as the run grows).
PREFETCH = 2

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
    check_policy_loss_settings(settings)
    CorrectionConfig.from_settings(settings, "algorithm.rollout_correction")
    check_microbatch_settings(settings)


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
    steps_reused: list[int] = field(default_factory=list)
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


def _input_info(sf, rel: str, previous: dict | None) -> dict:
    """Size, modification time and SHA-256 of an input file. A file whose size and mtime match
    the previous scenario's record keeps that record's hash instead of being read again."""
    st = sf.path.stat()
    info = {"step": sf.step, "file": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if previous and previous.get("size") == st.st_size and previous.get("mtime_ns") == st.st_mtime_ns and previous.get("sha256"):
        info["sha256"] = previous["sha256"]
    else:
        info["sha256"] = sha256_file(sf.path)
    return info


@dataclass
class _Previous:
    """What an earlier run of the same scenario left that can be reused."""

    inputs: dict[int, dict]
    metrics: dict[int, dict[str, float]]
    tokens_dir: Path | None
    reusable: bool


def _previous(target: Path, settings: Settings, save_tokens: bool) -> _Previous:
    empty = _Previous({}, {}, None, False)
    meta_path = target / "scenario.json"
    if not meta_path.is_file():
        return empty
    try:
        meta = json.loads(meta_path.read_text())
        table = pq.read_table(target / "metrics.parquet")
    except (OSError, ValueError, pa.ArrowException):
        return empty
    inputs = {int(i["step"]): i for i in meta.get("inputs", [])}
    same = (
        meta.get("rldiag_version") == __version__
        and meta.get("settings") == json.loads(json.dumps(json_safe(settings.resolved())))
        and (meta.get("save_tokens") or not save_tokens)
        # an adaptive KL coefficient depends on every earlier step: no reuse
        and not (settings["algorithm.use_kl_in_reward"] and settings["algorithm.kl_ctrl.type"] == "adaptive")
    )
    done = set(meta.get("steps_done", []))
    rows = table.to_pylist()
    metrics = {int(r["step"]): r for r in rows if int(r["step"]) in done}
    tokens_dir = target / "tokens" if (target / "tokens").is_dir() else None
    return _Previous(inputs=inputs, metrics=metrics, tokens_dir=tokens_dir, reusable=same)


def recompute(
    run: str | Path,
    overrides: Mapping[str, Any] | None = None,
    name: str | None = None,
    steps: str | None = None,
    device: str = "auto",
    save_tokens: bool = False,
    progress: ProgressFn | None = None,
    pack_tokens: int = DEFAULT_PACK_TOKENS,
    reuse: bool = True,
) -> ScenarioReport:
    """Recompute a run under its own settings plus ``overrides`` and write the scenario.

    Steps whose input file and settings are unchanged since the last run of the same scenario
    are reused (``reuse=False`` recomputes everything). The next step's file is read and hashed
    on a background thread while the current one is computed. Returns the report; raises
    :class:`RldiagError` only for problems that stop the whole scenario (unknown settings, no
    batches). Failed steps are in ``report.steps_failed``.
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
    prev = _previous(target, settings, save_tokens) if reuse else _Previous({}, {}, None, False)
    stage = staging_dir(target)
    report = ScenarioReport(name=name, path=target, settings=settings, device=str(dev))
    kl_state = initial_kl_state(settings) if settings["algorithm.use_kl_in_reward"] else None
    if kl_state is not None and settings["algorithm.kl_ctrl.type"] == "adaptive":
        # the coefficient of a step depends on every step before it: replay them first
        earlier = [s for s in sorted(files) if s < chosen[0]]
        replay_kl_controller(files, earlier, settings, kl_state)
    inputs: list[dict] = []
    try:
        if save_tokens:
            (stage / "tokens").mkdir()
        pending: list[StepData] = []
        pending_slots = 0
        done = 0

        def tick(step: int, n: int = 1) -> None:
            nonlocal done
            done += n
            if progress:
                progress(done, len(chosen), step)

        def flush() -> None:
            nonlocal pending, pending_slots
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
                    for p in pending:
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
            tick(pending[-1].step, len(pending))
            pending, pending_slots = [], 0

        def reusable(step: int, info: dict) -> bool:
            old = prev.inputs.get(step)
            return (
                prev.reusable
                and step in prev.metrics
                and old is not None
                and old.get("sha256") == info["sha256"]
                and old.get("size") == info["size"]
                and (not save_tokens or (prev.tokens_dir is not None and (prev.tokens_dir / f"step_{step:06d}.parquet").is_file()))
            )

        def fetch(step: int):
            """Background: hash the file, and load it unless the previous result can be reused."""
            sf = files[step]
            info = _input_info(sf, str(sf.path.relative_to(rd.path)), prev.inputs.get(step))
            if reusable(step, info):
                return info, None, None
            try:
                data = load_step(sf, settings)
            except RldiagError as exc:
                return info, None, exc
            if dev.type == "cuda":  # page-locked on the loader thread: the copy to the GPU overlaps
                data.batch = data.batch.pin_memory()
            return info, data, None

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rldiag-load") as pool:
            queue: deque = deque()
            it = iter(chosen)
            for step in it:
                queue.append((step, pool.submit(fetch, step)))
                if len(queue) >= PREFETCH:
                    break
            while queue:
                step, fut = queue.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    queue.append((nxt, pool.submit(fetch, nxt)))
                info, data, exc = fut.result()
                inputs.append(info)
                if exc is not None:
                    flush()  # keep step order for the KL controller
                    report.steps_failed[step] = f"{type(exc).__name__}: {exc}"
                    tick(step)
                    continue
                if data is None:  # reuse the previous result of this step
                    flush()
                    row = dict(prev.metrics[step])
                    report.metrics.append({k: v for k, v in row.items() if v is not None or k == "step"})
                    if save_tokens:
                        _link_or_copy(prev.tokens_dir / f"step_{step:06d}.parquet", stage / "tokens" / f"step_{step:06d}.parquet")
                    report.steps_done.append(step)
                    report.steps_reused.append(step)
                    tick(step)
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
            "steps_reused": sorted(report.steps_reused),
            "save_tokens": save_tokens,
            "seconds": round(report.seconds, 3),
            "rows": report.rows,
            "tokens": report.tokens,
        }
        if settings.config_file:
            meta["config_sha256"] = sha256_file(Path(settings.config_file))
        write_bytes_atomic(stage / "scenario.json", json.dumps(json_safe(meta), indent=2).encode())
        replace_dir(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return report


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def follow(
    run: str | Path,
    overrides: Mapping[str, Any] | None = None,
    name: str | None = None,
    poll_seconds: float = 2.0,
    idle_timeout: float | None = None,
    on_update: Callable[[ScenarioReport], None] | None = None,
    **kwargs,
) -> ScenarioReport:
    """Keep a scenario up to date with a run that is still writing batches.

    Re-runs :func:`recompute` (reusing every unchanged step) whenever a new or changed batch file
    appears; a file that cannot be read yet (still being written) is retried on the next poll.
    Returns after ``idle_timeout`` seconds without a new file (never, when None: stop with Ctrl-C).
    """
    rd = RunDir(run)
    seen: dict[int, tuple[int, int]] | None = None
    last_change = time.monotonic()
    report: ScenarioReport | None = None
    while True:
        state = {}
        for sf in rd.step_files():
            st = sf.path.stat()
            state[sf.step] = (st.st_size, st.st_mtime_ns)
        pending_failures = report is not None and bool(report.steps_failed)
        if state and (state != seen or pending_failures):
            if state != seen:
                last_change = time.monotonic()
            report = recompute(run, overrides, name=name, **kwargs)
            seen = state
            if on_update:
                on_update(report)
        if idle_timeout is not None and time.monotonic() - last_change >= idle_timeout:
            if report is None:
                raise RunDirError(f"no batch file appeared in {rd.batches_dir} within {idle_timeout:g} s")
            return report
        time.sleep(poll_seconds)
