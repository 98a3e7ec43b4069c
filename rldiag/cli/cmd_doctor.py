"""``rldiag doctor RUN``: health checks over the logged and recomputed metrics.

Exit 0: no finding; 1: at least one finding; 2: the run or a rules file cannot be read (see
:mod:`rldiag.cli.exit_codes`).

``--follow`` (:func:`rldiag.api.follow_doctor`) prints an event per finding that fires, changes or
clears while the run writes: a line each, or with ``--json`` one JSON object per line on stdout
(``{"event", "step", "finding"}``) and the summary on stderr. It ends with exit 0 after
``--idle-timeout`` seconds without a new metrics line or batch file, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from rich.markup import escape

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import add_progress_flags, add_settings_flags, console, err_console, fmt, overrides_from_args, progress_bar
from rldiag.errors import ConfigError

#: the modules the command imports anyway: imported up front, the collector off (rldiag.cli.main)
IMPORTS = ("rldiag.scenario.recompute", "rldiag.doctor")


def add_parser(sub) -> None:
    sp = sub.add_parser("doctor", help="health checks over the logged and recomputed metrics")
    sp.add_argument("run", help="the run directory")
    sp.add_argument("--rules", action="append", metavar="FILE", help="YAML rules file adding or overriding rules by id")
    add_settings_flags(sp)
    sp.add_argument("--steps", help="12, 10:20, 10:, :20 or 1,5,9 (default: all)")
    sp.add_argument("--logged-only", action="store_true", help="use metrics.jsonl only, do not recompute")
    sp.add_argument("--device", default="cpu", help="auto, cpu or cuda (default cpu)")
    sp.add_argument("--no-counterfactual", dest="counterfactual", action="store_false",
                    help="do not recompute each finding's window under the settings that address it")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    sp.add_argument("--reward", default=None, metavar="FILE.py:NAME|MODULE:NAME|verl:default|from-config",
                    help="also probe this reward function for shortcuts (rldiag probe-reward): reward_shortcut findings")
    sp.add_argument("-v", "--verbose", action="store_true", help="also list passed, skipped and inapplicable rules")
    sp.add_argument("--follow", action="store_true",
                    help="keep watching the run as it writes: print each finding when it fires, changes or clears")
    sp.add_argument("--poll", type=float, default=0.5, help="with --follow: seconds between looks (default 0.5)")
    sp.add_argument("--idle-timeout", type=float, default=None,
                    help="with --follow: stop (exit 0) after this many seconds without a new metrics line or batch file")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.follow:
        return follow(args)
    with progress_bar("doctor", enabled=args.progress) as bar:
        rep = api.diagnose(args.run, overrides_from_args(args), rules_files=args.rules or (), steps=args.steps,
                           recompute=not args.logged_only, device=args.device, progress=bar,
                           counterfactual=args.counterfactual, reward=args.reward)
    if args.json:
        sys.stdout.write(json.dumps(rep.to_dict(), indent=2) + "\n")
    else:
        print_report(rep, args.verbose)
    return exit_codes.OK if rep.healthy else exit_codes.FAILED


#: the rules about the rollout-vs-trainer gap, shown together: its size and trend, then its causes
ROLLOUT_RULES = ("rollout_kl_growing", "rollout_chi2_growing", "rollout_ppl_gap_growing", "rollout_mismatch")
_COLOURS = {"critical": "red", "warning": "yellow", "info": "cyan"}


def _print_finding(f, settings: dict) -> bool:
    """Print one finding; True when it showed a counterfactual."""
    color = _COLOURS.get(f.severity, "yellow")
    console.print(f"\n[{color}]{f.severity.upper()}[/{color}] [bold]{f.title}[/bold] ({f.rule})")
    console.print(f"  seen: {f.message}", markup=False)
    ev = f.evidence
    if ev.state is not None:
        console.print(f"  state: {state_line(ev)}", markup=False)
    if ev.cause is not None:
        console.print(f"  cause: {ev.cause}, confidence {ev.confidence:.2f}; {ev.statistic}", markup=False)
    if ev.steps:
        pairs = ", ".join(f"{s}: {fmt(v)}" for s, v in list(zip(ev.steps, ev.values))[:8])
        more = f", ... ({len(ev.steps)} listed)" if len(ev.steps) > 8 else ""
        label = "per-step confidence" if ev.cause is not None else f"{ev.metric}, {ev.source}"
        console.print(f"  evidence ({label}): {pairs}{more}", markup=False)
    if ev.trend:
        tr = ev.trend
        console.print(f"  trend of {ev.details.get('trend_metric', ev.metric)}: {fmt(tr['first'])} -> {fmt(tr['last'])}, "
                      f"early mean {fmt(tr['early_mean'])}, "
                      f"late mean {fmt(tr['late_mean'])}, slope {fmt(tr['slope_per_step'])}/step", markup=False)
    if ev.band is not None:
        console.print(f"  reference band (mean of the evidence): {ev.band['text']}", markup=False)
    if ev.calibration is not None:
        console.print(f"  calibration: {ev.calibration['text']}", markup=False)
    for ex in ev.details.get("examples", [])[:5]:
        token = f" {ex['token']!r}" if ex.get("token") is not None else ""
        lag = f", lag {ex['policy_lag']}" if "policy_lag" in ex else ""
        console.print(f"  token: step {ex['step']} row {ex['row']} position {ex['position']}{token}: old "
                      f"{fmt(ex['old_log_prob'])}, rollout {fmt(ex['rollout_log_prob'])}, {ex['kl_share']:.0%} of the "
                      f"step's KL{lag}", markup=False)
    for imp in ev.details.get("implies", []):
        console.print(f"  implies: {imp['cause']} (confidence {imp['confidence']:.2f}), a consequence of this cause, "
                      f"not a second one: {imp['message']}", markup=False)
    for line in api.describe_counterfactual(f.counterfactual, settings):
        console.print(f"  if: {line}", markup=False)
    for line in ev.details.get("counterfactual_skipped", []):
        console.print(f"  not tried: {line}", markup=False)
    if f.remedy:
        console.print(f"  what to do: {f.remedy}", markup=False)
    else:
        console.print(f"  why it matters: {f.why}", markup=False)
    return bool(f.counterfactual)


#: what a cause's confidence is, said once under the findings
CONFIDENCE_MEANING = ("the strength of the cause's fingerprint, a product of ramps over its statistics "
                      "(docs/mismatch.md), not a probability")


def plural(n: int, noun: str) -> str:
    """``1 finding``, ``2 findings``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def state_line(ev) -> str:
    """``resolved since step 16: every step since is back below 0.1`` (a finding's trend state)."""
    text = f"{ev.state} since step {ev.state_since}" if ev.state_since is not None else str(ev.state)
    spark = ev.sparkline or {}
    thr, metric = spark.get("threshold"), spark.get("metric")
    side = "below" if spark.get("worse") == "above" else "above"
    if ev.state == "resolved" and thr is not None:
        text += f": {metric} back {side} {fmt(thr)} at every step since"
    elif ev.state in ("worsening", "improving") and ev.cause is not None:
        text += f": {ev.details.get('trend_metric')} {'grows' if ev.state == 'worsening' else 'shrinks'} over the last steps"
    elif ev.state in ("worsening", "improving") and thr is not None:
        text += f": the recent mean of {metric} moves {'away from' if ev.state == 'worsening' else 'towards'} {fmt(thr)}"
    return text


def _print_recompute_problems(error: str | None, failed: dict[int, str], out) -> None:
    """Why the run (or some of its steps) could not be recomputed."""
    if error:
        out.print(f"recompute unavailable: {error}", markup=False)
    if failed:
        out.print(f"{plural(len(failed), 'step')} could not be recomputed: " + ", ".join(str(s) for s in sorted(failed)),
                  markup=False)


def print_report(rep: api.DiagnoseResult, verbose: bool = False) -> None:
    console.print(f"doctor {rep.run}: {len(rep.steps)} batch steps, logged metrics for {rep.logged_steps} steps, "
                  f"recomputed {rep.recomputed_steps}", markup=False)
    _print_recompute_problems(rep.recompute_error, rep.recompute_failed, err_console)
    rollout = [f for f in rep.findings if f.rule in ROLLOUT_RULES]
    shown = False
    for f in [f for f in rep.findings if f.rule not in ROLLOUT_RULES]:
        shown |= _print_finding(f, rep.settings)
    if rollout or any(r in rep.passed for r in ROLLOUT_RULES):
        console.print("\n[bold]Rollout vs trainer log-probs[/bold] (how large, whether it grows, and why)")
        for f in rollout:
            shown |= _print_finding(f, rep.settings)
        for rid in ROLLOUT_RULES:
            if rid in rep.passed:
                console.print(f"  passed {rid}: {rep.passed[rid]}", markup=False)
    if shown:
        console.print(f"\n(\"if\" lines: {api.COUNTERFACTUAL_CAVEAT})", markup=False)
    if any(f.evidence.confidence is not None for f in rep.findings):
        console.print(f"(confidence: {CONFIDENCE_MEANING})", markup=False)
    for rid, why in rep.counterfactual_errors.items():
        err_console.print(f"counterfactual of {rid} not computed: {why}", markup=False)
    n_info = sum(f.severity == "info" for f in rep.findings)
    n_rules = len(rep.rules)
    info = f"; {n_info} for information (not counted)" if n_info else ""
    console.print(f"\n{plural(len(rep.findings) - n_info, 'finding')}; {len(rep.passed)} of {n_rules} rules passed, "
                  f"{len(rep.not_evaluated)} not evaluated, {len(rep.not_applicable)} not applicable{info}")
    if verbose:
        for rid, text in rep.passed.items():
            console.print(f"  passed {rid}: {text}", markup=False)
        for rid, text in rep.not_evaluated.items():
            console.print(f"  not evaluated {rid}: {text}", markup=False)
        for rid, text in rep.not_applicable.items():
            console.print(f"  not applicable {rid}: {text}", markup=False)
    if rep.healthy:
        console.print("[green]no problem found[/green]")


# ---- --follow ------------------------------------------------------------------------------------


def follow(args: argparse.Namespace) -> int:
    """``--follow``: events as they happen; exit 0 at the idle timeout, 130 on Ctrl-C."""
    if args.steps:
        raise ConfigError("--steps cannot be combined with --follow (it follows every step the run writes)")
    if args.reward:
        raise ConfigError("--reward cannot be combined with --follow (run rldiag probe-reward RUN --reward ... once)")
    run_settings = api.settings(args.run, overrides_from_args(args)).resolved()
    on_event = _json_line if args.json else functools.partial(_event_line, settings=run_settings)
    try:
        summary = api.follow_doctor(args.run, overrides_from_args(args), rules_files=args.rules or (),
                                    recompute=not args.logged_only, device=args.device, poll_seconds=args.poll,
                                    idle_timeout=args.idle_timeout, on_event=on_event,
                                    counterfactual=args.counterfactual)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return exit_codes.INTERRUPTED
    _print_summary(summary, err_console if args.json else console)
    return exit_codes.OK


def _json_line(ev: api.HealthEvent) -> None:
    sys.stdout.write(json.dumps(ev.to_dict()) + "\n")
    sys.stdout.flush()


def _label(f) -> str:
    return f"{f.rule}/{f.evidence.cause}" if f.evidence.cause else f.rule


def _event_line(ev: api.HealthEvent, settings: dict) -> None:
    f = ev.finding
    color = _COLOURS.get(f.severity, "yellow") if ev.event != "cleared" else "green"
    head = f"step {ev.step:>6}  [{color}]{ev.event:<7}[/{color}] {f.severity.upper():<8} "
    if ev.event == "changed" and f.counterfactual:
        tail = "; ".join(api.describe_counterfactual(f.counterfactual, settings))
    elif ev.event == "changed" and f.evidence.state is not None:
        tail = f"{state_line(f.evidence)}; {f.message}"
    else:
        tail = f.message
    console.print(head + escape(f"{f.title} ({_label(f)}): {tail}"))


def _print_summary(summary: api.FollowDoctorResult, out) -> None:
    ev = summary.events
    active = ", ".join(f"{_label(f)} ({f.severity})" for f in summary.active) or "none"
    out.print(f"followed {summary.run} to step {summary.step} ({summary.reason}): {ev['fired']} fired, "
              f"{ev['changed']} changed, {ev['cleared']} cleared; active: {active}", markup=False)
    _print_recompute_problems(summary.recompute_error, summary.recompute_failed, out)
    for label, error in summary.counterfactual_errors.items():
        out.print(f"counterfactual of {label} failed: {error}", markup=False)
