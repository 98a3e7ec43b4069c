"""rldiag's Python API: what the command line, the app and a notebook call.

::

    import rldiag

    run = "runs/grpo"
    base = rldiag.recompute(run)                       # the run's own settings -> scenario "baseline"
    rloo = rldiag.recompute(run, estimator="rloo")     # what would RLOO have done? -> "adv_estimator=rloo"
    base.metrics                                       # polars frame, one row per step (metrics.parquet)
    rldiag.verify(run).status                          # "match", "mismatch" or "unverifiable"
    rldiag.compare(run, base.name, rloo.name).metrics_frame()
    rldiag.diagnose(run).findings_frame()
    rldiag.mismatch(run).causes                        # why rollout and trainer log-probs differ
    rldiag.rows(run, where="is_weight_seq > 5", sort="-advantage_mean")   # every row of every step, queried

Each function returns a dataclass: :class:`RecomputeResult`, or the report the command prints
(:class:`VerifyResult`, :class:`CompareResult`, :class:`EstimatorsResult`,
:class:`DiagnoseResult`, :class:`CheckResult`, :class:`ImportResult`), whose ``to_dict()`` is the
command's ``--json`` output and whose ``*_frame()`` methods give its tables as polars frames.
Errors are :class:`rldiag.errors.RldiagError` (the command line prints them and exits).

Every function that takes a while takes ``progress``, one callback shape for all:
``progress(done, total, what)``, called after each unit of work: ``done`` of ``total`` finished
(steps; for :func:`import_wandb`, kB of an offline log, history rows or batch files), ``what`` a
short text of the last one (``"step 12"``; ``"adv_estimator=rloo: step 12"`` while
:func:`compare_estimators` recomputes that scenario).

Importing this module is cheap: each function imports what it needs when called (torch and the
engine for a recompute, the W&B reader for an import), so the command line starts fast and
``import rldiag`` does not pay for it (:func:`warm_up` imports the heavy part up front).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import threading

    import polars as pl
    import pyarrow as pa

    from rldiag.analysis.agreement import TokenAgreement
    from rldiag.analysis.check import CheckReport as CheckResult
    from rldiag.analysis.compare import CompareReport as CompareResult
    from rldiag.analysis.compare import EstimatorComparison as EstimatorsResult
    from rldiag.analysis.layout_audit import LayoutAuditResult
    from rldiag.analysis.mismatch import MismatchDiagnosis as MismatchResult
    from rldiag.analysis.reward_change import RewardChange as RewardChangeResult
    from rldiag.analysis.reward_probe import ProbeReport as ProbeRewardResult
    from rldiag.analysis.tolerance import WHITENED_CONSTANT, Tol, Tolerances
    from rldiag.analysis.verify import VerifyReport as VerifyResult
    from rldiag.config.settings import Settings
    from rldiag.doctor import DoctorReport as DiagnoseResult
    from rldiag.doctor.calibration import calibration_for
    from rldiag.doctor.calibration import render_table as calibration_table
    from rldiag.doctor.counterfactual import CAVEAT as COUNTERFACTUAL_CAVEAT
    from rldiag.doctor.counterfactual import describe as describe_counterfactual
    from rldiag.doctor.follow import CounterfactualFn
    from rldiag.doctor.follow import FollowSummary as FollowDoctorResult
    from rldiag.doctor.live import HealthEvent
    from rldiag.executors import Executor
    from rldiag.importers.wandb_import import ImportReport as ImportResult
    from rldiag.importers.wandb_online import ApiFactory
    from rldiag.io.fs import RemotePath
    from rldiag.io.rundir import Steps
    from rldiag.scenario.reward_fn import RewardFunction
    from rldiag.scenario.sweep import SweepReport as SweepResult
    from rldiag.scenario.tokens import StepTokens as StepTokensResult
    from rldiag.scenario.write import ScenarioReport
    from rldiag.store.rows import SIGN_DIFFERS

#: every public name of rldiag's Python API, declared here once: ``rldiag.<name>`` offers each
#: (rldiag/__init__.py); those not defined in this module are :data:`_LAZY`'s keys (a test
#: checks both ways). docs/python-api.md lists them all.
__all__ = [
    # functions
    "calibrate", "calibration_for", "calibration_table", "check", "compare", "compare_estimators", "compare_so_far",
    "describe_counterfactual", "diagnose", "follow_doctor",
    "import_wandb", "band_metrics", "reference_bands",
    "layout_audit", "logged", "mismatch", "mismatch_tokens", "ray_executor", "probe_reward", "recompute", "rescore",
    "resolve_reward", "reusable_steps", "reward_changes", "rows", "rows_count", "rule_limits", "settings",
    "step_token_frame", "step_tokens", "sweep", "sweep_own", "sweep_summary", "sweeps", "tolerances", "verify",
    "warm_up", "whatif_options",
    # results
    "CheckResult", "CompareResult", "DiagnoseResult", "EstimatorsResult", "FollowDoctorResult", "HealthEvent",
    "ImportResult", "LayoutAuditResult", "MismatchResult", "RecomputeResult", "ProbeRewardResult", "RescoreResult",
    "RewardChangeResult", "RewardFunction",
    "StepTokensResult", "SweepResult",
    "TokenAgreement", "VerifyResult", "WhatifOptions",
    # what the functions take, and constants
    "COUNTERFACTUAL_CAVEAT", "Progress", "SIGN_DIFFERS", "Settings", "Tol", "Tolerances", "WHITENED_CONSTANT",
]

#: ``progress(done, total, what)``: ``done`` of ``total`` units finished, ``what`` the last one in words
Progress: TypeAlias = Callable[[int, int, str], None]
#: a run directory, or its object-store URI (``s3://bucket/run``) where the function supports one
Run: TypeAlias = "str | Path | RemotePath"

#: where the names of :data:`__all__` not defined in this module are (``module:attribute``): the
#: result types that are the commands' own reports, and the types their arguments take, resolved
#: on first use, so that importing this module imports none of them
_LAZY = {
    "VerifyResult": "rldiag.analysis.verify:VerifyReport",
    "CompareResult": "rldiag.analysis.compare:CompareReport",
    "EstimatorsResult": "rldiag.analysis.compare:EstimatorComparison",
    "DiagnoseResult": "rldiag.doctor.doctor:DoctorReport",
    "FollowDoctorResult": "rldiag.doctor.follow:FollowSummary",
    "HealthEvent": "rldiag.doctor.live:HealthEvent",
    "MismatchResult": "rldiag.analysis.mismatch:MismatchDiagnosis",
    "LayoutAuditResult": "rldiag.analysis.layout_audit:LayoutAuditResult",
    "SweepResult": "rldiag.scenario.sweep:SweepReport",
    "StepTokensResult": "rldiag.scenario.tokens:StepTokens",
    "CheckResult": "rldiag.analysis.check:CheckReport",
    "ImportResult": "rldiag.importers.wandb_import:ImportReport",
    "TokenAgreement": "rldiag.analysis.agreement:TokenAgreement",
    "Tolerances": "rldiag.analysis.tolerance:Tolerances",
    "Tol": "rldiag.analysis.tolerance:Tol",
    "Settings": "rldiag.config.settings:Settings",
    "RewardFunction": "rldiag.scenario.reward_fn:RewardFunction",
    "ProbeRewardResult": "rldiag.analysis.reward_probe:ProbeReport",
    "RewardChangeResult": "rldiag.analysis.reward_change:RewardChange",
    "SIGN_DIFFERS": "rldiag.store.rows:SIGN_DIFFERS",
    # verify's name for a difference that is the rounding noise of a whitened constant (a tied group or step)
    "WHITENED_CONSTANT": "rldiag.analysis.tolerance:WHITENED_CONSTANT",
    # a doctor finding's counterfactual in words (the sentences the CLI and the app show) and its caveat
    "describe_counterfactual": "rldiag.doctor.counterfactual:describe",
    "COUNTERFACTUAL_CAVEAT": "rldiag.doctor.counterfactual:CAVEAT",
    # the shipped calibration of a rule (and cause), and one split's figures as a markdown table
    "calibration_for": "rldiag.doctor.calibration:calibration_for",
    "calibration_table": "rldiag.doctor.calibration:render_table",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name].split(":")
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# ---- helpers -----------------------------------------------------------------------------------


def _by_step(progress: Progress | None) -> Callable[[int, int, int], None] | None:
    """The lower modules' ``progress(done, total, step)`` calling the API's ``progress(done, total, what)``."""
    if progress is None:
        return None

    def update(done: int, total: int, step: int) -> None:
        progress(done, total, f"step {step}")

    return update


def _frame(table: Any) -> pl.DataFrame:
    """An Arrow table as a polars frame."""
    import polars as pl

    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)  # a table gives a frame
    return frame


def _overrides(overrides: Mapping[str, Any] | None, estimator: str | None) -> dict[str, Any]:
    """``overrides`` plus ``estimator`` (short for ``algorithm.adv_estimator``, which it wins over)."""
    out = dict(overrides or {})
    if estimator:
        out["algorithm.adv_estimator"] = estimator
    return out


# ---- settings ----------------------------------------------------------------------------------


def settings(run: Run, overrides: Mapping[str, Any] | None = None, *, estimator: str | None = None) -> Settings:
    """The run's settings as a recompute resolves them: verl's defaults, then the run's config
    file, then ``overrides`` (verl's dotted keys; ``estimator`` is short for
    ``algorithm.adv_estimator``). ``settings(run)["algorithm.adv_estimator"]``."""
    from rldiag.config.settings import resolve_settings
    from rldiag.io.fs import as_path

    return resolve_settings(as_path(run), _overrides(overrides, estimator))


@dataclass(frozen=True)
class WhatifOptions:
    """What the app's What-if page offers for a run: the settings it edits (the schema's rows
    marked ``whatif``, rldiag/config/schema.py), the run's own value of each (an inherited null
    resolved: ``clip_ratio_high`` null is ``clip_ratio``), the values each string key takes (its
    registry's keys, or the schema row's ``values``), and the estimators that need groups of
    several responses per prompt (registered with ``grouped=True``)."""

    keys: tuple[str, ...]
    base: dict[str, Any]
    choices: dict[str, list[str]]
    grouped: tuple[str, ...]


def whatif_options(settings: Settings) -> WhatifOptions:
    """The What-if page's keys and choices for ``settings`` (:func:`settings` of the run)."""
    from rldiag.config.choices import choices, grouped_estimators
    from rldiag.config.schema import SETTINGS

    rows = [s for s in SETTINGS if s.whatif]
    listed = {s.key: choices(s) for s in rows}
    return WhatifOptions(keys=tuple(s.key for s in rows), base={s.key: settings.effective(s.key) for s in rows},
                         choices={k: v for k, v in listed.items() if v is not None},
                         grouped=tuple(grouped_estimators()))


def tolerances(
    *,
    bf16: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    metrics_rtol: float | None = None,
    metrics_atol: float | None = None,
    fields: Mapping[str, float | tuple[float, float]] | Iterable[str] = (),
) -> Tolerances:
    """The tolerances :func:`verify` compares with: fp32 ones (or bf16 ones with ``bf16``), with
    the per-token (``rtol``, ``atol``) and metric (``metrics_rtol``, ``metrics_atol``) defaults
    replaced where given, and per-field ones: ``{"actor/pg_loss": 1e-3, "critic/*": (1e-3, 1e-4)}``
    or the command line's ``["actor/pg_loss=1e-3", "critic/*=1e-3,1e-4"]``."""
    from rldiag.analysis.tolerance import Tol, Tolerances, parse_field_tolerance

    base = Tolerances.bf16() if bf16 else Tolerances()
    tokens = Tol(rtol if rtol is not None else base.tokens.rtol, atol if atol is not None else base.tokens.atol)
    metrics = Tol(metrics_rtol if metrics_rtol is not None else base.metrics.rtol,
                  metrics_atol if metrics_atol is not None else base.metrics.atol)
    per_field: dict[str, Tol] = {}
    if isinstance(fields, Mapping):
        for name, value in fields.items():
            r, a = value if isinstance(value, tuple) else (value, 0.0)
            per_field[name] = Tol(float(r), float(a))
    else:
        per_field = dict(parse_field_tolerance(text) for text in fields)
    return Tolerances(tokens=tokens, metrics=metrics, fields=per_field)


def logged(run: Run) -> pl.DataFrame:
    """What the trainer logged (``metrics.jsonl``): one row per step, ``step`` and one float
    column per metric (null where a step did not log it), as :attr:`RecomputeResult.metrics`
    is laid out; for a step logged twice (a resumed run) the later line wins."""
    from rldiag.analysis.logged import logged_metrics
    from rldiag.io.outputs import metrics_table
    from rldiag.io.rundir import RunDir

    rows = [{"step": step, **values} for step, values in logged_metrics(RunDir(run).metrics_file).items()]
    return _frame(metrics_table(rows))


# ---- recompute ---------------------------------------------------------------------------------


@dataclass
class RecomputeResult:
    """One recomputed scenario, as written to ``RUN/rldiag/scenarios/<name>/``."""

    name: str
    path: Path | RemotePath  # the scenario's directory
    #: one row per step done, in step order: ``step`` int64 and one float64 column per metric
    #: (verl's names; ``metrics.parquet``), as an Arrow table (:attr:`metrics`: as a polars frame)
    metrics_table: pa.Table
    settings: Settings  # every setting, resolved
    device: str
    executor: str = "local"
    steps_done: list[int] = field(default_factory=list)
    steps_failed: dict[int, str] = field(default_factory=dict)  # step -> why
    steps_reused: list[int] = field(default_factory=list)  # unchanged since the last recompute
    #: step -> traceback, for the failed steps a bug in rldiag failed (their ``steps_failed`` says ``InternalError``)
    internal_errors: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    rows: int = 0  # rows recomputed (reused steps not counted)
    tokens: int = 0  # tokens recomputed
    #: the scenario of another name, equal by resolved settings, whose steps were reused (None: none)
    reused_from: str | None = None
    #: overrides equal to the run's own values (the what-if changes nothing there), in words
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every chosen step was written."""
        return not self.steps_failed

    @cached_property
    def metrics(self) -> pl.DataFrame:
        """One row per step done, in step order: ``step`` and verl's metric names
        (``metrics.parquet``), a polars frame of :attr:`metrics_table` made when first read (so
        ``rldiag recompute``, which prints from the Arrow table, does not import polars)."""
        return _frame(self.metrics_table)

    @classmethod
    def from_report(cls, rep: ScenarioReport) -> RecomputeResult:
        from rldiag.io.outputs import metrics_table

        return cls(name=rep.name, path=rep.path, metrics_table=metrics_table(rep.metrics), settings=rep.settings,
                   device=rep.device, executor=rep.executor, steps_done=list(rep.steps_done), steps_failed=dict(rep.steps_failed),
                   steps_reused=sorted(rep.steps_reused), internal_errors=dict(rep.internal), seconds=rep.seconds,
                   rows=rep.rows, tokens=rep.tokens, reused_from=rep.reused_from, warnings=list(rep.warnings))

    def token_frame(self, step: int) -> pl.DataFrame:
        """One step's per-token outputs (a recompute with ``save_tokens``): one row per batch
        row, list columns of advantages, returns, ratio, IS weight, ... (docs/run-directory.md)."""
        from rldiag.errors import RunDirError
        from rldiag.io.arrays import read_parquet
        from rldiag.io.fs import arrow_source
        from rldiag.io.run_layout import ScenarioLayout

        p = ScenarioLayout(self.path).tokens_file(int(step))
        if not p.is_file():
            raise RunDirError(f"{p}: no per-token outputs for step {step} (recompute with save_tokens=True)")
        source, fs = arrow_source(p)
        return _frame(read_parquet(source, filesystem=fs))


def recompute(
    run: Run,
    overrides: Mapping[str, Any] | None = None,
    *,
    estimator: str | None = None,
    name: str | None = None,
    steps: Steps = None,
    device: str = "auto",
    save_tokens: bool = False,
    reuse: bool = True,
    executor: str | Executor = "local",
    progress: Progress | None = None,
    follow: bool = False,
    poll_seconds: float = 2.0,
    idle_timeout: float | None = None,
    on_update: Callable[[RecomputeResult], None] | None = None,
) -> RecomputeResult:
    """Recompute ``run`` under its own settings plus ``overrides`` (verl's dotted keys;
    ``estimator`` is short for ``algorithm.adv_estimator``) and write the scenario ``name``
    (default ``baseline``, or a slug of the overrides: ``adv_estimator=rloo``).

    ``steps``: ``"12"``, ``"10:20"``, ``"10:"``, ``":20"``, ``"1,5,9"`` or the step numbers (``[1, 5, 9]``;
    default all).
    ``device``: ``auto``, ``cpu`` or ``cuda``. ``save_tokens`` also writes per-token outputs
    (:meth:`RecomputeResult.token_frame`). Steps unchanged since the last recompute of the
    scenario are reused unless ``reuse`` is False. ``executor``: ``"local"`` (this process),
    ``"ray"``, or one from :func:`ray_executor` (started here, closed by the caller).
    A step that fails is in ``steps_failed`` and the others are written.

    ``follow=True`` keeps the scenario up to date with a run still writing batches (``rldiag
    recompute --follow``): it recomputes again (unchanged steps reused) whenever a batch file
    appears or changes, looking every ``poll_seconds``, calls ``on_update`` with each result,
    and returns the last one after ``idle_timeout`` seconds without a new file (never when
    None: stop it with Ctrl-C, a ``KeyboardInterrupt``).
    """
    options: dict[str, Any] = dict(name=name, steps=steps, device=device, save_tokens=save_tokens, reuse=reuse,
                                   executor=executor, progress=_by_step(progress))
    if not follow:
        from rldiag.io.file_hash import early_hashes, recompute_files

        # the files this process will hash, hashed while it imports torch and the engine (a core
        # is idle meanwhile); each step's fetch takes its file's hash from there
        early = recompute_files(run, steps, reuse) if executor == "local" else []
        with early_hashes(early):
            from rldiag.scenario.recompute import recompute as run_recompute

            return RecomputeResult.from_report(run_recompute(run, _overrides(overrides, estimator), **options))
    from rldiag.scenario.recompute import follow as run_follow

    def update(rep: ScenarioReport) -> None:
        if on_update is not None:
            on_update(RecomputeResult.from_report(rep))

    rep = run_follow(run, _overrides(overrides, estimator), poll_seconds=poll_seconds, idle_timeout=idle_timeout,
                     on_update=update, **options)
    return RecomputeResult.from_report(rep)


@dataclass
class RescoreResult:
    """A re-scored run (``rldiag rescore``): the scenario written and what the reward calls did."""

    scenario: RecomputeResult
    function: RewardFunction
    manager: str  # the reward manager reproduced: naive or dapo
    dedupe: bool  # identical calls made once
    rows: int  # rows scored
    calls: int  # calls made (after deduplication)
    changed: int  # rows whose (float32) score differs from the captured one
    #: the rows whose call raised or timed out (they keep their captured score): step, row, data_source, message
    failures: pl.DataFrame
    steps_failed: dict[int, str]  # every failed step: too many failed rows, or the recompute's own failures
    workers_replaced: int  # workers killed (stuck past the timeout, or dead) and replaced
    worker_pids: list[int] = field(default_factory=list)  # every worker process started (each ended and reaped)
    notes: list[str] = field(default_factory=list)
    score_seconds: float = 0.0  # reading the inputs and calling the function

    @property
    def ok(self) -> bool:
        """Every chosen step was written."""
        return not self.steps_failed


def resolve_reward(run: Run, reward: str) -> RewardFunction:
    """The reward function ``reward`` names for ``run`` (``FILE.py:NAME``, ``MODULE:NAME``,
    ``verl:default`` or ``from-config``: the run's ``reward.custom_reward_function``): its file,
    SHA-256, name and the keyword arguments merged into each call. Loads and runs nothing."""
    from rldiag.io.fs import as_path
    from rldiag.scenario.reward_fn import resolve_reward as resolve

    path = as_path(run)
    return resolve(reward, settings(run).values, path if isinstance(path, Path) else None)


def rescore(
    run: Run,
    reward: str | RewardFunction,
    overrides: Mapping[str, Any] | None = None,
    *,
    estimator: str | None = None,
    name: str | None = None,
    steps: Steps = None,
    workers: int | None = None,
    timeout: float = 10.0,
    save_tokens: bool = False,
    dedupe: bool = True,
    allow_code_exec: bool = False,
    device: str = "auto",
    progress: Progress | None = None,
) -> RescoreResult:
    """Score the run's saved rollouts with ``reward`` (see :func:`resolve_reward`), place each new
    score (float32) at its row's last valid token, and recompute everything after it under the
    run's settings plus ``overrides``: the scenario ``name`` (default ``reward=<function name>``).
    Calls run in ``workers`` processes (default: the cores), each under ``timeout`` seconds; a
    row whose call fails keeps its captured score (``result.failures``); identical calls are made
    once unless ``dedupe`` is False. ``allow_code_exec``: let ``verl:default`` score data sources
    that run model-written code. ``progress(done, total, what)``: ``what`` is ``"scoring"``
    while the function runs, then ``"step N"``."""
    from rldiag.scenario.rescore import rescore as run_rescore

    rep = run_rescore(run, reward, _overrides(overrides, estimator), name=name, steps=steps, workers=workers,
                      timeout=timeout, save_tokens=save_tokens, dedupe=dedupe, allow_code_exec=allow_code_exec,
                      device=device, progress=progress)
    import polars as pl

    failures = pl.DataFrame({"step": [f.step for f in rep.failures], "row": [f.row for f in rep.failures],
                             "data_source": [f.data_source for f in rep.failures],
                             "message": [f.message for f in rep.failures]},
                            schema={"step": pl.Int64, "row": pl.Int64, "data_source": pl.String, "message": pl.String})
    scenario = RecomputeResult.from_report(rep.scenario)
    return RescoreResult(scenario=scenario, function=rep.function, manager=rep.manager.name, dedupe=rep.dedupe,
                         rows=rep.rows, calls=rep.calls, changed=rep.changed, failures=failures,
                         steps_failed=dict(scenario.steps_failed), workers_replaced=rep.workers_replaced,
                         worker_pids=list(rep.worker_pids),
                         notes=list(rep.notes), score_seconds=rep.score_seconds)


def probe_reward(run: Run, reward: str | RewardFunction, *, prompts: int = 256, workers: int | None = None,
                 timeout: float = 10.0, allow_code_exec: bool = False,
                 progress: Progress | None = None) -> ProbeRewardResult:
    """``rldiag probe-reward``: ``reward`` scores degenerate replies (empty, the prompt echoed, the
    ground truth alone, a real reply twice or cut in half, another prompt's reply) beside the
    run's real ones for ``prompts`` of its prompts; ``result.findings`` holds a ``reward_shortcut``
    finding for each probe that earns at least half the real replies' mean (docs/rescore.md)."""
    from rldiag.analysis.reward_probe import probe_reward as run_probe

    return run_probe(run, reward, prompts=prompts, workers=workers, timeout=timeout,
                     allow_code_exec=allow_code_exec, progress=progress)


def reward_changes(run: Run, a: str, b: str, *, steps: Steps = None, top: int = 10) -> RewardChangeResult | None:
    """What a rescore changed, when ``a`` or ``b`` is a rescored scenario (None otherwise): the rows
    whose score changed (and by data source), the groups that gained or lost signal, the rows whose
    mean advantage changed sign, and the ``top`` tokens whose gradient weight changed most (where
    both scenarios have per-token outputs), with their text. ``rldiag compare`` prints it."""
    from rldiag.analysis.reward_change import reward_changes as run_changes

    return run_changes(run, a, b, steps=steps, top=top)


def reusable_steps(run: Run, name: str = "baseline", overrides: Mapping[str, Any] | None = None, *,
                   estimator: str | None = None, save_tokens: bool = False) -> list[int]:
    """The steps of scenario ``name`` that :func:`recompute` (with these ``overrides`` and
    ``save_tokens``) would reuse rather than compute, should their batch files be unchanged
    (the recompute checks each file's size, mtime and SHA-256): those its last write holds
    under the same settings and rldiag version, with their per-row (and per-token) files; none
    when the scenario does not exist or was written otherwise (an adaptive KL controller: never).
    The recompute's own planner decides it (the app's background baseline plans its chunks with it)."""
    from rldiag.io.fs import as_path
    from rldiag.scenario.plan import reusable_steps as plan_reusable

    return plan_reusable(as_path(run), name, settings(run, overrides, estimator=estimator), save_tokens)


def step_tokens(
    run: Run,
    step: int,
    scenario: str = "baseline",
    *,
    device: str = "cpu",
    progress: Progress | None = None,
) -> StepTokensResult:
    """One step's per-token outputs of ``scenario`` (advantages, ratio, IS weight, ...), for a
    page or a notebook that looks at that step: the scenario's own tokens file when its recompute
    saved tokens, else a one-step recompute with ``save_tokens`` into the scenario's token cache
    (``RUN/rldiag/cache/<scenario>/``, the few steps looked at last kept and reused while their
    batch files and the settings stay the same). ``result.path`` is the tokens file (None with
    ``result.error`` when the step fails)."""
    from rldiag.scenario.tokens import step_tokens as run_step_tokens

    return run_step_tokens(run, step, scenario, device=device, progress=_by_step(progress))


def ray_executor(address: str | None = None, gpus_per_task: float = 1.0) -> Executor:
    """An executor that spreads a recompute's steps over a Ray cluster (``pip install
    'rldiag[ray]'``): ``address`` the cluster to join (default ``RAY_ADDRESS``, else a local Ray),
    ``gpus_per_task`` the GPUs each task asks for on GPUs. Pass it to :func:`recompute` (any number
    of times) and ``close()`` it when done."""
    from rldiag.executors.ray_cluster import RayExecutor

    return RayExecutor(address=address, gpus_per_task=gpus_per_task)


#: the modules :func:`warm_up` imports (a process that forks workers may preload them by name)
WARM_MODULES = ("rldiag.scenario.recompute", "rldiag.analysis.verify", "rldiag.analysis.compare", "rldiag.doctor")


def warm_up() -> None:
    """Import the modules the recompute, verify, compare and doctor need (torch, the engine), so
    that the first call does not wait for them (the app does this before it serves)."""
    for module in WARM_MODULES:
        importlib.import_module(module)


# ---- verify, compare, doctor, check ------------------------------------------------------------


def verify(
    run: Run,
    overrides: Mapping[str, Any] | None = None,
    *,
    estimator: str | None = None,
    steps: Steps = None,
    tolerances: Tolerances | None = None,
    masked_only: bool = False,
    candidates: bool = True,
    candidate_steps: int = 2,
    device: str = "cpu",
    progress: Progress | None = None,
) -> VerifyResult:
    """Recompute ``run`` under its own settings (plus ``overrides``) and compare every per-token
    column and metric it logged (``tolerances``: :func:`tolerances`, default fp32). On a
    mismatch, single-setting candidates are tried on the first ``candidate_steps`` mismatching
    steps (``candidates=False``: not). ``result.status``: ``match``, ``mismatch`` or
    ``unverifiable``; ``result.fields_frame()``: one row per compared field."""
    from rldiag.analysis.verify import verify_run

    return verify_run(run, _overrides(overrides, estimator), steps=steps, tolerances=tolerances,
                      masked_only=masked_only, candidates=candidates, candidate_steps=max(1, candidate_steps),
                      device=device, progress=_by_step(progress))


def compare(
    run: Run,
    a: str,
    b: str,
    *,
    steps: Steps = None,
    recompute_missing: bool = True,
    device: str = "auto",
    progress: Progress | None = None,
    on_step: Callable[[TokenAgreement], None] | None = None,
) -> CompareResult:
    """Compare side ``a`` with side ``b`` (scenario names, or ``"logged"``): per-step metric
    deltas (B - A, ``result.metrics_frame()``) and the per-token agreement of the advantages
    (``result.tokens_frame()``), written to ``RUN/rldiag/comparisons/<a>__vs__<b>/``. A scenario
    without per-token outputs is recomputed with them first, unless ``recompute_missing`` is
    False. ``on_step`` gets each step's agreement as soon as it is known."""
    from rldiag.analysis.compare import compare as run_compare

    return run_compare(run, a, b, steps=steps, recompute_missing=recompute_missing, device=device,
                       progress=_by_step(progress), on_step=on_step)


def compare_so_far(agreements: Sequence[TokenAgreement]) -> tuple[dict[str, Any], pl.DataFrame]:
    """What a running :func:`compare` has found so far, from the agreements its ``on_step`` got:
    the summary (as the finished comparison's ``summary``) and the per-step frame the app draws."""
    from rldiag.analysis.agreement import agreement_frame
    from rldiag.analysis.compare import summarise

    return summarise(list(agreements)), agreement_frame(list(agreements))


def compare_estimators(
    run: Run,
    estimators: Sequence[str],
    *,
    steps: Steps = None,
    device: str = "auto",
    progress: Progress | None = None,
) -> EstimatorsResult:
    """Recompute (or reuse) one scenario per estimator (``adv_estimator=<name>``, with per-token
    outputs) and compare every pair, in the order given (``result.pairs``;
    ``result.summary_frame()``: one row per pair)."""
    from rldiag.analysis.compare import compare_estimators as run_compare_estimators

    current = {"name": ""}

    def on_scenario(name: str) -> None:
        current["name"] = name

    def update(done: int, total: int, step: int) -> None:
        if progress is not None:
            progress(done, total, f"{current['name']}: step {step}")

    return run_compare_estimators(run, list(estimators), steps=steps, device=device,
                                  progress=update if progress is not None else None, on_scenario=on_scenario)


def sweep(
    run: Run,
    grid: Mapping[str, Sequence[Any]] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    estimators: Sequence[str] | None = None,
    name: str | None = None,
    steps: Steps = None,
    save_tokens: bool = False,
    reuse: bool = True,
    device: str = "auto",
    executor: str | Executor = "local",
    progress: Progress | None = None,
) -> SweepResult:
    """Many what-ifs from one read of the run: one scenario per combination of ``grid`` (verl's
    dotted key -> the values to try; ``estimators`` is short for ``algorithm.adv_estimator``),
    each with the fixed ``overrides`` too, written as :func:`recompute` writes it (named by the
    slug of its overrides), and ``RUN/rldiag/sweeps/<name>/`` (``summary.parquet``, ``sweep.json``;
    default name ``sweep-`` and 8 hex digits of the grid's hash). Each step file is read,
    validated and hashed once, and each stage of the engine runs once for the scenarios that
    agree on its settings; unchanged steps of each scenario are reused (``reuse=False``: not).
    ``save_tokens`` refuses when the token tables would not fit on the disk. ``executor="ray"``
    (or :func:`ray_executor`): each scenario recomputed on its own on the cluster.
    ``result.summary_frame()``: every scenario, step and metric; ``result.table_frame()``: the
    mean over the steps per scenario."""
    from rldiag.scenario.sweep import sweep as run_sweep

    return run_sweep(run, grid, overrides, estimators=estimators, name=name, steps=steps, save_tokens=save_tokens,
                     reuse=reuse, device=device, executor=executor, progress=_by_step(progress))


def sweeps(run: Run) -> list[str]:
    """The sweeps written into the run (``RUN/rldiag/sweeps/<name>/`` with its ``summary.parquet``
    and ``sweep.json``: complete), the latest first (by the time its ``sweep.json`` was written)."""
    from rldiag.io.run_layout import RunLayout

    root = RunLayout(run).sweeps_dir
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        layout = RunLayout(run).sweep(d.name)
        if d.is_dir() and layout.summary.is_file() and layout.meta.is_file():
            found.append((layout.meta.stat().st_mtime_ns, d.name))
    return [name for _, name in sorted(found, reverse=True)]


def sweep_summary(run: Run, name: str) -> pl.DataFrame:
    """The saved sweep ``name``'s ``summary.parquet``, as :meth:`SweepResult.summary_frame` gives
    it: ``scenario``, ``step``, ``metric``, ``value`` and one string column per swept key (its
    value as YAML text). Raises :class:`~rldiag.errors.ConfigError` when there is no such sweep."""
    from rldiag.errors import ConfigError
    from rldiag.io.arrays import read_parquet
    from rldiag.io.fs import arrow_source
    from rldiag.io.run_layout import RunLayout

    path = RunLayout(run).sweep(name).summary
    if not path.is_file():
        raise ConfigError(f"no sweep {name!r} in {run} (no {path})")
    return _frame(read_parquet(*arrow_source(path)))


def rule_limits() -> dict[str, dict[str, Any]]:
    """The doctor's healthy side of each metric a built-in threshold rule judges (``metric ->
    {"rule", "above", "below", "abs", "title"}``): the one source of every healthy band the app
    quotes (the Step page's checklist reads it)."""
    from rldiag.doctor.rules import metric_limits

    return metric_limits()


def sweep_own(run: Run, name: str) -> str | None:
    """The scenario of the saved sweep ``name`` whose resolved settings are the run's own (its
    ``sweep.json``'s ``own``; None when the grid has none, or the sweep predates it). Raises
    :class:`~rldiag.errors.ConfigError` when there is no such sweep."""
    import json

    from rldiag.errors import ConfigError
    from rldiag.io.run_layout import RunLayout

    path = RunLayout(run).sweep(name).meta
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"no sweep {name!r} in {run} ({path}: {exc})") from None
    own = meta.get("own") if isinstance(meta, dict) else None
    return own if isinstance(own, str) else None


def diagnose(
    run: Run,
    overrides: Mapping[str, Any] | None = None,
    *,
    estimator: str | None = None,
    rules_files: Iterable[str | Path] = (),
    steps: Steps = None,
    recompute: bool = True,
    device: str = "cpu",
    progress: Progress | None = None,
    counterfactual: bool = True,
    reward: str | RewardFunction | None = None,
) -> DiagnoseResult:
    """The doctor: the health rules (built in, plus ``rules_files``) over the run's logged
    metrics and, unless ``recompute`` is False, its recomputed ones (written as the scenario
    :func:`recompute` writes for these overrides, ``baseline`` for none; unchanged steps reused).
    ``result.healthy``; ``result.findings_frame()``: one row per finding, most severe first.
    ``counterfactual``: each finding whose rule names the settings that address it carries what
    they change on its window's batches (``finding.counterfactual``; computed in memory).
    ``reward``: also probe that reward function for shortcuts (:func:`probe_reward`), its
    ``reward_shortcut`` findings added to the report's."""
    from rldiag.doctor import diagnose as run_diagnose

    rep = run_diagnose(run, rules_files=rules_files, overrides=_overrides(overrides, estimator), steps=steps,
                       recompute=recompute, device=device, progress=_by_step(progress), counterfactual=counterfactual)
    if reward is not None:
        rep.findings.extend(probe_reward(run, reward).findings)
    return rep


def follow_doctor(
    run: Run,
    overrides: Mapping[str, Any] | None = None,
    *,
    estimator: str | None = None,
    rules_files: Iterable[str | Path] = (),
    recompute: bool = True,
    device: str = "cpu",
    poll_seconds: float = 0.5,
    idle_timeout: float | None = None,
    on_event: Callable[[HealthEvent], None] | None = None,
    stop: threading.Event | None = None,
    counterfactual: bool = True,
    counterfactual_fn: CounterfactualFn | None = None,
) -> FollowDoctorResult:
    """``rldiag doctor --follow``: the doctor of a run that is still writing. Catches up with the
    steps on disk (each finding that holds at the end once, as a ``fired`` event at the step from
    which it held), then looks every ``poll_seconds`` for new ``metrics.jsonl`` lines and batch
    files (recomputed as :func:`recompute` with ``follow=True`` does, unchanged steps reused) and
    calls ``on_event(event)`` (a ``HealthEvent``: ``event.to_dict()`` is ``{"event": "fired" |
    "changed" | "cleared", "step": N, "finding": {...}}``) for each finding that fires, changes
    or clears. Returns after ``idle_timeout`` seconds without a new line or file, or once
    ``stop`` is set (never otherwise: Ctrl-C, a ``KeyboardInterrupt``, ends it). After a finding
    fires, what the settings that address it would change is computed in the background
    (``counterfactual_fn``, default ``rldiag.doctor.counterfactual.counterfactuals`` where
    installed; ``counterfactual=False``: none) and arrives as a ``changed`` event."""
    from rldiag.doctor.follow import DoctorFollower

    follower = DoctorFollower(run, _overrides(overrides, estimator), rules_files=rules_files, recompute=recompute,
                              device=device, on_event=on_event, counterfactual=counterfactual,
                              counterfactual_fn=counterfactual_fn)
    return follower.follow(poll_seconds=poll_seconds, idle_timeout=idle_timeout, stop=stop)


def mismatch(
    run: Run,
    overrides: Mapping[str, Any] | None = None,
    *,
    steps: Steps = None,
    device: str = "cpu",
    examples: bool = True,
    save_tokens: bool | None = None,
    write: bool = True,
    progress: Progress | None = None,
) -> MismatchResult:
    """Why the rollout engine's log-probs differ from the trainer's: the causes
    (``sampling_truncation``, ``temperature``, ``precision``, ``misaligned``, ``policy_lag``,
    ``outlier_tokens``) with their confidence, severity, steps, evidence and remedy, from the
    per-step fingerprints a recompute writes (``rldiag/mismatch/*``: the scenario :func:`recompute`
    writes for ``overrides``, ``baseline`` for none, unchanged steps reused) and the run's
    sampling settings. ``examples``: each cause lists the tokens with the largest gaps (read back
    from the batch files). ``save_tokens``: whether the recompute saves per-token values (None:
    keep what the scenario saved, so that a diagnosis never drops the tokens an earlier recompute
    wrote). ``write=False`` writes nothing (a run rldiag may not write into): the steps are
    recomputed in memory (the same metrics, nothing kept). ``result.causes`` is
    empty when the two streams agree."""
    from rldiag.analysis.mismatch_run import diagnose_rows
    from rldiag.config.settings import resolve_settings, scenario_slug
    from rldiag.io.rundir import RunDir
    from rldiag.scenario.memory import recompute_in_memory
    from rldiag.scenario.recompute import recompute as run_recompute

    rd = RunDir(run)
    opts = _overrides(overrides, None)
    resolved = resolve_settings(rd.path, opts)
    if write:
        if save_tokens is None:
            save_tokens = bool(rd.layout.scenario(scenario_slug(opts)).token_steps())
        rows = run_recompute(rd.path, opts, steps=steps, device=device, save_tokens=save_tokens,
                             progress=_by_step(progress)).metrics
    else:
        (kept,) = recompute_in_memory(rd, [resolved], steps, device, progress=_by_step(progress))
        rows = [{"step": step, **values} for step, values in sorted(kept.metrics.items())]
    files = {sf.step: sf for sf in rd.step_files()} if examples else None
    return diagnose_rows(rows, {**resolved.values, **resolved.resolved()}, files, resolved)


def calibrate(corpus: str | Path, *, device: str = "cpu", progress: Progress | None = None,
              write: bool = True) -> dict[str, Any]:
    """``rldiag calibrate``: every doctor rule and gap cause measured on a labelled corpus
    (``python -m rldiag.toy.corpus OUT``): each run recomputed and the doctor replayed step by
    step as ``doctor --follow`` would; per split (``result["splits"]["test"]``), per rule and
    cause: runs, TP, FP, FN, precision and recall (Wilson 95 % intervals), false alarms per 100
    healthy steps, the median lead time and a status (:mod:`rldiag.analysis.calibrate`). Writes
    ``CORPUS/calibration.json`` unless ``write`` is False."""
    from rldiag.analysis.calibrate import calibrate as run_calibrate

    return run_calibrate(corpus, device=device, progress=progress, write=write)


def band_metrics() -> list[str]:
    """The metrics with a published reference band (``rldiag/doctor/bands.yaml``, docs/bands.md)."""
    from rldiag.doctor.bands import band_metrics as metrics

    return metrics()


def reference_bands(run: Run, values: Mapping[str, Sequence[float]],
                    overrides: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Where the run's values sit in their reference bands: for each metric of ``values``
    (``metric -> per-step values``) with a band, the mean of its finite values placed among the
    bands the run's resolved settings select (:func:`rldiag.doctor.bands.place_means`): ``metric``,
    ``value``, ``steps``, ``statistic``, ``bands`` (name, bounds, where, source) and ``text``
    ("rollout_corr/k3_kl 0.003: above the dense band [1e-05, 0.001], inside the MoE band ...")."""
    from rldiag.doctor.bands import place_means

    s = settings(run, overrides)
    return place_means(values, {**s.values, **s.resolved()})


def mismatch_tokens(run: Run, step: int, overrides: Mapping[str, Any] | None = None) -> pl.DataFrame:
    """One step's actor tokens as the mismatch diagnosis sees them, one row per token: ``row``,
    ``position``, ``old_log_prob``, ``rollout_log_prob``, ``gap`` (old - rollout), ``kl`` (gap^2 / 2),
    ``kl_share``, ``old_next`` / ``old_prev`` (the trainer's log-prob one position later / earlier
    in the row), ``policy_lag`` (with ``policy_version``) and ``token`` (with ``response_tokens``)."""
    from rldiag.analysis.mismatch_run import step_tokens
    from rldiag.config.settings import resolve_settings
    from rldiag.errors import RunDirError
    from rldiag.io.rundir import RunDir

    rd = RunDir(run)
    files = {sf.step: sf for sf in rd.step_files()}
    if int(step) not in files:
        raise RunDirError(f"{rd.batches_dir}: no batch file for step {step}")
    return _frame(step_tokens(files[int(step)], resolve_settings(rd.path, _overrides(overrides, None))))


def step_token_frame(run: Run, step: int, scenario: str = "baseline", *,
                     columns: Sequence[str] | None = None) -> pl.DataFrame:
    """One step's per-token values under ``scenario`` as a frame, one row per batch row: ``row``
    and list columns of advantages, returns, rewards, the mask after rollout correction, ratio,
    IS weight, reference KL, turn, loss weight (those the run's columns allow;
    docs/run-directory.md): :func:`step_tokens`'s file read back; ``columns``: only those (and
    ``row``; a name the file lacks is left out). Raises :class:`~rldiag.errors.ComputeError` when
    the step cannot be computed."""
    from rldiag.errors import ComputeError
    from rldiag.io.arrays import parquet_file
    from rldiag.io.fs import arrow_source

    got = step_tokens(run, int(step), scenario)
    if got.path is None:
        raise ComputeError(f"step {step} under scenario {scenario!r}: {got.error}")
    source, fs = arrow_source(got.path)
    pf = parquet_file(source, fs)
    if columns is None:
        return _frame(pf.read())
    have = set(pf.schema_arrow.names)
    return _frame(pf.read(columns=["row"] + [c for c in columns if c != "row" and c in have]))


def rows(
    run: Run,
    where: str | None = None,
    sort: str | None = None,
    limit: int | None = 50,
    offset: int = 0,
    scenario: str = "baseline",
    search: str | None = None,
    *,
    other: str | None = None,
    preview: int = 0,
    group_by: str | None = None,
) -> pl.DataFrame:
    """Every row of every step, queried: the scenario's per-row tables (``rows/step_<N>.parquet``,
    written by every recompute: step, row, length, score, advantage_mean, is_weight_seq, ...,
    then the batch's uid and scalar columns) filtered, sorted and paged in DuckDB, never loaded
    whole. ``where``: one SQL boolean expression over the columns (``"is_weight_seq > 5 AND
    length >= 512"``; a column, function or keyword it may not use is a QueryError naming it).
    ``sort``: a column, ``"-col"`` for descending (then step, row; default step, row). ``limit``
    rows (None: all) from ``offset``. ``search``: rows whose response text (the batch files'
    ``response_tokens``) contains it, case-insensitively. ``other``: a second scenario joined by
    (step, row), its values as ``other_<name>`` columns (``where=SIGN_DIFFERS``: the rows whose
    mean advantage changes sign under it). ``preview``: a ``response`` column with the first
    ``preview`` characters of each returned row's response. A scenario without per-row tables
    is a RunDirError saying to recompute first.

    ``group_by``: ``uid`` (a prompt group of a step: the keys ``step``, ``uid``), ``step`` or
    ``data_source``: one row per group of the matching rows, with ``rows``, ``first_row``, the
    per-row counts (length, actor_tokens, turns, clipped_tokens) summed as ``<col>_sum`` and every
    other numeric column averaged as ``<col>_mean``; ``sort`` takes those names, or a per-row
    column's plain name for its sum (a count) or mean: ``rows(run, group_by="uid",
    sort="-clipped_tokens", limit=5)`` are the groups that drive the clipping. ``preview`` gives
    each group's first response. ``other`` does not combine with it."""
    from rldiag.store.rows import query_groups, query_rows

    if group_by is not None:
        if other is not None:
            from rldiag.errors import QueryError

            raise QueryError("group_by and other do not combine: group one scenario at a time")
        return _frame(query_groups(run, group_by, where, sort, limit, offset, scenario, search, preview=preview))
    return _frame(query_rows(run, where, sort, limit, offset, scenario, search, other=other, preview=preview))


def rows_count(
    run: Run,
    where: str | None = None,
    scenario: str = "baseline",
    search: str | None = None,
    *,
    other: str | None = None,
    group_by: str | None = None,
) -> int:
    """How many rows :func:`rows` matches with the same ``where``, ``search`` and ``other`` (with
    ``group_by``: how many groups)."""
    from rldiag.store.rows import count_groups, count_rows

    if group_by is not None:
        return count_groups(run, group_by, where, scenario, search)
    return count_rows(run, where, scenario, search, other=other)


def layout_audit(
    run: Run,
    overrides: Mapping[str, Any] | None = None,
    *,
    steps: Steps = None,
    device: str = "cpu",
    progress: Progress | None = None,
) -> LayoutAuditResult:
    """Which metrics are artefacts of the parallel layout, and by how much: ``run`` (its settings
    plus ``overrides``) recomputed under the layouts verl users change (its own, one batch per
    step, the micro-batch halved and doubled, DP 1 / 2 / 4, ``use_dynamic_bsz`` on and off, the
    mini-batch halved, ``trainer.balance_batch`` off for the legacy trainer; those verl would
    refuse skipped with the reason, duplicates of another folded into it), written to
    ``RUN/rldiag/sweeps/layout-audit/``. ``result.metrics_frame()``: per metric, whether it is
    layout-dependent, its relative spread, the layout matching the log best and why;
    ``result.to_dict()`` is ``rldiag layout-audit --json``. ``progress`` counts layouts x steps."""
    from rldiag.analysis.layout_audit import layout_audit as run_layout_audit

    return run_layout_audit(run, overrides, steps=steps, device=device, progress=progress)


def check(run: str | Path, *, progress: Progress | None = None) -> CheckResult:
    """What the run holds and what is wrong with it: steps, rows, tokens, columns, the skipped
    ``metrics.jsonl`` lines, and which estimators and metric families its columns allow
    (``result.problems``, ``result.steps_frame()``)."""
    from rldiag.analysis.check import check_run

    return check_run(run, progress=_by_step(progress))


# ---- import ------------------------------------------------------------------------------------


def import_wandb(
    source: str | Path | None,
    out: str | Path | RemotePath,
    *,
    artifacts: Sequence[str] = (),
    artifact_type: str = "rl-batches",
    artifact_dirs: Sequence[str | Path] = (),
    batches: bool = True,
    nested_sep: str = ".",
    page_size: int = 1000,
    timeout: float = 30.0,
    base_url: str | None = None,
    api_factory: ApiFactory | None = None,
    progress: Progress | None = None,
    defer: Callable[[Callable[[], None]], None] | None = None,
) -> ImportResult:
    """A W&B run into the run directory ``out`` (created, or updated in place): ``source`` an
    offline run folder (``wandb/offline-run-*``) or its ``.wandb`` file, or ``entity/project/run_id``
    on a W&B server (API key from ``WANDB_API_KEY``); ``artifacts`` (``entity/project/name:version``)
    name batch artifacts to import instead of the run's own. ``api_factory(timeout=, base_url=)``
    replaces ``wandb.Api`` (an API object of your own, or a fake one in tests). ``defer(fn)``: hand
    the W&B SDK's shutdown to the caller (the command line runs it after printing). ``progress``
    counts kB of an offline log, or history rows then batch files online. :func:`logged` reads
    back the ``metrics.jsonl`` it wrote."""
    from rldiag.importers.wandb_import import import_wandb as run_import

    return run_import(source, out, artifacts=artifacts, artifact_type=artifact_type, artifact_dirs=artifact_dirs,
                      batches=batches, nested_sep=nested_sep, page_size=page_size, timeout=timeout,
                      base_url=base_url, api_factory=api_factory, progress=_by_step(progress), defer=defer)
