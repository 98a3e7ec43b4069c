"""``rldiag verify``: recompute a run with its own settings and compare, step by step, with what
the trainer logged.

Compared, per step:

- the per-token columns ``token_level_rewards``, ``advantages``, ``returns`` of the batch file
  (whichever are present), at every token of each row (``masked_only``: only where
  ``response_mask`` is 1), against the recomputed ones;
- ``response_mask``, exactly, when the batch carries ``loss_mask`` (its ``response_mask`` is then
  the post-rejection mask the trainer used, which the recompute must reproduce);
- every metric of ``metrics.jsonl`` for the step that rldiag computes; the other logged
  metrics are listed as not checked.

Steps are streamed: one is loaded, recomputed, compared and dropped before the next. When a
field mismatches, a bounded list of single-setting candidates (:mod:`.candidates`) is tried on
the first mismatching steps, and those that would have matched are reported.

Exit status of the command (:attr:`VerifyReport.exit_code`): 0 all compared values match, 1 a
mismatch, 2 the run cannot be verified (a step could not be loaded or recomputed, or nothing
logged could be compared).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rldiag.analysis.candidates import candidate_overrides, describe, is_layout, layout_text
from rldiag.analysis.logged import LOGGED_TOKEN_COLUMNS, logged_metrics, read_logged_tokens, row_token_of
from rldiag.analysis.sample_band import Band, replicate_state, sample_bands
from rldiag.analysis.tolerance import Tolerances, diff, whitened_constant_noise
from rldiag.config.settings import Settings, resolve_settings
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.pipeline import KLControllerState, PresetKLCoefficients, initial_kl_state
from rldiag.engine.requirements import recompute_columns
from rldiag.errors import ComputeError, RldiagError
from rldiag.executors.device import resolve_device
from rldiag.executors.klchain import LoggedKL, chain, replay_statistics, with_logged
from rldiag.executors.steps import Job, StepTask
from rldiag.io.arrays import rows_frame
from rldiag.io.fs import RemotePath, is_remote
from rldiag.io.loader import load_step, read_schema
from rldiag.io.outputs import json_safe
from rldiag.io.rundir import RunDir, StepFile, Steps, parse_steps
from rldiag.scenario.memory import recompute_step
from rldiag.scenario.plan import check_settings
from rldiag.scenario.sampling import SampledRun

if TYPE_CHECKING:
    import polars as pl

ProgressFn = Callable[[int, int, int], None]
#: Order in which fields are reported (pipeline order: an upstream mismatch explains later ones).
TOKEN_ORDER = (*LOGGED_TOKEN_COLUMNS, "response_mask")
#: token fields that hold a whitened value (returns are the advantages for the estimators that
#: whiten per group)
WHITENED_FIELDS = ("advantages", "returns")


@dataclass
class Mismatch:
    """One value that does not match: ``row``/``token`` are None for a metric."""

    step: int
    field: str
    expected: float  # logged
    actual: float  # recomputed
    row: int | None = None
    token: int | None = None
    abs_err: float | None = None
    rel_err: float | None = None

    def describe(self) -> str:
        where = f"step {self.step}" + (f", row {self.row}, token {self.token}" if self.row is not None else "")
        return f"{where}, {self.field}: logged {self.expected!r}, recomputed {self.actual!r}"


@dataclass
class FieldReport:
    """Totals of one compared field over every step checked."""

    field: str
    kind: str  # "token", "metric" or "exact"
    rtol: float
    atol: float
    compared: int = 0
    mismatches: int = 0
    steps_mismatched: list[int] = dataclasses.field(default_factory=list)
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    first: Mismatch | None = None
    worst: Mismatch | None = None  # the largest absolute error
    #: values that differ by the rounding noise of a whitened constant (an exactly tied group or
    #: step, exact value 0: rldiag.analysis.tolerance.whitened_constant_noise), not mismatches;
    #: their largest absolute difference (not in max_abs_err / max_rel_err)
    noise: int = 0
    noise_max_abs_err: float = 0.0

    @property
    def ok(self) -> bool:
        return self.mismatches == 0


@dataclass
class Candidate:
    """A setting change tried on the first mismatching steps."""

    overrides: dict[str, Any]
    steps: list[int]
    fixes: list[str]  # mismatching fields that match under it
    breaks: list[str]  # fields that matched and no longer do
    remaining: list[str]  # mismatching fields still mismatching
    layout: str = ""  # the batch layout it makes, when it changes the layout

    @property
    def matches_all(self) -> bool:
        return not self.remaining and not self.breaks

    def describe(self, max_fields: int = 4) -> str:
        """``advantages, returns, actor/pg_loss (+6 more) match with norm_adv_by_std_in_grpo=false``."""
        shown = ", ".join(self.fixes[:max_fields])
        more = f" (+{len(self.fixes) - max_fields} more)" if len(self.fixes) > max_fields else ""
        verb = "matches" if len(self.fixes) == 1 else "match"
        layout = f" (layout: {self.layout})" if self.layout else ""
        return f"{shown}{more} {verb} with {describe(self.overrides)}{layout}"


@dataclass
class VerifyReport:
    run: str
    settings: dict[str, Any]
    overrides: dict[str, Any]
    tolerances: dict
    masked_only: bool
    steps_checked: list[int] = dataclasses.field(default_factory=list)
    steps_unverifiable: dict[int, str] = dataclasses.field(default_factory=dict)
    steps_without_logs: list[int] = dataclasses.field(default_factory=list)
    fields: dict[str, FieldReport] = dataclasses.field(default_factory=dict)
    first_mismatch: Mismatch | None = None
    not_checked: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> why
    not_logged: list[str] = dataclasses.field(default_factory=list)  # metrics rldiag computes, absent from the log
    candidates: list[Candidate] = dataclasses.field(default_factory=list)  # those fixing a field and breaking none
    candidates_tried: int = 0
    layout: str = ""  # the batch layout of the run's settings (rldiag/engine/batch_layout.py)
    #: a run captured under a capture policy: {step: share of its prompt groups} of the sampled
    #: steps checked, and each field not compared there because it is an estimate -> why
    sampled_steps: dict[int, float] = dataclasses.field(default_factory=dict)
    estimates: dict[str, str] = dataclasses.field(default_factory=dict)
    #: each estimated step metric against the logged values (:mod:`.sample_band`): ``steps``
    #: with a band, ``inside`` it, ``outside``, the largest ``max_z`` (standard errors) and
    #: the step where it was (``worst_step``). Never a mismatch.
    estimate_bands: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def compared(self) -> int:
        return sum(f.compared for f in self.fields.values())

    @property
    def status(self) -> str:
        if any(f.mismatches for f in self.fields.values()):
            return "mismatch"
        if self.steps_unverifiable or self.compared == 0:
            return "unverifiable"
        return "match"

    @property
    def exit_code(self) -> int:
        return {"match": 0, "mismatch": 1, "unverifiable": 2}[self.status]

    def fields_frame(self) -> pl.DataFrame:
        """One row per compared field (pipeline order, then metrics by name): its kind, values
        compared, mismatches, largest errors, tolerance, and its first mismatch in words."""
        rows = [{"field": f.field, "kind": f.kind, "ok": f.ok, "compared": f.compared, "mismatches": f.mismatches,
                 "max_abs_err": f.max_abs_err, "max_rel_err": f.max_rel_err, "rtol": f.rtol, "atol": f.atol,
                 "steps_mismatched": f.steps_mismatched, "first_mismatch": f.first.describe() if f.first else None}
                for f in self.fields.values()]
        return rows_frame(rows, ["field", "kind", "ok", "compared", "mismatches", "max_abs_err", "max_rel_err",
                                 "rtol", "atol", "steps_mismatched", "first_mismatch"])

    def summary(self) -> str:
        """One line per candidate that would have matched, e.g. "advantages match with
        norm_adv_by_std_in_grpo=false"."""
        return "; ".join(c.describe() for c in self.candidates)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["status"] = self.status
        d["exit_code"] = self.exit_code
        d["compared"] = self.compared
        d["steps_unverifiable"] = {str(k): v for k, v in self.steps_unverifiable.items()}
        d["sampled_steps"] = {str(k): v for k, v in self.sampled_steps.items()}
        for c, src in zip(d["candidates"], self.candidates):
            c["matches_all"] = src.matches_all
            c["text"] = src.describe()
        return json_safe(d)


# ---- one step ---------------------------------------------------------------------------------


@dataclass
class _FieldStep:
    kind: str
    compared: int
    bad: int
    max_abs: float
    max_rel: float
    first: Mismatch | None
    worst: Mismatch | None
    noise: int = 0
    noise_max: float = 0.0


@dataclass
class _StepCheck:
    fields: dict[str, _FieldStep]
    logged_only: set[str]  # metrics logged, not computed
    computed_only: set[str]  # metrics computed, not logged
    token_columns: list[str]
    estimated: set[str] = dataclasses.field(default_factory=set)  # fields of a sampled step: estimates
    bands: dict[str, Band] = dataclasses.field(default_factory=dict)  # step metrics of a sampled step


def _nanmax(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(x.max()) if x.size else 0.0


def _field_step(name: str, kind: str, step: int, expected: np.ndarray, actual: np.ndarray, tols: Tolerances,
                lengths: np.ndarray | None, index: np.ndarray | None, noise: np.ndarray | None = None) -> _FieldStep:
    """Compare flat arrays; ``index`` maps positions back to flat token indices (masked_only);
    ``noise`` (bool, per position): where a difference is rounding noise of a whitened constant."""
    d = diff(expected, actual, tols.for_field(name, "metric" if kind == "metric" else "token"))
    n_noise, noise_max = 0, 0.0
    if noise is not None and bool((d.bad & noise).any()):
        n_noise, noise_max = int((d.bad & noise).sum()), _nanmax(d.abs_err[d.bad & noise])
        d.bad &= ~noise
        d.abs_err[noise] = 0.0
        d.rel_err[noise] = np.nan

    def at(i: int) -> Mismatch:
        row = tok = None
        if lengths is not None:
            row, tok = row_token_of(int(index[i]) if index is not None else i, lengths)
        rel = d.rel_err[i]
        return Mismatch(step=step, field=name, expected=float(expected[i]), actual=float(actual[i]), row=row,
                        token=tok, abs_err=float(d.abs_err[i]), rel_err=None if math.isnan(rel) else float(rel))

    bad = np.flatnonzero(d.bad)
    first = at(int(bad[0])) if bad.size else None
    worst = None
    if bad.size:
        errs = np.where(np.isnan(d.abs_err[bad]), np.inf, d.abs_err[bad])
        worst = at(int(bad[int(np.argmax(errs))]))
    return _FieldStep(kind=kind, compared=int(expected.size), bad=int(bad.size), max_abs=_nanmax(d.abs_err),
                      max_rel=_nanmax(d.rel_err), first=first, worst=worst, noise=n_noise, noise_max=noise_max)


def _whitened_ties(batch, result, whitens: str, index: np.ndarray | None):
    """Per compared token: a function ``(expected, actual) -> noise`` (bool) for the segments the
    run's estimator whitens over (``whitens``: ``group`` or ``step``), or None when it whitens
    nothing."""
    if not whitens:
        return None
    row = np.repeat(np.arange(len(batch.lengths)), batch.lengths.numpy())
    seg = (batch.group_ids if whitens == "group" else batch.step_ids).numpy()[row]
    on = result.tokens["response_mask"].detach().cpu().numpy() > 0
    if index is not None:
        row, seg, on = row[index], seg[index], on[index]
    return lambda expected, actual: whitened_constant_noise(expected, actual, on, row, seg)


def check_step(sf: StepFile, settings: Settings, kl_state: KLControllerState | PresetKLCoefficients | None,
               logged: Mapping[str, float], tols: Tolerances, masked_only: bool = False,
               device: torch.device | str = "cpu", source: bytes | None = None, share: float = 1.0) -> _StepCheck:
    """Recompute one step and compare it with its logged values. ``kl_state`` is advanced.
    ``source``: the batch file's bytes when the caller holds them (the file is not read then).
    ``share``: the share of the step's prompt groups its batch file holds (a capture policy's
    sample, :mod:`rldiag.scenario.sampling`): below 1, every step metric and the per-token
    values an estimator whitens over the whole step are estimates, not compared (``estimated``);
    the per-token values of the kept rows are compared as usual (a kept group is whole).

    Raises :class:`RldiagError` when the step cannot be loaded or verl would raise on it.
    """
    names = set(read_schema(sf, source).names)
    before = replicate_state(kl_state) if share < 1.0 else None
    data, result = recompute_step(sf, settings, kl_state, device=device, source=source)
    batch = data.batch
    if result.failed:
        raise ComputeError(result.failed.get(sf.step) or next(iter(result.failed.values())))
    lengths = batch.lengths.numpy().astype(np.int64)
    mask_flat = batch.response_mask.numpy()
    token_cols = [c for c in LOGGED_TOKEN_COLUMNS if c in names]
    expected_tok = read_logged_tokens(sf, token_cols, lengths, source)
    index = np.flatnonzero(mask_flat > 0) if masked_only else None
    whitens = ESTIMATORS.meta(settings["algorithm.adv_estimator"]).whitens
    ties = _whitened_ties(batch, result, whitens, index)
    fields: dict[str, _FieldStep] = {}
    estimated: set[str] = set()
    if share < 1.0 and whitens == "step":  # whitened over the whole step: an estimate from the kept groups
        estimated = {c for c in token_cols if c in WHITENED_FIELDS}
        token_cols = [c for c in token_cols if c not in estimated]
    for name in token_cols:
        actual = result.tokens[name].detach().cpu().to(torch.float64).numpy()
        exp = expected_tok[name]
        if index is not None:
            exp, actual = exp[index], actual[index]
        noise = ties(exp, actual) if ties is not None and name in WHITENED_FIELDS else None
        fields[name] = _field_step(name, "token", sf.step, exp, actual, tols, lengths, index, noise)
    if "loss_mask" in names:
        actual = result.tokens["response_mask"].detach().cpu().to(torch.float64).numpy()
        fields["response_mask"] = _field_step("response_mask", "exact", sf.step, mask_flat.astype(np.float64),
                                              actual, tols, lengths, None)
    computed = {k: float(v.detach().cpu().to(torch.float64)[0]) for k, v in result.metrics.items()}
    bands: dict[str, Band] = {}
    if share < 1.0:  # a statistic of the kept groups, not of the step the trainer logged: its band
        estimated |= set(computed) & set(logged)
        bands = sample_bands(batch.to(device), settings, before, computed, logged, share, tols)
    for name in sorted(set(computed) & set(logged) - estimated):
        fields[name] = _field_step(name, "metric", sf.step, np.array([logged[name]], dtype=np.float64),
                                   np.array([computed[name]]), tols, None, None)
    return _StepCheck(fields=fields, logged_only=set(logged) - set(computed), computed_only=set(computed) - set(logged),
                      token_columns=token_cols, estimated=estimated, bands=bands)


# ---- the run ----------------------------------------------------------------------------------


def _add_band(bands: dict[str, dict[str, Any]], name: str, step: int, band: Band) -> None:
    b = bands.setdefault(name, {"steps": 0, "inside": 0, "outside": 0, "not_placed": 0, "max_z": 0.0,
                                "worst_step": None, "kind": band.kind})
    if band.kind == "band":  # a step with a band of some width makes the field a banded one
        b["kind"] = "band"
    b["steps"] += 1
    b[{True: "inside", False: "outside", None: "not_placed"}[band.inside]] += 1
    if band.inside is not None and (b["worst_step"] is None or band.z > b["max_z"]):
        b["max_z"], b["worst_step"] = band.z, step


def _first_key(name: str) -> tuple[int, str]:
    return (TOKEN_ORDER.index(name), name) if name in TOKEN_ORDER else (len(TOKEN_ORDER), name)


def _merge(report: VerifyReport, check: _StepCheck, step: int, tols: Tolerances) -> None:
    for name, fs in sorted(check.fields.items(), key=lambda kv: _first_key(kv[0])):
        kind_tol = tols.for_field(name, "metric" if fs.kind == "metric" else "token")
        fr = report.fields.setdefault(name, FieldReport(field=name, kind=fs.kind, rtol=kind_tol.rtol, atol=kind_tol.atol))
        fr.compared += fs.compared
        fr.max_abs_err = max(fr.max_abs_err, fs.max_abs)
        fr.max_rel_err = max(fr.max_rel_err, fs.max_rel)
        fr.noise += fs.noise
        fr.noise_max_abs_err = max(fr.noise_max_abs_err, fs.noise_max)
        if fs.bad:
            fr.mismatches += fs.bad
            fr.steps_mismatched.append(step)
            fr.first = fr.first or fs.first
            if fr.worst is None or _err(fs.worst) > _err(fr.worst):
                fr.worst = fs.worst
            if report.first_mismatch is None:
                report.first_mismatch = fs.first


def _err(m: Mismatch | None) -> float:
    if m is None or m.abs_err is None or math.isnan(m.abs_err):
        return math.inf
    return m.abs_err


def _advance_logged(state: KLControllerState, settings: Settings, logged_kl: LoggedKL, after: int,
                    before: int) -> None:
    """Advance ``state`` over the logged statistics of the steps strictly between ``after`` and
    ``before`` (steps with no batch file, or sampled ones, that the trainer advanced it over)."""
    chain(state, settings, with_logged([], {s: v for s, v in logged_kl.items() if after < s < before}))


def _kl_state(settings: Settings, files: dict[int, StepFile], step: int, snapshot: float | None,
              same_controller: bool, logged_kl: LoggedKL | None = None) -> KLControllerState | None:
    """The reward-KL controller state before ``step`` under ``settings``; ``logged_kl``: the
    logged statistics of the steps whose batch is not whole (a capture policy's), which stand
    in for theirs (each step then its own pack)."""
    if not settings["algorithm.use_kl_in_reward"]:
        return None
    state = initial_kl_state(settings)
    if settings["algorithm.kl_ctrl.type"] != "adaptive":
        return state
    if same_controller and snapshot is not None:
        return KLControllerState(snapshot)
    # the earlier steps' statistics as the recompute replays them (executors/klchain.py), each step
    # its own pack; a step whose statistic cannot be read is skipped, as a trainer that never saw it
    earlier = sorted(s for s in files if s < step)
    tasks = [StepTask(step=s, file=str(files[s].path), rel=files[s].path.name, chunk=i) for i, s in enumerate(earlier)]
    if not logged_kl:
        chain(state, settings, replay_statistics(tasks, Job(settings=settings, device="cpu", save_tokens=False)))
        return state
    whole = [t for t in tasks if t.step not in logged_kl]
    job = Job(settings=settings, device="cpu", save_tokens=False, pack_tokens=1)
    before = {s: v for s, v in logged_kl.items() if s < step}
    chain(state, settings, with_logged(replay_statistics(whole, job), before))
    return state


_CONTROLLER_KEYS = ("algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl.type",
                    "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon")


def verify_run(
    run: str | Path | RemotePath,
    overrides: Mapping[str, Any] | None = None,
    steps: Steps = None,
    tolerances: Tolerances | None = None,
    masked_only: bool = False,
    candidates: bool = True,
    candidate_steps: int = 2,
    max_candidates: int = 64,
    device: str = "cpu",
    progress: ProgressFn | None = None,
) -> VerifyReport:
    """Recompute ``run`` under its own settings (plus ``overrides``) and compare with its logs.

    Args:
        run: the run directory, or its object-store URI (``s3://bucket/run``).
        overrides: setting overrides (verl's dotted keys), as ``--set``.
        steps: a ``--steps`` spec; default every step.
        tolerances: per-quantity tolerances; default fp32 (:class:`Tolerances`).
        masked_only: compare per-token columns only where ``response_mask`` is 1.
        candidates: on a mismatch, try candidate settings on the first ``candidate_steps``
            mismatching steps (at most ``max_candidates`` of them).
        device: ``cpu``, ``cuda`` or ``auto``.
        progress: ``progress(done, total, step)`` after each step.

    Returns a :class:`VerifyReport`. Raises :class:`RldiagError` when the run cannot be read
    at all (no directory or batches, malformed config, unknown settings).
    """
    rd = RunDir(run)
    overrides = dict(overrides or {})
    tols = tolerances or Tolerances()
    settings = resolve_settings(rd.path, overrides)
    check_settings(settings)
    dev = resolve_device(device)
    files = {sf.step: sf for sf in rd.require_steps()}
    chosen = parse_steps(steps, sorted(files))
    logged = logged_metrics(rd.metrics_file)
    report = VerifyReport(run=str(rd.path), settings=settings.resolved(), overrides=overrides,
                          tolerances=tols.to_dict(), masked_only=masked_only, layout=layout_text(settings))
    sample = SampledRun.of(rd, settings, files, chosen)
    logged_kl = sample.logged_kl if sample is not None else {}
    try:
        kl_state = _kl_state(settings, files, chosen[0], None, False, logged_kl)
    except RldiagError as exc:
        report.steps_unverifiable = {s: f"{type(exc).__name__}: {exc}" for s in chosen}
        return report
    snapshots: dict[int, float | None] = {}
    logged_only: set[str] = set()
    computed_only: set[str] = set()
    token_steps: dict[str, int] = {c: 0 for c in LOGGED_TOKEN_COLUMNS}
    estimated: dict[str, set[int]] = {}
    last = chosen[0]
    for i, step in enumerate(chosen):
        share = sample.shares.get(step, 1.0) if sample is not None else 1.0
        if share < 1.0:
            report.sampled_steps[step] = share
        step_state: KLControllerState | PresetKLCoefficients | None = kl_state
        if kl_state is not None and logged_kl:  # the steps between with a logged statistic, then this one's
            _advance_logged(kl_state, settings, logged_kl, last, step)
            if step in logged_kl:
                step_state = PresetKLCoefficients([kl_state.value])
        last = step
        snapshots[step] = kl_state.value if kl_state is not None else None
        try:
            check = check_step(files[step], settings, step_state, logged.get(step, {}), tols, masked_only, dev,
                               share=share)
        except RldiagError as exc:
            report.steps_unverifiable[step] = f"{type(exc).__name__}: {exc}"
        else:
            for name in check.estimated:
                estimated.setdefault(name, set()).add(step)
            for name, band in check.bands.items():
                _add_band(report.estimate_bands, name, step, band)
            if check.fields:
                report.steps_checked.append(step)
                _merge(report, check, step, tols)
            elif not check.estimated:
                report.steps_without_logs.append(step)
            logged_only |= check.logged_only
            computed_only |= check.computed_only
            for c in check.token_columns:
                token_steps[c] += 1
        if kl_state is not None and step_state is not kl_state:  # past this step, by its logged statistic
            _advance_logged(kl_state, settings, logged_kl, step - 1, step + 1)
        if progress:
            progress(i + 1, len(chosen), step)
    for name, where in sorted(estimated.items()):
        what = (f"an estimate on {len(where)} sampled step(s) (a statistic of the kept prompt groups, not of the "
                "whole step the trainer logged)")
        b = report.estimate_bands.get(name)
        report.estimates[name] = (f"{what}: inside its sampling band on {b['inside']} of {b['steps']}" if b else
                                  f"{what}: not compared there (a total of the kept rows, or no band)")
    for name in sorted(logged_only):
        report.not_checked[name] = "rldiag does not compute this metric"
    ok_steps = len(report.steps_checked) + len(report.steps_without_logs)
    for col, n in token_steps.items():
        if n == 0:
            report.not_checked[col] = "not in the batch files"
        elif n < ok_steps:
            report.not_checked[col] = f"in {n} of {ok_steps} batch files; checked where present"
    report.not_logged = sorted(computed_only - set(report.fields))
    if candidates and report.status == "mismatch":
        _search_candidates(report, rd, settings, overrides, files, snapshots, tols, masked_only, dev, logged,
                           candidate_steps, max_candidates)
    return report


def _search_candidates(report: VerifyReport, rd: RunDir, settings: Settings, overrides: dict, files: dict,
                       snapshots: dict, tols: Tolerances, masked_only: bool, dev, logged: dict,
                       n_steps: int, max_candidates: int) -> None:
    bad_steps = sorted({s for f in report.fields.values() for s in f.steps_mismatched})[: max(1, n_steps)]
    bad_fields = {f.field for f in report.fields.values() if set(f.steps_mismatched) & set(bad_steps)}
    good_fields = {f.field for f in report.fields.values()} - bad_fields
    # every candidate recomputes the mismatching steps: on an object store their files are
    # downloaded once for all of them (on disk a file is memory-mapped where it lies)
    sources: dict[int, bytes] = {}
    if is_remote(rd.path):
        try:
            sources = {s: files[s].path.read_bytes() for s in bad_steps}
        except RldiagError:
            sources = {}  # each candidate reads (or fails on) the file itself
    columns = set(read_schema(files[bad_steps[0]], sources.get(bad_steps[0])).names)
    rows = load_step(files[bad_steps[0]], settings, recompute_columns(settings), source=sources.get(bad_steps[0])).n_rows
    tried = 0
    found: list[Candidate] = []
    for cand in candidate_overrides(settings, bad_fields, columns, rows)[:max_candidates]:
        try:
            cs = resolve_settings(rd.path, {**overrides, **cand})
            check_settings(cs)
        except RldiagError:
            continue
        same_ctrl = all(cs.get(k) == settings.get(k) for k in _CONTROLLER_KEYS)
        tried += 1
        status: dict[str, bool] = {}  # field -> matches on every tried step
        try:
            for step in bad_steps:
                state = _kl_state(cs, files, step, snapshots.get(step), same_ctrl)
                check = check_step(files[step], cs, state, logged.get(step, {}), tols, masked_only, dev,
                                   sources.get(step))
                for name in bad_fields | good_fields:
                    fs = check.fields.get(name)
                    status[name] = status.get(name, True) and fs is not None and fs.bad == 0
        except RldiagError:
            continue
        fixes = sorted((f for f in bad_fields if status.get(f)), key=_first_key)
        breaks = sorted((f for f in good_fields if not status.get(f)), key=_first_key)
        if fixes and not breaks:
            remaining = sorted((f for f in bad_fields if not status.get(f)), key=_first_key)
            found.append(Candidate(overrides=dict(cand), steps=list(bad_steps), fixes=fixes, breaks=breaks,
                                   remaining=remaining, layout=layout_text(cs) if is_layout(cand) else ""))
    found.sort(key=lambda c: (-len(c.fixes), len(c.remaining)))
    report.candidates = found
    report.candidates_tried = tried


__all__ = ["Candidate", "FieldReport", "Mismatch", "VerifyReport", "check_step", "verify_run"]
