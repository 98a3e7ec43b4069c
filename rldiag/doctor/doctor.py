"""``rldiag doctor``: health checks over a run's logged and recomputed metrics.

The run is recomputed under its own settings (unless ``recompute`` is False; the scenario is
written like ``rldiag recompute`` writes it, so unchanged steps are reused next time), giving each
step's metrics and the engine's ``rldiag/...`` health signals; together with ``metrics.jsonl``
they feed the rules (:mod:`.rules`), each evaluated by its kind (:mod:`.evaluators`). A rule is *not applicable* when its ``when``
settings do not hold, *not evaluated* when its metric is missing or has too few steps, and
otherwise passes or gives a finding with its evidence and the reason it matters. A finding whose
rule names the settings that address it (``addresses``) then carries what they change on its
window's batches (:mod:`.counterfactual`, in memory; one update on recorded data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rldiag.analysis.logged import logged_metrics
from rldiag.config.settings import resolve_settings, scenario_slug
from rldiag.doctor.evaluate import evaluate_rules
from rldiag.doctor.evaluators import Finding
from rldiag.doctor.rule import Rule
from rldiag.doctor.rules import load_rules
from rldiag.doctor.signals import SignalTable
from rldiag.errors import RldiagError
from rldiag.io.arrays import rows_frame
from rldiag.io.fs import RemotePath
from rldiag.io.outputs import json_safe
from rldiag.io.rundir import RunDir, Steps, parse_steps
from rldiag.scenario.plan import check_settings
from rldiag.scenario.recompute import recompute as run_recompute

if TYPE_CHECKING:
    import polars as pl

ProgressFn = Callable[[int, int, int], None]


@dataclass
class DoctorReport:
    run: str
    settings: dict[str, Any]  # the resolved settings (every known key, inherited ones filled in)
    steps: list[int]  # batch steps streamed
    logged_steps: int
    recomputed_steps: int
    findings: list[Finding] = field(default_factory=list)
    passed: dict[str, str] = field(default_factory=dict)  # rule id -> what was seen
    not_evaluated: dict[str, str] = field(default_factory=dict)  # rule id -> why not
    not_applicable: dict[str, str] = field(default_factory=dict)  # rule id -> the `when` that failed
    recompute_failed: dict[int, str] = field(default_factory=dict)
    recompute_error: str | None = None  # why the run could not be recomputed at all
    rules: dict[str, str] = field(default_factory=dict)  # rule id -> file it comes from
    # rule id -> why (part of) its findings' counterfactual could not be computed
    counterfactual_errors: dict[str, str] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        """No finding beyond severity ``info`` (an info finding never counts as a health finding)."""
        return not any(f.severity != "info" for f in self.findings)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["healthy"] = self.healthy
        d["recompute_failed"] = {str(k): v for k, v in self.recompute_failed.items()}
        return json_safe(d)

    def findings_frame(self) -> pl.DataFrame:
        """One row per finding, most severe first: the rule, what was seen, the metric and the
        steps (with their values) behind it, and why it matters."""
        rows = [{"rule": f.rule, "severity": f.severity, "title": f.title, "message": f.message,
                 "cause": f.evidence.cause, "confidence": f.evidence.confidence,
                 "metric": f.evidence.metric, "source": f.evidence.source, "statistic": f.evidence.statistic,
                 "steps": f.evidence.steps, "values": f.evidence.values, "why": f.why} for f in self.findings]
        return rows_frame(rows, ["rule", "severity", "title", "message", "cause", "confidence", "metric", "source",
                                 "statistic", "steps", "values", "why"])


def _stream(rd: RunDir, overrides: Mapping[str, Any], steps: Steps, table: SignalTable,
            report: DoctorReport, device: str, progress: ProgressFn | None) -> None:
    """Recompute the chosen steps through :func:`rldiag.scenario.recompute.recompute` (its scenario is
    kept, so a later doctor or ``recompute`` reuses every unchanged step) and add each step's
    metrics, the engine's ``rldiag/...`` health signals included, to ``table``. Per-token outputs
    the scenario saved are kept (recomputed for changed steps), never dropped."""
    tokens = bool(rd.layout.scenario(scenario_slug(dict(overrides))).token_steps())
    rep = run_recompute(rd.path, overrides, steps=steps, device=device, save_tokens=tokens, progress=progress)
    for step, msg in rep.steps_failed.items():
        report.recompute_failed[step] = msg
    for row in rep.metrics:
        values = {k: float(v) for k, v in row.items() if k != "step" and v is not None}
        table.add_recomputed(int(row["step"]), values)


def diagnose(
    run: str | Path | RemotePath,
    rules_files: Iterable[str | Path] = (),
    overrides: Mapping[str, Any] | None = None,
    steps: Steps = None,
    recompute: bool = True,
    device: str = "cpu",
    rules: list[Rule] | None = None,
    progress: ProgressFn | None = None,
    counterfactual: bool = True,
) -> DoctorReport:
    """Run the health rules over ``run``.

    Args:
        run: the run directory, or its object-store URI (``s3://bucket/run``).
        rules_files: YAML files merged over the built-in rules (by rule ``id``).
        overrides: setting overrides (verl's dotted keys) for the recompute and ``when``.
        steps: a ``--steps`` spec for the recompute; logged metrics are kept within its range.
        recompute: False uses the logged metrics only (fast; rules on ``rldiag/...`` signals
            are then not evaluated).
        device: ``cpu``, ``cuda`` or ``auto`` for the recompute.
        rules: use these rules instead of loading them (``rules_files`` is then ignored).
        progress: ``progress(done, total, step)`` during the recompute.
        counterfactual: for each finding (severity above info) whose rule has ``addresses``,
            recompute its window's batches under those settings and fill
            ``finding.counterfactual`` (:mod:`.counterfactual`); only when the run was
            recomputed. What could not be computed is in ``report.counterfactual_errors``.

    Returns a :class:`DoctorReport`; ``report.findings`` is empty for a healthy run. Raises
    :class:`RldiagError` when the run or a rules file cannot be read.
    """
    rd = RunDir(run)
    rule_list = rules if rules is not None else load_rules(rules_files)
    settings = resolve_settings(rd.path, dict(overrides or {}))
    files = {sf.step: sf for sf in rd.step_files()}
    chosen = parse_steps(steps, sorted(files)) if files else []
    table = SignalTable()
    span = (min(chosen), max(chosen)) if (chosen and steps) else None
    for step, values in logged_metrics(rd.metrics_file).items():
        if span is None or span[0] <= step <= span[1]:
            table.add_logged(step, values)
    report = DoctorReport(run=str(rd.path), settings=settings.resolved(), steps=chosen, logged_steps=0,
                          recomputed_steps=0, rules={r.id: r.origin for r in rule_list})
    if recompute and chosen:
        try:
            check_settings(settings)
        except RldiagError as exc:
            report.recompute_error = f"{type(exc).__name__}: {exc}"
        else:
            _stream(rd, dict(overrides or {}), steps, table, report, device, progress)
    elif recompute:
        report.recompute_error = f"no batch files in {rd.batches_dir}"
    report.logged_steps, report.recomputed_steps = table.logged_steps, table.recomputed_steps
    # the run's keys with the derived ones resolved (critic.enable as verl's need_critic decides it)
    effective = {**settings.values, **settings.resolved()}
    res = evaluate_rules(rule_list, table, effective, run=rd, engine_settings=settings)
    report.findings, report.passed = res.findings, res.passed
    report.not_evaluated, report.not_applicable = res.not_evaluated, res.not_applicable
    if counterfactual and recompute and chosen and report.recompute_error is None:
        _attach_counterfactuals(rd, report, rule_list, dict(overrides or {}), device)
    return report


def _attach_counterfactuals(rd: RunDir, report: DoctorReport, rule_list: list[Rule], overrides: dict[str, Any],
                            device: str) -> None:
    """Each counted finding's counterfactual (info findings never count, so are left alone); a
    failure records its reason under the rule's id and never fails the doctor."""
    from rldiag.doctor.counterfactual import compute

    by_id = {r.id: r for r in rule_list}
    for f in report.findings:
        rule = by_id.get(f.rule)
        if rule is None or not rule.addresses or f.severity == "info":
            continue
        try:
            f.counterfactual, errors = compute(rd, rule, f, overrides, device)
        except Exception as exc:  # noqa: BLE001  (a counterfactual never fails the doctor)
            f.counterfactual, errors = [], [f"{type(exc).__name__}: {exc}"]
        if errors:
            seen = report.counterfactual_errors.get(f.rule)
            text = "; ".join(errors)
            report.counterfactual_errors[f.rule] = text if seen is None or seen == text else f"{seen}; {text}"
