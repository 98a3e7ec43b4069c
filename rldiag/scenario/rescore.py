"""``rldiag rescore``: the run's rollouts scored again by another reward function, and everything
downstream recomputed, written as a scenario like any other.

1. Each chosen step's reward inputs are read (``data_source``, ``ground_truth`` and ``extra_info``
   decoded from their JSON text, ``response_text``: docs/run-directory.md) and the function is
   called on each row, by keyword as verl's reward manager calls it, in worker processes
   (:mod:`rldiag.scenario.reward_pool`). Identical calls (same data source, solution, ground truth
   and extra_info) are made once per run unless ``dedupe=False`` (stochastic or LLM-judge rewards).
2. The reward manager is applied (``naive``; ``dapo``'s overlong penalty from the run's config),
   the score rounded to float32 (verl's ``rm_scores`` dtype) and placed at the row's last valid
   response token in place of its captured scores (:class:`rldiag.executors.steps.RowScores`).
   A row whose call raised or timed out keeps its captured scores and is marked
   (``rescore_failed``): verl would give it 0.0 on a timeout, rldiag keeps what was captured on
   purpose, so that one slow row does not read as a wrong answer. A step where more than
   ``max_failed_share`` of the rows failed is a failed step; the others are written.
3. The steps are recomputed under the run's settings (or ``overrides``) on an executor, as
   :func:`rldiag.scenario.recompute.recompute` does (nothing reused: the inputs changed), and
   written through :class:`~rldiag.scenario.write.ScenarioWriter`. The per-row table gains
   ``score_captured``, ``rescore_failed`` and a ``reward_<key>`` column per reward component
   (``score`` is the engine's: the new one); ``metrics.parquet`` gains
   ``rldiag/reward/<key>/mean`` (a number result is recorded as verl records it: component
   ``acc``), ``rldiag/rescore/failed_rows`` and ``rldiag/rescore/changed_rows``; ``scenario.json``
   the function (spec, file, SHA-256, name), the manager, the timeout and whether calls were
   deduplicated.

Ctrl-C stops the workers and writes nothing: scores are only kept in memory until the scenario's
one atomic commit.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rldiag.config.settings import resolve_settings
from rldiag.errors import RewardError
from rldiag.executors import get_executor
from rldiag.executors.steps import DEFAULT_CHUNK_STEPS, Job, RowScores, StepOutcome
from rldiag.io.arrays import to_numpy
from rldiag.io.fs import RemotePath
from rldiag.io.loader import read_schema, read_table
from rldiag.io.rundir import RunDir, StepFile, Steps, parse_steps
from rldiag.io.schema import REWARD_INPUT_REPR_COLUMN
from rldiag.scenario.plan import Previous, check_name, check_settings, plan_steps
from rldiag.scenario.reward_fn import (
    CODE_EXEC_SOURCES,
    Manager,
    RewardFunction,
    manager_of,
    resolve_reward,
)
from rldiag.scenario.reward_pool import CallResult, PoolStats, score_calls
from rldiag.scenario.tokens import RESCORED_KEY
from rldiag.scenario.write import ScenarioReport, ScenarioWriter

__all__ = ["RescoreReport", "RowFailure", "StepInputs", "read_inputs", "rescore"]

#: a step whose failed share of rows is above this is a failed step (default)
MAX_FAILED_SHARE = 0.5
#: the per-row table's added columns
CAPTURED, FAILED = "score_captured", "rescore_failed"


@dataclass
class StepInputs:
    """One step's reward inputs, ``(rows,)`` each: the keyword arguments of each row's call
    (decoded), the JSON texts the deduplication keys on, the captured score (float64: the row's
    summed ``token_level_scores``, else its ``score``), the valid response length, the rows
    whose inputs JSON could not hold (their ``repr`` stored: never called), and the rows that are
    a V1 multi-output session's earlier outputs (``session_id``, ``output_index``: verl's reward
    loop scores a session on its last output alone; these are not called and keep their scores)."""

    step: int
    calls: list[dict[str, Any]]
    keys: list[tuple[str, str, str, str]]
    captured: np.ndarray
    lengths: np.ndarray
    unreadable: np.ndarray
    earlier: np.ndarray


@dataclass
class RowFailure:
    """A row whose reward call failed: it keeps its captured score."""

    step: int
    row: int
    data_source: str
    message: str


@dataclass
class RescoreReport:
    """A rescore: the scenario written, the function, what failed, what changed."""

    scenario: ScenarioReport
    function: RewardFunction
    manager: Manager
    dedupe: bool
    rows: int = 0
    calls: int = 0  # calls made (after deduplication)
    changed: int = 0  # rows whose float32 score differs from the captured one
    failures: list[RowFailure] = field(default_factory=list)
    steps_failed: dict[int, str] = field(default_factory=dict)  # too many rows failed
    workers_replaced: int = 0
    worker_pids: list[int] = field(default_factory=list)  # every worker process started (all ended)
    notes: list[str] = field(default_factory=list)
    score_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.scenario.ok


def _texts(table: pa.Table, name: str, sf: StepFile) -> list[str]:
    if name not in table.column_names:
        raise RewardError(f"{sf.path} (step {sf.step}): column {name!r} is missing; a rescore reads data_source, "
                          "ground_truth and response_text (docs/run-directory.md: capture with a tokenizer that "
                          "decodes, RLDIAG_CAPTURE_TOKENS=1 for verl)")
    return [str(v) for v in table[name].to_pylist()]


def _decode(text: str, sf: StepFile, row: int, column: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RewardError(f"{sf.path} (step {sf.step}), row {row}, column {column!r}: not JSON text: {exc}") from None


INPUT_COLUMNS = ("data_source", "ground_truth", "extra_info", "response_text", REWARD_INPUT_REPR_COLUMN,
                 "response_mask", "token_level_scores", "score", "session_id", "output_index")


def earlier_outputs(sessions: list[Any], outputs: np.ndarray) -> np.ndarray:
    """``(rows,)`` bool: the rows that are not their session's last output (highest ``output_index``)."""
    last: dict[Any, int] = {}
    for s, o in zip(sessions, outputs.tolist()):
        last[s] = max(last.get(s, o), o)
    return np.array([o < last[s] for s, o in zip(sessions, outputs.tolist())], dtype=bool)


def read_inputs(sf: StepFile) -> StepInputs:
    """One step's :class:`StepInputs` (RewardError naming file, step and column for a missing one)."""
    names = set(read_schema(sf).names)
    table = read_table(sf, [c for c in INPUT_COLUMNS if c in names])
    sources, truths, texts = (_texts(table, c, sf) for c in ("data_source", "ground_truth", "response_text"))
    extras = _texts(table, "extra_info", sf) if "extra_info" in names else ["{}"] * table.num_rows
    unreadable = (to_numpy(table[REWARD_INPUT_REPR_COLUMN].combine_chunks()).astype(bool)
                  if REWARD_INPUT_REPR_COLUMN in names else np.zeros(table.num_rows, dtype=bool))
    lengths = to_numpy(pc.list_value_length(table["response_mask"].combine_chunks())).astype(np.int64)
    if "token_level_scores" in names:
        arr = table["token_level_scores"].combine_chunks()
        flat = to_numpy(pc.list_flatten(arr)).astype(np.float64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        captured = np.add.reduceat(flat, offsets[:-1]) if flat.size else np.zeros(len(lengths))
        captured[lengths == 0] = 0.0
    else:
        captured = to_numpy(table["score"].combine_chunks()).astype(np.float64)
    earlier = (earlier_outputs(table["session_id"].to_pylist(),
                               to_numpy(table["output_index"].combine_chunks()).astype(np.int64))
               if {"session_id", "output_index"} <= names else np.zeros(table.num_rows, dtype=bool))
    calls: list[dict[str, Any]] = []
    keys: list[tuple[str, str, str, str]] = []
    for i, (ds, gt, ex, text) in enumerate(zip(sources, truths, extras, texts)):
        keys.append((ds, text, gt, ex))
        if unreadable[i] or earlier[i]:
            calls.append({})
            continue
        calls.append({"data_source": ds, "solution_str": text, "ground_truth": _decode(gt, sf, i, "ground_truth"),
                      "extra_info": _decode(ex, sf, i, "extra_info")})
    return StepInputs(sf.step, calls, keys, captured, lengths, unreadable, earlier)


def _check_code_exec(fn: RewardFunction, inputs: list[StepInputs], allow: bool) -> None:
    if not fn.verl_default or allow:
        return
    found = sorted({k[0] for s in inputs for k in s.keys} & CODE_EXEC_SOURCES)
    if found:
        raise RewardError(f"verl:default scores data source(s) {', '.join(found)} by running model-written code "
                          "(prime_code) or a sandbox; refused without --allow-code-exec")


def _score_all(fn: RewardFunction, inputs: list[StepInputs], workers: int, timeout: float, dedupe: bool,
               progress: Callable[[int, int, str], None] | None) -> tuple[list[list[CallResult]], int, PoolStats]:
    """Each step's per-row results, the calls made, the pool's stats."""
    unique: dict[Any, int] = {}
    calls: list[dict[str, Any]] = []
    where: list[list[int]] = []
    for s in inputs:
        idx = []
        for i, (call, key) in enumerate(zip(s.calls, s.keys)):
            if s.unreadable[i] or s.earlier[i]:
                idx.append(-2 if s.earlier[i] else -1)
                continue
            k = key if dedupe else (s.step, i)
            if k not in unique:
                unique[k] = len(calls)
                calls.append(call)
            idx.append(unique[k])
        where.append(idx)
    tick = (lambda done, total: progress(done, total, "scoring")) if progress else None
    results, stats = score_calls(fn, calls, workers, timeout, tick)
    repr_error = CallResult(error=f"RewardError: the row's ground_truth or extra_info is stored as its repr "
                                  f"({REWARD_INPUT_REPR_COLUMN}): JSON could not hold it")
    not_called = CallResult()  # an earlier output of a session: keeps its score, not a failure
    return ([[results[j] if j >= 0 else repr_error if j == -1 else not_called for j in idx] for idx in where],
            len(calls), stats)


def _step_scores(s: StepInputs, results: list[CallResult], manager: Manager
                 ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """``(scores float32, failed bool, components float64 (NaN where absent))`` of one step's rows."""
    n = len(results)
    scores = s.captured.astype(np.float32)
    failed = np.zeros(n, dtype=bool)
    comps: dict[str, np.ndarray] = {}
    for i, r in enumerate(results):
        if s.earlier[i]:
            continue
        if r.error is not None or r.score is None:
            failed[i] = True
            continue
        row_comps = dict(r.components)
        scores[i] = np.float32(manager.apply(r.score, row_comps, int(s.lengths[i])))
        for k, v in row_comps.items():
            comps.setdefault(k, np.full(n, np.nan))[i] = v
    return scores, failed, comps


def _with_columns(out: StepOutcome, captured: np.ndarray, failed: np.ndarray, comps: Mapping[str, np.ndarray],
                  scores: np.ndarray) -> None:
    """The outcome's per-row table and metrics row with the rescore's columns and metrics."""
    if out.row_table is not None:
        t = out.row_table
        order = to_numpy(t["row"].combine_chunks()).astype(np.int64) if "row" in t.column_names else np.arange(len(captured))
        t = t.append_column(CAPTURED, pa.array(captured[order], type=pa.float64()))
        t = t.append_column(FAILED, pa.array(failed[order].astype(np.int8), type=pa.int8()))
        for k in sorted(comps):
            t = t.append_column(f"reward_{k}", pa.array(comps[k][order], type=pa.float64()))
        out.row_table = t
    if out.metrics is not None:
        for k, v in comps.items():
            ok = ~np.isnan(v)
            out.metrics[f"rldiag/reward/{k}/mean"] = float(v[ok].mean()) if ok.any() else float("nan")
        out.metrics["rldiag/rescore/failed_rows"] = float(failed.sum())
        out.metrics["rldiag/rescore/changed_rows"] = float((scores != captured.astype(np.float32)).sum())


def rescore(
    run: str | Path | RemotePath,
    reward: str | RewardFunction,
    overrides: Mapping[str, Any] | None = None,
    name: str | None = None,
    steps: Steps = None,
    workers: int | None = None,
    timeout: float = 10.0,
    save_tokens: bool = False,
    dedupe: bool = True,
    allow_code_exec: bool = False,
    max_failed_share: float = MAX_FAILED_SHARE,
    device: str = "auto",
    executor: str = "local",
    progress: Callable[[int, int, str], None] | None = None,
) -> RescoreReport:
    """Score the run's rollouts with ``reward`` and recompute everything after it (module docstring).
    ``workers``: reward worker processes (default: the cores); ``timeout``: seconds per call."""
    rd = RunDir(run)
    overrides = dict(overrides or {})
    settings = resolve_settings(rd.path, overrides)
    check_settings(settings)
    fn = reward if isinstance(reward, RewardFunction) else resolve_reward(
        reward, settings.values, rd.path if isinstance(rd.path, Path) else None)
    manager = manager_of(settings.values)
    name = name or f"reward={fn.name}"
    check_name(name)
    if timeout <= 0:
        raise RewardError(f"--timeout {timeout}: must be > 0 seconds")
    files = {sf.step: sf for sf in rd.require_steps()}
    chosen = parse_steps(steps, sorted(files))
    t0 = time.perf_counter()
    inputs = [read_inputs(files[s]) for s in chosen]
    _check_code_exec(fn, inputs, allow_code_exec)
    n_workers = workers if workers is not None else (os.cpu_count() or 1)
    per_step, n_calls, stats = _score_all(fn, inputs, max(1, n_workers), timeout, dedupe, progress)
    replaced = stats.replaced
    score_s = time.perf_counter() - t0

    rescored: dict[int, RowScores] = {}
    extra: dict[int, tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray]] = {}
    failures: list[RowFailure] = []
    bad_steps: dict[int, str] = {}
    changed = 0
    for s, results in zip(inputs, per_step):
        scores, failed, comps = _step_scores(s, results, manager)
        for r in np.flatnonzero(failed).tolist():
            failures.append(RowFailure(s.step, r, s.keys[r][0], results[r].error or "no score"))
        if failed.size and failed.mean() > max_failed_share:
            first = int(np.flatnonzero(failed)[0])
            bad_steps[s.step] = (f"RewardError: {int(failed.sum())} of {failed.size} rows' reward calls failed "
                                 f"(more than {max_failed_share:.0%}); first: row {first}: {results[first].error}")
            continue
        changed += int((scores != s.captured.astype(np.float32)).sum())
        rescored[s.step] = RowScores(scores, failed | s.earlier)
        extra[s.step] = (s.captured, failed, comps, scores)

    report = RescoreReport(ScenarioReport(name=name, path=rd.layout.scenario(name).dir, settings=settings,
                                          device=device), fn, manager, dedupe, rows=sum(len(s.calls) for s in inputs),
                           calls=n_calls, changed=changed, failures=failures, steps_failed=bad_steps,
                           workers_replaced=replaced, worker_pids=stats.pids, score_seconds=score_s)
    if chosen and "extra_info" not in read_schema(files[chosen[0]]).names:
        report.notes.append("the run has no extra_info column (its trainer's batch did not carry it): the "
                            "function was called with extra_info={}")
    ok_steps = [s for s in chosen if s not in bad_steps]
    target = rd.layout.scenario(name)
    ex = get_executor(executor)
    try:
        dev = ex.start(device)
        job = Job(settings=settings, device=dev, save_tokens=save_tokens, rescored=rescored)
        plan = plan_steps(rd, files, ok_steps, job, Previous(), DEFAULT_CHUNK_STEPS)
        scenario = ScenarioReport(name=name, path=target.dir, settings=settings, device=dev, executor=ex.name)
        report.scenario = scenario
        with ScenarioWriter(target, scenario, Previous(), overrides, save_tokens) as writer:
            for step, error in sorted(bad_steps.items()):
                writer.record(StepOutcome(step, {"step": step, "file": files[step].path.name}, "failed", error=error))
            with closing(ex.run(plan)) as outcomes:
                for i, out in enumerate(outcomes, 1):
                    if out.status == "done" and out.step in extra:
                        _with_columns(out, *extra[out.step])
                    writer.record(out)
                    if progress:
                        progress(i, len(ok_steps), f"step {out.step}")
            writer.commit(time.perf_counter() - t0, {
                RESCORED_KEY: {**fn.record(), "manager": manager.record(), "timeout": timeout, "dedupe": dedupe,
                           "rows": report.rows, "calls": n_calls, "failed_rows": len(failures),
                           "changed_rows": changed, "workers_replaced": replaced}})
    finally:
        ex.close()
    return report
