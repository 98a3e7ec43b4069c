"""``rldiag rows RUN``: every row of every step, filtered, sorted and paged.

The scenario's per-row tables (``rows/step_<N>.parquet``, which every recompute writes) queried
in DuckDB (:func:`rldiag.api.rows`): ``--where`` one SQL boolean expression over the columns
(``"is_weight_seq > 5 AND length >= 512"``), ``--sort`` a column (``-col``: descending),
``--search`` text in the responses (the batch files' ``response_tokens``), ``--other`` a second
scenario joined by (step, row) as ``other_<name>`` columns. Prints a table (with the count of
matching rows in its title), or with ``--json`` a JSON array of the rows, one object each.
A run with no baseline yet has it computed first (with a progress bar), as the app does on open.
Exit 0; 1 on an error (a bad filter names the column or word; another scenario without per-row
tables says to run ``rldiag recompute RUN --name ...`` first).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

from rich.table import Table

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import add_progress_flags, console, err_console, fmt, progress_bar
from rldiag.errors import QueryError, RunDirError

#: the columns the table shows first, when the query has them (``--columns`` picks others); the sort
#: column is always shown, and the response preview last
DEFAULT_COLUMNS = ("step", "row", "uid", "length", "turns", "score", "advantage_mean", "is_weight_seq",
                   "rollout_kl", "loss_weight", "group_has_signal")
#: the same for ``--group-by``: the keys, the group's size, its counts and means
GROUP_COLUMNS = ("step", "uid", "data_source", "rows", "length_sum", "clipped_tokens_sum", "score_mean",
                 "advantage_mean_mean", "is_weight_seq_mean", "group_has_signal_mean")
#: characters of the response text in the table's ``response`` column
PREVIEW_CHARS = 40


def add_parser(sub) -> None:
    sp = sub.add_parser("rows", help="every row of every step: filter (SQL expression), sort, page, search the text",
                        add_help=False)
    # `--sort -advantage_mean`: a word after one dash is a value here, as argparse takes a negative
    # number (the command has no one-dash option: --help only)
    sp._negative_number_matcher = re.compile(r"^-[^-]")
    sp.add_argument("--help", action="help", help="show this help message and exit")
    sp.add_argument("run", help="the run directory")
    sp.add_argument("--where", help="a SQL boolean expression over the per-row columns, e.g. 'is_weight_seq > 5'")
    sp.add_argument("--sort", help="a column to sort by; -COL for descending (default: step, row)")
    sp.add_argument("--limit", type=int, default=50, help="rows to show (default 50)")
    sp.add_argument("--offset", type=int, default=0, help="rows to skip first (default 0)")
    sp.add_argument("--scenario", default="baseline", help="the scenario whose per-row tables to read (default baseline)")
    sp.add_argument("--search", help="only rows whose response text contains this (case-insensitive)")
    sp.add_argument("--other", help="a second scenario joined by step and row, as other_<column> columns")
    sp.add_argument("--columns", help="comma-separated columns to print (default: a few; --json prints all)")
    sp.add_argument("--group-by", choices=("uid", "step", "data_source"),
                    help="one row per group: uid (a prompt group of a step), step or data_source; counts summed "
                         "(<col>_sum; --sort takes the plain name), other columns averaged (<col>_mean), plus rows")
    sp.add_argument("--preview", type=int, default=PREVIEW_CHARS,
                    help=f"characters of the response text in the table's response column (default {PREVIEW_CHARS}; "
                         "0: none)")
    sp.add_argument("--json", action="store_true", help="print the rows as a JSON array of objects (every column)")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def _rows(args: argparse.Namespace, preview: int):
    return api.rows(args.run, args.where, args.sort, args.limit, args.offset, args.scenario, args.search,
                    other=args.other, preview=preview, group_by=args.group_by)


def run(args: argparse.Namespace) -> int:
    # here, not at the top: every command's parser imports this module, and the store brings duckdb
    from rldiag.store.rows import PREVIEW_COLUMN

    preview = 0 if args.json else max(0, args.preview)
    try:
        frame = _rows(args, preview)
    except RunDirError:
        # a run never recomputed: its baseline (the run's own settings) is computed first, as the
        # app does on open, so that one command answers; another scenario is the user's to name
        if args.scenario != "baseline" or api.reusable_steps(args.run):
            raise
        err_console.print(f"rows: {args.run} has no baseline yet; computing it (rldiag recompute RUN)")
        with progress_bar("baseline", enabled=args.progress) as bar:
            api.recompute(args.run, progress=bar)
        frame = _rows(args, preview)
    if args.json:
        rows = [{k: _json_value(v) for k, v in r.items()} for r in frame.iter_rows(named=True)]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return exit_codes.OK
    count = api.rows_count(args.run, args.where, args.scenario, args.search, other=args.other, group_by=args.group_by)
    if args.columns:
        cols = [c.strip() for c in args.columns.split(",") if c.strip()]
        missing = [c for c in cols if c not in frame.columns]
        if missing:
            raise QueryError(f"--columns: no column {', '.join(map(repr, missing))}; columns: {', '.join(frame.columns)}")
    else:
        cols = [c for c in (GROUP_COLUMNS if args.group_by else DEFAULT_COLUMNS) if c in frame.columns]
        cols += [c for c in frame.columns if c.startswith("other_advantage")]
    sort = sort_column(args.sort, frame.columns)
    if sort is not None and sort not in cols:
        cols.append(sort)  # the sort column, always shown
    if PREVIEW_COLUMN in frame.columns and PREVIEW_COLUMN not in cols:
        cols.append(PREVIEW_COLUMN)
    what = f"groups by {args.group_by}" if args.group_by else "rows"
    t = Table(title=f"{args.run} · {args.scenario}: {what} {args.offset + 1 if len(frame) else 0}-"
                    f"{args.offset + len(frame)} of {count}")
    for c in cols:
        t.add_column(c, justify="right" if frame.schema[c].is_numeric() else "left")
    for r in frame.select(cols).iter_rows():
        t.add_row(*[_cell(v) for v in r])
    console.print(t)
    return exit_codes.OK


def sort_column(sort: str | None, columns: list[str]) -> str | None:
    """The column ``--sort`` orders by (a group's ``<col>_sum`` / ``<col>_mean`` for a plain name)."""
    if not sort or not sort.strip():
        return None
    key = sort.strip().lstrip("-").strip()
    return next((c for c in (key, f"{key}_sum", f"{key}_mean") if c in columns), None)


def _cell(v) -> str:
    if isinstance(v, float):
        return fmt(v)
    return "-" if v is None else str(v)


def _json_value(v):
    """A value for JSON: NaN and infinities as null (JSON has neither)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
