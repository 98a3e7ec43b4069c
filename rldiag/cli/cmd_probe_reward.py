"""``rldiag probe-reward RUN --reward ...``: does the reward pay degenerate replies? (docs/rescore.md)"""

from __future__ import annotations

import argparse
import json
import sys

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.cmd_rescore import add_reward_flag, describe_function
from rldiag.cli.common import add_progress_flags, console, err_console, fmt, progress_bar


def add_parser(sub) -> None:
    sp = sub.add_parser("probe-reward", help="score degenerate replies (empty, echoed prompt, bare answer, ...) with "
                                             "a reward function: does it pay a shortcut?")
    sp.add_argument("run", help="the run directory")
    add_reward_flag(sp)
    sp.add_argument("--prompts", type=int, default=256, help="prompts probed, spread over steps and data sources "
                                                             "(default 256)")
    sp.add_argument("--workers", type=int, default=None, help="worker processes (default: the cores)")
    sp.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
    sp.add_argument("--allow-code-exec", action="store_true",
                    help="let verl:default score data sources that run model-written code")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fn = api.resolve_reward(args.run, args.reward)
    err_console.print(describe_function(fn), markup=False, highlight=False)
    with progress_bar("probe", enabled=args.progress) as bar:
        rep = api.probe_reward(args.run, fn, prompts=args.prompts, workers=args.workers, timeout=args.timeout,
                               allow_code_exec=args.allow_code_exec, progress=bar)
    if args.json:
        sys.stdout.write(json.dumps(rep.to_dict(), indent=2) + "\n")
    else:
        rewarded = fmt(rep.rewarded_mean) if rep.rewarded_mean is not None else "-"
        console.print(f"{rep.prompts} prompts: real replies' mean score {fmt(rep.real_mean)}, rewarded replies' "
                      f"mean {rewarded}" + (f"; {rep.failed_calls} calls failed" if rep.failed_calls else ""))
        for p in rep.probes:
            mark = "  [red]SHORTCUT[/red]" if p.shortcut else ""
            console.print(f"  {p.probe:<18} {fmt(p.mean):>8}  ({p.n} prompts){mark}")
        for f in rep.findings:
            console.print(f"\n[yellow]WARNING[/yellow] {f.title} ({f.rule})\n  seen: {f.message}", highlight=False)
            for ex in f.evidence.details.get("examples", []):
                console.print(f"  e.g. step {ex['step']}: {ex['reply']!r} -> {fmt(ex['score'])}", markup=False)
    return exit_codes.FAILED if rep.findings else exit_codes.OK
