"""``rldiag compare RUN A B`` (scenarios, or ``logged``) and ``rldiag compare RUN --estimators
grpo,rloo,...``: per-step metric deltas and per-token agreement of advantages."""

from __future__ import annotations

import argparse
import json
import sys

from rich.table import Table

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import add_progress_flags, console, fmt, progress_bar
from rldiag.errors import ConfigError

#: the modules the command imports anyway: imported up front, the collector off (rldiag.cli.main)
IMPORTS = ("rldiag.scenario.recompute", "rldiag.analysis.compare")


SUMMARY_ROWS = (
    ("tokens compared", "tokens"),
    ("sign agreement", "sign_agreement"),
    ("sign flips", "sign_flip_fraction"),
    ("Pearson (mean over steps)", "pearson_mean"),
    ("Spearman (mean over steps)", "spearman_mean"),
    ("mean |dA|", "adv_mean_abs_change"),
    ("mean |dW| (effective weight)", "weight_mean_abs_change"),
    ("groups", "groups"),
    ("groups with signal in A", "groups_signal_a"),
    ("groups with signal in B", "groups_signal_b"),
    ("signal only in A", "groups_signal_only_a"),
    ("signal only in B", "groups_signal_only_b"),
)


def add_parser(sub) -> None:
    sp = sub.add_parser("compare", help="compare two scenarios (or a scenario and `logged`), or several estimators")
    sp.add_argument("run", help="the run directory")
    sp.add_argument("sides", nargs="*", metavar="SIDE", help="two scenario names; `logged` means the logged values")
    sp.add_argument("--estimators", help="comma list: recompute one scenario per estimator and compare each pair")
    sp.add_argument("--steps", help="12, 10:20, 10:, :20 or 1,5,9 (default: all)")
    sp.add_argument("--device", default="auto", help="device of any recompute (auto, cpu, cuda)")
    sp.add_argument("--no-recompute", action="store_true",
                    help="never recompute a scenario that lacks per-token outputs (compare metrics only)")
    sp.add_argument("--metrics", type=int, default=20, help="metric rows to print, largest change first (default 20)")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.estimators:
        if args.sides:
            raise ConfigError("give either two sides or --estimators, not both")
        with progress_bar("recompute", enabled=args.progress) as bar:
            by_estimator = api.compare_estimators(args.run, args.estimators.split(","), steps=args.steps,
                                                  device=args.device, progress=bar)
        if args.json:
            sys.stdout.write(json.dumps(by_estimator.to_dict(), indent=2) + "\n")
            return exit_codes.OK
        if by_estimator.recomputed:
            console.print(f"recomputed: {', '.join(by_estimator.recomputed)}", markup=False)
        print_pairs(by_estimator.pairs)
        return exit_codes.OK
    if len(args.sides) != 2:
        raise ConfigError("compare needs two sides (scenario names or `logged`), or --estimators a,b,...")
    with progress_bar("compare", enabled=args.progress) as bar:
        rep = api.compare(args.run, args.sides[0], args.sides[1], steps=args.steps,
                          recompute_missing=not args.no_recompute, device=args.device, progress=bar)
    changes = api.reward_changes(args.run, args.sides[0], args.sides[1], steps=args.steps)
    if args.json:
        doc = rep.to_dict() if changes is None else {**rep.to_dict(), "reward_changes": changes.to_dict()}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return exit_codes.OK
    print_report(rep, args.metrics)
    if changes is not None:
        print_reward_changes(changes)
    return exit_codes.OK


def print_reward_changes(c: api.RewardChangeResult) -> None:
    """What a rescore changed (``api.reward_changes``)."""
    console.print(f"\nwhat the reward changed ({c.b} against {c.a}):", markup=False)
    console.print(f"  rows whose score changed: {c.score_changed} of {c.rows} ({100 * c.share_changed:.1f}%)"
                  + "".join(f"; {src}: {r['changed']}/{r['rows']}" for src, r in sorted(c.by_source.items())),
                  markup=False)
    console.print(f"  groups: {c.gained_signal} gained signal, {c.lost_signal} lost it (of {c.groups}); "
                  f"{c.sign_flips} rows' mean advantage changed sign", markup=False)
    if c.top_tokens:
        console.print(f"  tokens whose gradient weight changed most ({len(c.token_steps)} steps with tokens):",
                      markup=False)
        for t in c.top_tokens:
            console.print(f"    step {t['step']} row {t['row']} token {t['position']} {t['token']!r}: "
                          f"{fmt(t['weight_a'])} -> {fmt(t['weight_b'])}", markup=False)


def print_pairs(pairs: list[api.CompareResult]) -> None:
    t = Table(title="advantage agreement, pair by pair")
    t.add_column("A")
    t.add_column("B")
    for label, _ in SUMMARY_ROWS[1:7]:
        t.add_column(label, justify="right")
    t.add_column("signal only A/B", justify="right")
    for p in pairs:
        s = p.summary
        t.add_row(p.a.removeprefix("adv_estimator="), p.b.removeprefix("adv_estimator="),
                  *(fmt(s.get(k)) for _, k in SUMMARY_ROWS[1:7]),
                  f"{s.get('groups_signal_only_a', 0)}/{s.get('groups_signal_only_b', 0)}")
    console.print(t)
    for p in pairs:
        console.print(f"wrote {p.path}", markup=False)


def print_report(rep: api.CompareResult, n_metrics: int) -> None:
    if rep.recomputed:
        console.print(f"recomputed with per-token outputs: {', '.join(rep.recomputed)}", markup=False)
    if rep.tokens:
        t = Table(title=f"advantages: A={rep.a}  B={rep.b}  ({len(rep.token_steps)} steps)")
        t.add_column("")
        t.add_column("value", justify="right")
        for label, key in SUMMARY_ROWS:
            t.add_row(label, fmt(rep.summary.get(key)))
        console.print(t)
    for side, missing in rep.steps_without_tokens.items():
        if missing:
            console.print(f"{side}: no per-token advantages for {len(missing)} step(s)", markup=False)
    if rep.metrics:
        t = Table(title=f"metrics: B - A over {len(rep.metric_steps)} steps (largest change first)")
        for col in ("metric", "mean A", "mean B", "mean delta", "max |delta|"):
            t.add_column(col, justify="left" if col == "metric" else "right", no_wrap=col == "metric")
        rows = sorted(rep.metrics, key=lambda m: -(m.max_abs_delta if m.max_abs_delta == m.max_abs_delta else -1))
        for m in rows[:n_metrics]:
            t.add_row(m.metric, fmt(m.mean_a), fmt(m.mean_b), fmt(m.mean_delta), fmt(m.max_abs_delta))
        console.print(t)
    console.print(f"wrote {rep.path}", markup=False)
