"""``rldiag verify RUN``: recompute with the run's own settings and compare with what it logged.

Exit 0: every compared value matches; 1: a mismatch; 2: the run cannot be verified (missing
columns, unreadable input, nothing logged to compare); see :mod:`rldiag.cli.exit_codes`.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.table import Table

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import add_progress_flags, add_settings_flags, console, err_console, fmt, overrides_from_args, progress_bar
from rldiag.errors import RldiagError

#: the modules the command imports anyway: imported up front, the collector off (rldiag.cli.main)
IMPORTS = ("rldiag.scenario.recompute", "rldiag.analysis.verify")


def add_parser(sub) -> None:
    sp = sub.add_parser("verify", help="recompute with the run's settings and compare with what it logged")
    sp.add_argument("run", help="the run directory")
    add_settings_flags(sp)
    sp.add_argument("--steps", help="12, 10:20, 10:, :20 or 1,5,9 (default: all)")
    sp.add_argument("--rtol", type=float, help="relative tolerance of the per-token columns (default 1e-5)")
    sp.add_argument("--atol", type=float, help="absolute tolerance of the per-token columns (default 1e-6)")
    sp.add_argument("--metrics-rtol", type=float, help="relative tolerance of metrics (default 1e-4)")
    sp.add_argument("--metrics-atol", type=float, help="absolute tolerance of metrics (default 1e-5)")
    sp.add_argument("--tol", action="append", metavar="FIELD=RTOL[,ATOL]",
                    help="tolerance of one field or pattern, e.g. actor/pg_loss=1e-3 or 'critic/*=1e-3,1e-4'")
    sp.add_argument("--bf16", action="store_true", help="start from bf16 tolerances (tokens 1e-2/1e-3, metrics 2e-2/1e-3)")
    sp.add_argument("--masked-only", action="store_true", help="compare per-token columns only where response_mask is 1")
    sp.add_argument("--no-candidates", action="store_true", help="on a mismatch, do not search for matching settings")
    sp.add_argument("--candidate-steps", type=int, default=2, help="mismatching steps the candidate search uses (default 2)")
    sp.add_argument("--device", default="cpu", help="auto, cpu or cuda (default cpu)")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    sp.add_argument("-v", "--verbose", action="store_true", help="list every compared metric, not only mismatching ones")
    add_progress_flags(sp)
    sp.set_defaults(func=run, on_error=on_error)


def tolerances_from_args(args: argparse.Namespace) -> api.Tolerances:
    return api.tolerances(bf16=args.bf16, rtol=args.rtol, atol=args.atol, metrics_rtol=args.metrics_rtol,
                          metrics_atol=args.metrics_atol, fields=args.tol or [])


def run(args: argparse.Namespace) -> int:
    with progress_bar("verify", enabled=args.progress) as bar:
        report = api.verify(
            args.run, overrides_from_args(args), steps=args.steps, tolerances=tolerances_from_args(args),
            masked_only=args.masked_only, candidates=not args.no_candidates,
            candidate_steps=args.candidate_steps, device=args.device, progress=bar,
        )
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        print_report(report, args.verbose)
    return exit_codes.VERIFY_STATUS_EXIT[report.status]


def on_error(args: argparse.Namespace, exc: RldiagError, code: int) -> None:
    """After an error (printed by the CLI): the JSON report of an unverifiable run, or the verdict."""
    if args.json:
        sys.stdout.write(json.dumps({"status": "unverifiable", "exit_code": code,
                                     "error": f"{type(exc).__name__}: {exc}"}, indent=2) + "\n")
    err_console.print("verify: the run cannot be verified")


def print_report(report: api.VerifyResult, verbose: bool = False) -> None:
    t = Table(title=f"verify {report.run}  ({len(report.steps_checked)} steps checked)")
    for col in ("field", "kind", "compared", "mismatches", "max abs err", "max rel err", "rtol", "atol"):
        t.add_column(col, justify="left" if col in ("field", "kind") else "right", no_wrap=col == "field")
    quiet = []
    for f in report.fields.values():
        if f.kind == "metric" and not f.mismatches and not verbose:
            quiet.append(f)
            continue
        style = "red" if f.mismatches else None
        t.add_row(f.field, f.kind, str(f.compared), str(f.mismatches), fmt(f.max_abs_err), fmt(f.max_rel_err),
                  fmt(f.rtol), fmt(f.atol), style=style)
    console.print(t)
    if quiet:
        worst = max(f.max_rel_err for f in quiet)
        console.print(f"{len(quiet)} other metrics match (largest relative error {fmt(worst)}; -v lists them)")
    for f in report.fields.values():
        if f.noise:
            console.print(f"{f.field}: {f.noise} values differ by {api.WHITENED_CONSTANT} (largest "
                          f"{fmt(f.noise_max_abs_err)}): an exactly tied group or step, whose exact value is 0; "
                          "not mismatches", markup=False)
    if report.not_checked:
        names = sorted(report.not_checked)
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        console.print(f"not checked: {shown}", markup=False)
    if report.sampled_steps:
        shares = sorted(set(report.sampled_steps.values()))
        share = f"{shares[0]:.3g}" if len(shares) == 1 else f"{shares[0]:.3g}-{shares[-1]:.3g}"
        bands = report.estimate_bands
        outside = sorted(n for n, b in bands.items() if b["outside"])
        console.print(f"sampled steps (a capture policy kept {share} of their prompt groups): "
                      f"{len(report.sampled_steps)}; their per-token values of the kept rows are compared; "
                      f"{len(report.estimates)} step-level fields are estimates there, never mismatches: "
                      f"{len(bands)} placed in their sampling band (a delete-a-group jackknife), "
                      f"{len(bands) - len(outside)} inside it on every step (--json: estimates, estimate_bands)",
                      markup=False)
        for name in outside[:8]:
            b = bands[name]
            z = "" if b["kind"] != "band" else f", up to {b['max_z']:.1f} standard errors away (step {b['worst_step']})"
            console.print(f"  {name}: the logged value outside the sample's band on {b['outside']} of "
                          f"{b['steps']} steps{z}", markup=False)
    for step, msg in sorted(report.steps_unverifiable.items()):
        err_console.print(f"step {step} cannot be verified: {msg}", markup=False)
    if report.first_mismatch:
        console.print(f"first mismatch: {report.first_mismatch.describe()}", markup=False)
    if report.layout and (verbose or report.status == "mismatch"):
        console.print(f"batch layout: {report.layout}", markup=False)
    if report.candidates:
        console.print(f"candidate settings tried on steps {report.candidates[0].steps}: {report.candidates_tried}")
        for c in report.candidates[:8]:
            tag = "" if c.matches_all else f" (still mismatching: {', '.join(c.remaining)})"
            console.print(f"  {c.describe()}{tag}", markup=False)
    elif report.status == "mismatch" and report.candidates_tried:
        console.print(f"no single setting of the {report.candidates_tried} tried makes the mismatching fields match")
    verdict = {"match": "[green]verify: all compared values match[/green]",
               "mismatch": "[red]verify: MISMATCH[/red]",
               "unverifiable": "[yellow]verify: the run cannot be verified[/yellow]"}[report.status]
    console.print(f"{verdict} ({report.compared} values)")
