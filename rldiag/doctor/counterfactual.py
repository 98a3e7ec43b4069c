"""What the settings that address a finding change on the finding's own batches.

A rule may name the settings that address it (``addresses`` in ``rules.yaml``, checked by
:mod:`.rules`). For a finding of that rule, :func:`counterfactuals` recomputes the steps of the
finding's window (its ``evidence.window``, else the span of its evidence steps, else the run's
batch steps; at most :data:`MAX_WINDOW_STEPS`, the latest ones) under the run's own settings
and under each alternative, all in memory from one read of each step file
(:func:`rldiag.scenario.memory.recompute_in_memory`, on the sweep executor) plans each scenario as ``rldiag recompute
--steps`` plans it (the same packs, so the same bits) and runs each stage once for the scenarios
that agree on it. Nothing is written into the run.

Each entry compares one metric, reduced over the window's steps (``addresses.statistic``), with
the alternative (``with``) and under the run's own settings plus the doctor's overrides
(``without``). A metric the recompute does not give for either side is left out.

The caveat, stated once wherever these are shown: this is one update on fixed, recorded data
(the batches the run's policy sampled); a recompute cannot tell what the policy would have
become had the run been trained under the alternative.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rldiag.config.schema import effective
from rldiag.config.settings import Settings, resolve_settings
from rldiag.doctor.evaluators import Finding
from rldiag.doctor.rule import Rule, same_value
from rldiag.errors import ComputeError, RldiagError
from rldiag.io.fs import RemotePath
from rldiag.io.rundir import RunDir

__all__ = ["CAVEAT", "MAX_WINDOW_STEPS", "counterfactuals", "describe", "finding_window", "own_value"]

#: at most this many steps (the latest of the window) are recomputed for a finding
MAX_WINDOW_STEPS = 20
#: said once wherever counterfactuals are shown
CAVEAT = "one update on these recorded batches; not what the policy would have become"

_STATS = {
    "mean": lambda v: float(np.mean(v)),
    "median": lambda v: float(np.median(v)),
    "max": lambda v: float(np.max(v)),
    "last": lambda v: float(v[-1]),
}


def finding_window(finding: Finding) -> tuple[int, int] | None:
    """The steps a finding is about: its evidence window, else its evidence steps' span; None
    for a finding without steps (a settings rule)."""
    ev = finding.evidence
    if len(ev.window) == 2:
        return int(ev.window[0]), int(ev.window[1])
    if ev.steps:
        return int(min(ev.steps)), int(max(ev.steps))
    return None


def own_value(settings: Mapping[str, Any], key: str) -> Any:
    """The value ``key`` has in ``settings``, an inherited null resolved (clip_ratio_high null:
    clip_ratio; the settings schema's ``inherits``)."""
    return effective(settings, key)


def _reduce(stat: str, steps: list[int], a: dict[int, dict[str, float]], b: dict[int, dict[str, float]],
            metric: str) -> tuple[float, float] | None:
    """``stat`` of ``metric`` over the steps (in order) where both sides have a finite value."""
    both = [s for s in steps if math.isfinite(a.get(s, {}).get(metric, math.nan))
            and math.isfinite(b.get(s, {}).get(metric, math.nan))]
    if not both:
        return None
    fn = _STATS[stat]
    return fn(np.array([a[s][metric] for s in both])), fn(np.array([b[s][metric] for s in both]))


def compute(run: str | Path | RemotePath | RunDir, rule: Rule, finding: Finding,
            overrides: Mapping[str, Any] | None = None, device: str = "cpu",
            max_steps: int = MAX_WINDOW_STEPS) -> tuple[list[dict[str, Any]], list[str]]:
    """:func:`counterfactuals` and the reasons for what it could not compute (an alternative
    the run's settings refuse, every step of a scenario failing), rather than raising them."""
    if not rule.addresses:
        return [], []
    rd = run if isinstance(run, RunDir) else RunDir(run)
    files = {sf.step: sf for sf in rd.require_steps()}
    span = finding_window(finding) or (min(files), max(files))
    in_window = [s for s in sorted(files) if span[0] <= s <= span[1]]
    if not in_window:
        return [], [f"no batch file in steps {span[0]}-{span[1]}"]
    steps = in_window[-max_steps:]
    base_over = dict(overrides or {})
    from rldiag.scenario.memory import recompute_in_memory
    from rldiag.scenario.plan import check_settings

    base = resolve_settings(rd.path, base_over)
    check_settings(base)
    errors: list[str] = []
    alts: list[tuple[dict[str, Any], Settings]] = []
    already: list[Mapping[str, Any]] = []
    for alt in rule.addresses["settings"]:
        label = ", ".join(f"{k}={v!r}" for k, v in alt.items())
        try:
            s = resolve_settings(rd.path, {**base_over, **alt})
            check_settings(s)
        except RldiagError as exc:
            errors.append(f"{label}: {type(exc).__name__}: {exc}")
            continue
        if all(same_value(s.values.get(k), base.values.get(k)) for k in alt):
            already.append(alt)  # the run already has it: said in the skipped notes, with what it did
            continue
        alts.append((dict(alt), s))
    skipped: list[str] = []
    finding.evidence.details["counterfactual_skipped"] = skipped
    if not alts and not already:
        return [], errors
    results = recompute_in_memory(rd, [base] + [s for _, s in alts], steps, device)
    without, base_failed = results[0].metrics, results[0].failed
    skipped += [f"{_label(alt)}: the run already has it{_what_it_did(alt, steps, without)}" for alt in already]
    if not alts:
        return [], errors
    if not without:
        return [], errors + [f"the run's own settings: every step failed ({next(iter(base_failed.values()), '')})"]
    stat = rule.addresses["statistic"]
    text = stat if len(steps) == len(in_window) else (
        f"{stat} over the last {len(steps)} of the window's {len(in_window)} steps")
    window = [steps[0], steps[-1]]
    entries: list[dict[str, Any]] = []
    for (alt, _), result in zip(alts, results[1:]):
        with_, failed = result.metrics, result.failed
        if not with_:
            label = ", ".join(f"{k}={v!r}" for k, v in alt.items())
            errors.append(f"{label}: every step failed ({next(iter(failed.values()), '')})")
            continue
        for metric in rule.addresses["metrics"]:
            pair = _reduce(stat, steps, with_, without, metric)
            if pair is None:
                continue
            if pair[0] == pair[1]:  # a line that changes nothing: said once, why, not listed
                skipped.append(f"{_label(alt)}: {metric} is {_show(pair[1])} with and without it (the setting does "
                               f"not act on {metric} on these batches)")
                continue
            entries.append({"settings": alt, "metric": metric, "statistic": text, "window": window,
                            "with": pair[0], "without": pair[1]})
    return entries, errors


def _label(alt: Mapping[str, Any]) -> str:
    return ", ".join(f"{_short(k)}={_show(v)}" for k, v in alt.items())


#: what a rollout-correction setting the run already has did over the window, from its own metrics
_DID = (("rollout_is", "rollout_corr/rollout_is_eff_sample_size", "IS ESS {:.2f}"),
        ("rollout_is", "rollout_corr/rollout_is_ratio_fraction_high", "{:.1%} of the IS weights truncated"),
        ("rollout_rs", "rollout_corr/rollout_rs_masked_fraction", "{:.1%} of the tokens rejected"))


def _what_it_did(alt: Mapping[str, Any], steps: list[int], metrics: dict[int, dict[str, float]]) -> str:
    """``: IS ESS 0.93 and 1.2% of the IS weights truncated (mean over steps 4-9)``, from the
    run's own recompute over the window; empty when the setting has no such metric."""
    keys = {k.rsplit(".", 1)[-1] for k in alt}
    parts = []
    for key, metric, fmt in _DID:
        vals = [metrics[s][metric] for s in steps if math.isfinite(metrics.get(s, {}).get(metric, math.nan))]
        if key in keys and vals:
            parts.append(fmt.format(float(np.mean(vals))))
    return f": {' and '.join(parts)} (mean over steps {steps[0]}-{steps[-1]})" if parts else ""


def counterfactuals(run: str | Path | RemotePath, rule: Rule, finding: Finding,
                    overrides: Mapping[str, Any] | None = None, device: str = "cpu") -> list[dict]:
    """What each of ``rule``'s addressing settings changes on ``finding``'s batches: one entry
    per (alternative, metric), ``{"settings": {key: value}, "metric", "statistic", "window":
    [first, last], "with", "without"}`` (see the module doc). ``without`` is the run's own
    settings plus ``overrides``; an alternative the run already has is left out, and so is a
    metric neither side gives. Raises :class:`ComputeError` when nothing could be computed for a
    reason (a refused setting, every step failing), :class:`RldiagError` for an unreadable run."""
    entries, errors = compute(run, rule, finding, overrides, device)
    if errors and not entries:
        raise ComputeError(f"counterfactual of {rule.id}: " + "; ".join(errors))
    return entries


#: prefixes a sentence leaves out of a key (what is left still names the setting)
_PREFIXES = ("actor_rollout_ref.actor.", "algorithm.rollout_correction.", "algorithm.", "rldiag.")


def _short(key: str) -> str:
    """``clip_ratio_high``, ``rollout_is``, ``filter_groups.enable``: the key less its usual prefix."""
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _show(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "null" if v is None else str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


#: how a metric reads in a sentence ({w}: with, {wo}: without); others: "<metric> is {w} instead of {wo}"
_PHRASES = {
    "rldiag/grad_weight/clipped_share": "the clipped tokens carry {w:.0%} of the gradient weight instead of {wo:.0%}",
    "rldiag/grad_weight/top1pct_share": "the top 1 % of tokens carry {w:.0%} of the gradient weight instead of {wo:.0%}",
}


def _metric_text(e: Mapping[str, Any], first: bool) -> str:
    phrase = _PHRASES.get(e["metric"])
    if phrase is not None and math.isfinite(e["with"]) and math.isfinite(e["without"]):
        return phrase.format(w=e["with"], wo=e["without"])
    where = " on these batches" if first else ""
    return f"{e['metric']}{where} is {_show(e['with'])} instead of {_show(e['without'])}"


def _change(key: str, value: Any, settings: Mapping[str, Any]) -> str:
    own = own_value(settings, key)
    same = same_value(value, own)
    return f"{_short(key)}={_show(value)}" + ("" if same else f" instead of {_show(own)}")


def describe(entries: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]) -> list[str]:
    """One sentence per alternative of ``entries`` (a finding's counterfactual), e.g. "with
    clip_ratio_high=0.28 instead of 0.2 on steps 340-360, pg_clipfrac on these batches is 0.09
    instead of 0.31 and the clipped tokens carry 4% of the gradient weight instead of 19%";
    ``settings``: the run's (a doctor report's ``settings``), for the values replaced."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for e in entries:
        groups.setdefault(repr(sorted(e["settings"].items())), []).append(e)
    out = []
    for group in groups.values():
        e0 = group[0]
        change = ", ".join(_change(k, v, settings) for k, v in e0["settings"].items())
        a, b = e0["window"]
        stat = e0["statistic"]
        how = "" if stat == "mean" else f" ({stat})"
        parts = [_metric_text(e, i == 0) for i, e in enumerate(group) if e["with"] != e["without"]]
        if not parts:  # every line equal: nothing to say (the doctor leaves such lines out)
            continue
        out.append(f"with {change} on steps {a}-{b}{how}, " + " and ".join(parts))
    return out
