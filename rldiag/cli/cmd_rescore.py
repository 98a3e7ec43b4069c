"""``rldiag rescore RUN --reward ...``: the saved rollouts scored by another reward function, and
everything after it recomputed (docs/rescore.md)."""

from __future__ import annotations

import argparse
import os

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import (
    add_progress_flags,
    add_settings_flags,
    console,
    err_console,
    fmt,
    overrides_from_args,
    progress_bar,
)

#: failed rows listed one by one, at most (the rest counted)
SHOWN_FAILURES = 20


def add_reward_flag(sp: argparse.ArgumentParser, required: bool = True) -> None:
    """``--reward`` as rescore, probe-reward and doctor take it."""
    sp.add_argument("--reward", required=required, metavar="FILE.py:NAME|MODULE:NAME|verl:default|from-config",
                    help="the reward function: a function of a file or module, verl's default_compute_score, or "
                         "the run's own (from-config: reward.custom_reward_function, named explicitly, never run "
                         "by default)")


def add_parser(sub) -> None:
    sp = sub.add_parser("rescore", help="score the saved rollouts with another reward function and recompute "
                                        "everything after it")
    sp.add_argument("run", help="the run directory")
    add_reward_flag(sp)
    add_settings_flags(sp)
    sp.add_argument("--name", help="scenario name (default: reward=<function name>)")
    sp.add_argument("--steps", help="12, 10:20, 10:, :20 or 1,5,9 (default: all)")
    sp.add_argument("--workers", type=int, default=None,
                    help=f"worker processes calling the function (default: the cores, {os.cpu_count()})")
    sp.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
    sp.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    sp.add_argument("--save-tokens", action="store_true", help="also write per-token results")
    sp.add_argument("--no-dedupe", dest="dedupe", action="store_false",
                    help="call the function for every row, even identical ones (stochastic or LLM-judge rewards)")
    sp.add_argument("--allow-code-exec", action="store_true",
                    help="let verl:default score data sources that run model-written code (prime_code, sandbox)")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def describe_function(fn: api.RewardFunction) -> str:
    """The function in one line: where it is, its SHA-256, what is merged into each call."""
    where = fn.file or fn.module or "?"
    sha = f" (sha256 {fn.sha256})" if fn.sha256 else ""
    kwargs = f", reward_kwargs {fn.kwargs}" if fn.kwargs else ""
    return f"reward {fn.spec}: {fn.name} in {where}{sha}{kwargs}"


def run(args: argparse.Namespace) -> int:
    fn = api.resolve_reward(args.run, args.reward)
    err_console.print(describe_function(fn), markup=False, highlight=False)  # before anything runs
    with progress_bar("rescore", enabled=args.progress) as bar:
        result = api.rescore(args.run, fn, overrides_from_args(args), name=args.name, steps=args.steps,
                             workers=args.workers, timeout=args.timeout, save_tokens=args.save_tokens,
                             dedupe=args.dedupe, allow_code_exec=args.allow_code_exec, device=args.device,
                             progress=bar)
    return summary(result)


def summary(result: api.RescoreResult) -> int:
    sc = result.scenario
    failed = result.failures.height
    console.print(f"scenario {sc.name}: {result.rows} rows scored ({result.calls} calls"
                  f"{', deduplicated' if result.dedupe else ''}; manager {result.manager}) in "
                  f"{result.score_seconds:.2f}s; {result.changed} rows changed score"
                  f" ({100 * result.changed / max(result.rows, 1):.1f}%), {failed} failed"
                  f"{f', {result.workers_replaced} workers replaced' if result.workers_replaced else ''}")
    metrics = sc.metrics
    for name in ("critic/score/mean", "critic/advantages/mean", "rldiag/groups/no_signal_fraction"):
        if name in metrics.columns:
            vals = [v for v in metrics[name].to_list() if v is not None and v == v]
            if vals:
                console.print(f"  {name}: mean {fmt(sum(vals) / len(vals))} over {len(vals)} steps")
    for note in result.notes:
        console.print(f"note: {note}", markup=False)
    if failed:
        err_console.print(f"[yellow]{failed} row(s) kept their captured score (the call failed):[/yellow]")
        for rec in result.failures.head(SHOWN_FAILURES).iter_rows(named=True):
            err_console.print(f"  step {rec['step']} row {rec['row']} ({rec['data_source']}): {rec['message']}",
                              markup=False, highlight=False)
        if failed > SHOWN_FAILURES:
            err_console.print(f"  ... and {failed - SHOWN_FAILURES} more")
    console.print(f"wrote {sc.path}")
    if result.steps_failed:
        err_console.print(f"[red]{len(result.steps_failed)} step(s) failed:[/red] "
                          + ", ".join(str(s) for s in sorted(result.steps_failed)))
        for step, msg in sorted(result.steps_failed.items()):
            err_console.print(f"  step {step}: {msg}", markup=False, highlight=False)
        return exit_codes.FAILED
    return exit_codes.OK
