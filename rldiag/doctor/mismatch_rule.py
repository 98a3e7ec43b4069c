"""Rule kind ``mismatch``: why the rollout engine's log-probs differ from the trainer's, one
finding per cause (:mod:`rldiag.analysis.mismatch`), from the recompute's ``rldiag/mismatch/*``
per-step fingerprints. The built-in rule ``rollout_mismatch`` is of this kind.

Each finding's evidence carries ``cause`` (``sampling_truncation``, ``temperature``,
``precision``, ``misaligned``, ``policy_lag``, ``outlier_tokens``), ``confidence`` in [0, 1], the
steps it holds on (with their per-step confidence), the deciding statistic with its thresholds,
``trend`` (of ``rldiag/mismatch/gap_std``, the gap's spread, over the run) and ``details``: the
run-level statistics, the sampling settings and whether they predict the cause, the example
tokens. ``precision`` at bf16's level is severity ``info``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rldiag.analysis.mismatch import PREFIX, diagnose_mismatch
from rldiag.analysis.mismatch_run import add_examples
from rldiag.doctor.evaluators import RULE_KINDS, Context, Evidence, Finding, Outcome, Passed, Skip, trend_stats
from rldiag.doctor.rule import Rule
from rldiag.engine.mismatch import LAG_STATS, STATS


def _check(rule: Rule) -> str | None:
    v = rule.params.get("min_confidence", 0.5)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        return f"'min_confidence' must be in (0, 1], got {v!r}"
    return None


def _stats(ctx: Context) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    base = ctx.series(PREFIX + "tokens", "recomputed")
    if base is None:
        return None
    steps = base.steps
    out = {"tokens": base.values}
    for name in STATS + LAG_STATS:
        s = ctx.series(PREFIX + name, "recomputed")
        if s is None:
            continue
        by_step = dict(zip(s.steps.tolist(), s.values.tolist(), strict=True))
        out[name] = np.array([by_step.get(int(k), np.nan) for k in steps], dtype=np.float64)
    return steps, out


def _reads(rule: Rule) -> set[str]:
    return {PREFIX + name for name in ("tokens", *STATS, *LAG_STATS)}


@RULE_KINDS.register("mismatch", params=("min_confidence",), check=_check, min_steps=1, reads=_reads)
def mismatch_rule(rule: Rule, ctx: Context) -> Outcome:
    got = _stats(ctx)
    if got is None:
        return Skip(f"{PREFIX}* not recomputed: the batches need rollout_log_probs and old_log_probs "
                    "(verl: actor_rollout_ref.rollout.calculate_log_probs=True)")
    steps, stats = got
    diag = diagnose_mismatch(steps.tolist(), stats, ctx.settings)
    floor = float(rule.params.get("min_confidence", 0.5))
    causes = [c for c in diag.causes if c.confidence >= floor]
    if not causes:
        text = "; ".join(diag.notes) or "no cause found"
        return Passed(f"{text} (gap p99 {diag.summary.get('gap_abs_p99', float('nan')):.3g} over {len(diag.steps)} steps)")
    if ctx.run is not None and ctx.engine_settings is not None:
        files = {sf.step: sf for sf in ctx.run.step_files()}
        add_examples(diag, files, ctx.engine_settings, stats)
    window = [int(steps[0]), int(steps[-1])]
    std = stats["gap_std"]
    keep = np.isfinite(std)
    trend = trend_stats(steps[keep], std[keep]) if keep.any() else {}  # the gap's spread over the run
    findings: list[Finding] = []
    for c in causes:
        details: dict[str, Any] = {"statistics": c.details, "config": c.config, "examples": c.examples,
                                   "remedy": c.remedy, "notes": diag.notes}
        if c.implied:  # the causes it masks, reported inside its evidence
            details["implied"] = c.implied
        ev = Evidence(metric=PREFIX + "*", source="recomputed", window=window, steps=c.steps, values=c.values,
                      statistic=c.statistic, settings={f"actor_rollout_ref.rollout.{k}": v
                                                       for k, v in c.config.get("settings", {}).items()},
                      trend=trend, cause=c.cause, confidence=c.confidence, details=details)
        findings.append(Finding(rule.id, f"{rule.title}: {c.cause}", c.severity, rule.why, c.message, ev, remedy=c.remedy))
    return findings
