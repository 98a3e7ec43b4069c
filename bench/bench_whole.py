"""Benchmark: the whole process of a user's recompute against two decode floors and a baseline commit.

Issue 38's time reach, measured side by side in one run: for each workload (the uniform and
long-tailed runs of bench_recompute.py), whole processes, alternating round by round:

  this     ``rldiag recompute RUN --no-reuse --device cpu`` with this tree's rldiag (every stage on,
           the files hashed, the scenario written: as a user's recompute runs)
  REV      the same command with the rldiag of ``--baseline REV`` (``git archive REV rldiag``
           extracted into a directory of its own, and its compiled kernels built there where it has
           any: without them it would run their slower twins), on a twin of the run (its batch
           files hard-linked, so that neither version reads the other's scenarios)
  torch    the decode floor that imports torch: this tree's loader
           (:func:`rldiag.io.loader.load_step`) loads every step's planned columns
           (:func:`rldiag.engine.requirements.recompute_columns`) into the engine's flat tensors,
           nothing else; the garbage collector set as the ``rldiag`` command sets it (off for the
           imports, their objects frozen, nothing left for the last pass at exit: without that
           the floor pays about 0.25 s that the command does not)
  arrow    the pyarrow-only floor: ``ParquetFile.read`` of the same columns (bench_recompute.py's)

Each process is measured ``--repeat`` times (its wall time, its CPU time, user + system, and its
peak RSS); the table gives the median of each and the ratios of the medians: this against the
torch floor and against the baseline, wall and CPU. CPU time is steadier than wall time on a
machine that other jobs load; the load average is printed before and after each workload.

  .venv/bin/python bench/bench_whole.py --baseline a3032c6                      # uniform, tail32k, tail16k
  .venv/bin/python bench/bench_whole.py --baseline a3032c6 --workloads step16m --repeat 1
  .venv/bin/python bench/bench_whole.py --workloads tail32k --repeat 5           # no baseline column

Where this tree's time goes, phase by phase: bench/bench_phases.py.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_recompute import CAPPED_SHARE, DECODE, TAIL_CAPPED, TAIL_MEDIAN, TAILED, make_run, make_tailed_run, run_shape  # noqa: E402,I001

#: the torch-importing floor: this tree's loader, every step's planned columns into the engine's
#: flat tensors (one step held at a time, as a recompute streams them), nothing else
TORCH_FLOOR = """
import gc, sys
gc.disable()  # the collector as the rldiag command sets it (rldiag.cli.main): off for the imports,
from pathlib import Path
import torch
from rldiag.config.settings import resolve_settings
from rldiag.engine.requirements import recompute_columns
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir
gc.freeze()  # their objects frozen, on for the work,
gc.enable()
run = Path(sys.argv[1])
settings = resolve_settings(run)
plan = recompute_columns(settings)
n = 0
for sf in RunDir(run).require_steps():
    n += load_step(sf, settings, plan).n_tokens
print(n)
gc.freeze()  # and no last full pass at exit
"""

PROCESSES = ("this", "base", "torch", "arrow")


def extract(rev: str, into: Path) -> Path:
    """``REV``'s ``rldiag/`` package extracted under ``into``, with its compiled kernels where it
    has any (kept, by commit: a second run reuses it)."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    tree = into / f"rev-{commit}"
    done = tree / ".extracted"
    if not done.is_file():
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True, exist_ok=True)
        have_setup = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:setup.py"],
                                    capture_output=True).returncode == 0
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "rldiag", *(["setup.py"] if have_setup else [])],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        if have_setup:
            # the revision's compiled kernels, as its install builds them: without them it would
            # run their slower twins and look slower than it is
            subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, check=True,
                           capture_output=True)
        compileall.compile_dir(str(tree / "rldiag"), quiet=1)
        done.touch()
    return tree


def twin(run: Path) -> Path:
    """A second run directory with ``run``'s files hard-linked (no ``rldiag/`` of its own yet):
    the baseline's scenarios and run metadata stay apart from this tree's."""
    other = run.with_name(run.name + "-twin")
    if not other.exists():
        tmp = other.with_name(other.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(run, tmp, copy_function=os.link, ignore=shutil.ignore_patterns("rldiag"))
        tmp.rename(other)
    return other


def measure(cmd: list[str], pythonpath: str, fresh: Path | None = None) -> dict:
    """One whole process ``cmd`` (with ``PYTHONPATH=pythonpath``): its wall seconds, CPU seconds
    and peak RSS, measured by a child of its own (bench_recompute.py's ``--proc``)."""
    if fresh is not None and fresh.exists():
        shutil.rmtree(fresh)
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_recompute.py"), "--proc", json.dumps(cmd)],
                         check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1]
    return json.loads(out)


def commands(run: Path, base_tree: Path | None) -> dict[str, tuple[list[str], str, Path | None]]:
    """name -> (command, its PYTHONPATH, the output removed before each run)."""
    from rldiag.config.settings import resolve_settings
    from rldiag.engine.requirements import recompute_columns
    from rldiag.io.loader import plan_columns, read_schema
    from rldiag.io.rundir import RunDir

    cli = str(Path(sys.executable).with_name("rldiag"))
    steps = RunDir(run).require_steps()
    files = [str(sf.path) for sf in steps]
    columns = plan_columns(recompute_columns(resolve_settings(run)), read_schema(steps[0]).names)
    out: dict[str, tuple[list[str], str, Path | None]] = {
        "this": ([cli, "recompute", str(run), "--no-reuse", "--device", "cpu", "--name", "bench-whole"], str(ROOT),
                 run / "rldiag" / "scenarios" / "bench-whole"),
    }
    if base_tree is not None:
        other = twin(run)
        out["base"] = ([cli, "recompute", str(other), "--no-reuse", "--device", "cpu", "--name", "bench-whole"],
                       str(base_tree), other / "rldiag" / "scenarios" / "bench-whole")
    out["torch"] = ([sys.executable, "-c", TORCH_FLOOR, str(run)], str(ROOT), None)
    out["arrow"] = ([sys.executable, "-c", DECODE, json.dumps(files), json.dumps(columns)], str(ROOT), None)
    return out


def medians(samples: list[dict]) -> dict:
    """The median of each measured quantity over ``samples`` (and their count)."""
    keys = ("seconds", "cpu_seconds", "peak_rss_mb")
    out = {k: statistics.median(s[k] for s in samples) for k in keys}
    out["n"] = len(samples)
    out["min_seconds"] = min(s["seconds"] for s in samples)
    return out


def ratio(a: dict | None, b: dict | None, key: str) -> str:
    """``a[key] / b[key]`` printed with two decimals, or ``-`` where either is missing."""
    if a is None or b is None or b[key] <= 0:
        return "-"
    return f"{a[key] / b[key]:.2f}"


def row(name: str, shape: str, mtok: float, got: dict[str, dict]) -> str:
    """One line of the table (see :data:`COLUMNS`)."""
    this, base, tfl, afl = (got.get(k) for k in PROCESSES)

    def cell(m: dict | None, key: str, fmt: str) -> str:
        return "-" if m is None else format(m[key], fmt)

    cells = [name, shape, f"{mtok:.2f}",
             cell(this, "seconds", ".2f"), cell(base, "seconds", ".2f"), cell(tfl, "seconds", ".2f"),
             cell(afl, "seconds", ".2f"),
             ratio(this, tfl, "seconds"), ratio(this, base, "seconds"),
             cell(this, "cpu_seconds", ".2f"), cell(base, "cpu_seconds", ".2f"), cell(tfl, "cpu_seconds", ".2f"),
             ratio(this, tfl, "cpu_seconds"), ratio(this, base, "cpu_seconds"),
             cell(this, "peak_rss_mb", ".0f"), cell(base, "peak_rss_mb", ".0f"), cell(tfl, "peak_rss_mb", ".0f"),
             cell(afl, "peak_rss_mb", ".0f")]
    return " ".join(format(c, spec) for c, (_, spec) in zip(cells, COLUMNS))


#: the table's columns: (header, format); ``x floor``: this / the torch floor; ``x base``: this / REV
COLUMNS = [("workload", "<9"), ("steps x rows", ">12"), ("Mtok", ">6"),
           ("this s", ">7"), ("base s", ">7"), ("torch s", ">8"), ("arrow s", ">8"), ("x floor", ">8"), ("x base", ">7"),
           ("this cpu", ">9"), ("base cpu", ">9"), ("torch cpu", ">10"), ("cpu x fl", ">9"), ("cpu x base", ">11"),
           ("this MB", ">8"), ("base MB", ">8"), ("torch MB", ">9"), ("arrow MB", ">9")]


def header() -> str:
    return " ".join(format(name, spec) for name, spec in COLUMNS)


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def make_workload(base: Path, name: str, args: argparse.Namespace) -> Path:
    if name == "uniform":
        return make_run(base / f"run-{args.steps}-{args.rows}-{args.tokens}", args.steps, args.rows, args.tokens)
    if name not in TAILED:
        raise SystemExit(f"unknown workload {name!r}; choose from uniform, {', '.join(TAILED)}")
    steps, rows, cap, at_cap = TAILED[name]
    rows, cap = max(8, int(rows * args.scale)), max(64, int(cap * args.scale))
    return make_tailed_run(base / f"{name}-{rows}-{cap}", steps, rows, cap, median=max(8, int(TAIL_MEDIAN * args.scale)),
                           capped=CAPPED_SHARE.get(name, TAIL_CAPPED), capped_rows=at_cap)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="uniform,tail32k,tail16k",
                    help=f"uniform (--steps x --rows x --tokens) and the long-tailed {', '.join(TAILED)}")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the long-tailed workloads (tests)")
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds of every process (median of)")
    ap.add_argument("--baseline", default=None, help="a git revision whose rldiag runs the same recompute")
    ap.add_argument("--no-floors", action="store_true", help="leave the two decode floors out")
    ap.add_argument("--dir", default=None, help="where to keep generated runs (default: a temp dir)")
    args = ap.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rldiag-whole-"))
    base.mkdir(parents=True, exist_ok=True)
    compileall.compile_dir(str(ROOT / "rldiag"), quiet=1)  # as an installed package has it
    base_tree = extract(args.baseline, base) if args.baseline else None
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}; baseline {args.baseline or '-'}; "
          f"median of {args.repeat} alternating rounds; {load()}")
    print("x floor: this / the torch floor; x base: this / the baseline (wall: seconds; cpu: user + system seconds)")
    print(header())
    print("-" * len(header()))
    for name in args.workloads.split(","):
        run = make_workload(base, name, args)
        steps, rows, tokens, _ = run_shape(run)
        cmds = commands(run, base_tree)
        if args.no_floors:
            cmds = {k: v for k, v in cmds.items() if k not in ("torch", "arrow")}
        before = load()
        samples: dict[str, list[dict]] = {k: [] for k in cmds}
        for _ in range(args.repeat):  # alternating: a busy spell of a shared machine weighs on each alike
            for k, (cmd, path, fresh) in cmds.items():
                samples[k].append(measure(cmd, path, fresh))
        got = {k: medians(v) for k, v in samples.items()}
        print(row(name, f"{steps} x {rows // steps}", tokens / 1e6, got))
        print(f"  {name}: {before} before, {load()} after; best wall s: "
              + ", ".join(f"{k} {v['min_seconds']:.2f}" for k, v in got.items()), flush=True)


if __name__ == "__main__":
    main()
