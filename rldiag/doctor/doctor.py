"""``rldiag doctor``: health checks over a run's logged and recomputed metrics.

The run is streamed once through the engine under its own settings (unless ``recompute`` is
False), collecting each step's metrics and the doctor's own per-step signals
(:mod:`.signals`); together with ``metrics.jsonl`` they feed the rules (:mod:`.rules`), each
evaluated by its kind (:mod:`.evaluators`). A rule is *not applicable* when its ``when``
settings do not hold, *not evaluated* when its metric is missing or has too few steps, and
otherwise passes or gives a finding with its evidence and the reason it matters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rldiag.analysis.logged import logged_metrics
from rldiag.config.settings import Settings, resolve_settings
from rldiag.doctor.evaluators import RULE_KINDS, Context, Finding, Passed, Skip
from rldiag.doctor.rules import Rule, load_rules
from rldiag.doctor.signals import SignalTable, centre_offset, credit_cut_fraction, kl_sign_flip_fraction
from rldiag.engine.pipeline import initial_kl_state, recompute_batch
from rldiag.errors import RldiagError
from rldiag.io.loader import load_step
from rldiag.io.outputs import json_safe
from rldiag.io.rundir import RunDir, parse_steps
from rldiag.recompute import check_settings, resolve_device

ProgressFn = Callable[[int, int, int], None]


@dataclass
class DoctorReport:
    run: str
    settings: dict[str, Any]  # the resolved settings (CONTRACT section 3)
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

    @property
    def healthy(self) -> bool:
        return not self.findings

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["healthy"] = self.healthy
        d["recompute_failed"] = {str(k): v for k, v in self.recompute_failed.items()}
        return json_safe(d)


def _stream(rd: RunDir, settings: Settings, chosen: list[int], files: dict, table: SignalTable,
            report: DoctorReport, device: str, progress: ProgressFn | None) -> None:
    """Recompute the chosen steps one at a time, adding their metrics and signals to ``table``."""
    dev = resolve_device(device)
    kl_state = initial_kl_state(settings) if settings["algorithm.use_kl_in_reward"] else None
    if kl_state is not None and settings["algorithm.kl_ctrl.type"] == "adaptive":
        from rldiag import recompute as _rc

        earlier = [s for s in sorted(files) if s < chosen[0]]
        replay = getattr(_rc, "replay_kl_controller", None)
        if earlier and replay is not None:
            replay(files, earlier, settings, kl_state)
    for i, step in enumerate(chosen):
        try:
            data = load_step(files[step], settings)
            batch = data.batch
            extra = {"rldiag/mask/credit_cut_fraction": credit_cut_fraction(batch.response_mask, batch.lengths)}
            result = recompute_batch(batch.to(dev), settings, kl_state)
            if result.failed:
                raise RldiagError(next(iter(result.failed.values())))
        except RldiagError as exc:
            report.recompute_failed[step] = f"{type(exc).__name__}: {exc}"
            continue
        finally:
            if progress:
                progress(i + 1, len(chosen), step)
        values = {k: float(v.detach().cpu().to(torch.float64)[0]) for k, v in result.metrics.items()}
        tok = {k: v.detach().cpu() for k, v in result.tokens.items()}
        extra["rldiag/advantages/centre_offset"] = centre_offset(tok["advantages"], tok["response_mask"])
        if settings["algorithm.use_kl_in_reward"]:
            extra["rldiag/rewards/kl_sign_flip_fraction"] = kl_sign_flip_fraction(
                batch.token_level_scores, tok["token_level_rewards"], batch.lengths)
        values.update(extra)
        table.add_recomputed(step, values)


def diagnose(
    run: str | Path,
    rules_files: Iterable[str | Path] = (),
    overrides: Mapping[str, Any] | None = None,
    steps: str | None = None,
    recompute: bool = True,
    device: str = "cpu",
    rules: list[Rule] | None = None,
    progress: ProgressFn | None = None,
) -> DoctorReport:
    """Run the health rules over ``run``.

    Args:
        run: the run directory.
        rules_files: YAML files merged over the built-in rules (by rule ``id``).
        overrides: setting overrides (verl's dotted keys) for the recompute and ``when``.
        steps: a ``--steps`` spec for the recompute; logged metrics are kept within its range.
        recompute: False uses the logged metrics only (fast; rules on ``rldiag/...`` signals
            are then not evaluated).
        device: ``cpu``, ``cuda`` or ``auto`` for the recompute.
        rules: use these rules instead of loading them (``rules_files`` is then ignored).
        progress: ``progress(done, total, step)`` during the recompute.

    Returns a :class:`DoctorReport`; ``report.findings`` is empty for a healthy run. Raises
    :class:`RldiagError` when the run or a rules file cannot be read.
    """
    rd = RunDir(run)
    rule_list = rules if rules is not None else load_rules(rules_files)
    settings = resolve_settings(rd.path, dict(overrides or {}))
    files = {sf.step: sf for sf in rd.step_files()}
    chosen = parse_steps(steps, sorted(files)) if files else []
    table = SignalTable()
    lo, hi = (min(chosen), max(chosen)) if (chosen and steps) else (None, None)
    for step, values in logged_metrics(rd.metrics_file).items():
        if lo is None or lo <= step <= hi:
            table.add_logged(step, values)
    report = DoctorReport(run=str(rd.path), settings=settings.resolved(), steps=chosen, logged_steps=0,
                          recomputed_steps=0, rules={r.id: r.origin for r in rule_list})
    if recompute and chosen:
        try:
            check_settings(settings)
        except RldiagError as exc:
            report.recompute_error = f"{type(exc).__name__}: {exc}"
        else:
            _stream(rd, settings, chosen, files, table, report, device, progress)
    elif recompute:
        report.recompute_error = f"no batch files in {rd.batches_dir}"
    report.logged_steps, report.recomputed_steps = table.logged_steps, table.recomputed_steps
    ctx = Context(settings=settings.values, series=table.series)
    for rule in rule_list:
        if not rule.applies(settings.values):
            report.not_applicable[rule.id] = ", ".join(f"{k}={settings.get(k)!r}" for k in rule.when)
            continue
        outcome = RULE_KINDS.get(rule.kind)(rule, ctx)
        if isinstance(outcome, Finding):
            report.findings.append(outcome)
        elif isinstance(outcome, Skip):
            report.not_evaluated[rule.id] = outcome.reason
        elif isinstance(outcome, Passed):
            report.passed[rule.id] = outcome.detail
    order = {"critical": 0, "warning": 1}
    report.findings.sort(key=lambda f: order.get(f.severity, 2))
    return report
