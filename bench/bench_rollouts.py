"""Benchmark: the app on a big run with text, the Rollouts page and the background baseline.

Writes a synthetic run shaped like a reasoning run's (``--steps`` x ``--rows`` rows, lognormal
response lengths around ``--median`` tokens, ``--capped`` of the rows at the ``--cap``, a word
per token in ``response_tokens`` and ``prompt_tokens``; about 4 GB at the default 100 x 1,024),
checks the free disk first, then:

  CLI        ``rldiag recompute --no-reuse --device cpu`` on a second copy (hard links to the
             same batch files), the time to match
  app        ``rldiag app RUN`` started fresh, headless chromium opens the Rollouts page at once:
             while the background baseline computes: the first page of the table (the steps
             done so far), and the memory of the server's whole process tree (sampled every
             0.2 s, the maximum, by process at that maximum); the baseline's wall time from the page's opening until every
             step is written, against the CLI's (target: 1.3x)
  Rollouts   after the baseline, each from its action until the page shows its result:
             the table's first page on opening the page (target 2 s), a widget filter over all
             rows ("Length at the cap", target 2 s), a text search over every response (target
             15 s), and a transcript at the cap, coloured by the advantage (the step's per-token
             values computed on demand; target 2 s)

Usage:
  .venv/bin/python bench/bench_rollouts.py                          # 100 steps x 1,024 rows
  .venv/bin/python bench/bench_rollouts.py --steps 20 --rows 256 --dir /data/bench
  .venv/bin/python bench/bench_rollouts.py --dir /data/bench --keep    # the same run again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: the word the text search looks for: one of the rarest of the synthetic vocabulary
SEARCH = "w1999"


def run_bytes(steps: int, rows: int, median: int, cap: int, capped: float) -> int:
    """About the bytes of the run's batches: six float columns and a word (about 10 bytes with its
    offset) a token, at the lognormal's mean length plus the capped rows."""
    import math

    mean_len = min(cap, median * math.exp(0.8**2 / 2)) * (1 - capped) + cap * capped
    return int(steps * rows * mean_len * (6 * 4 + 10))


def make_run(path: Path, steps: int, rows: int, median: int, cap: int, capped: float) -> Path:
    from rldiag.synth import SynthSpec, write_synth_run

    spec = SynthSpec(steps=steps, prompts=max(1, rows // 8), n=8, min_len=1, max_len=cap, lengths="lognormal",
                     median_len=median, capped=capped, text=True, seed=11)
    return write_synth_run(path, spec)


def link_copy(src: Path, dest: Path) -> Path:
    """A second run directory whose batch files are hard links to ``src``'s (read, never written)."""
    (dest / "batches").mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    for f in (src / "batches").iterdir():
        os.link(f, dest / "batches" / f.name)
    return dest


class TreeMemory(threading.Thread):
    """The memory of a process and all its descendants, sampled every 0.2 s, at its maximum: the
    sum of their proportional set sizes (PSS: a page shared by n processes counts 1/n in each, so
    the sum is the physical memory the tree holds; the fork server's children share its imported
    modules), and the sum of their resident sizes (RSS: shared pages counted in every process)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak_pss, self.peak_rss, self.done = pid, 0, 0, threading.Event()
        self.peak_root_rss = 0  # the process alone (its resident size)
        #: each process's PSS at the tree's peak, by its role (:func:`role`); and each role's own peak
        self.at_peak: dict[str, int] = {}
        self.role_peak: dict[str, int] = {}

    def run(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self.done.wait(0.2):
            pss = rss = 0
            parts: dict[str, int] = {}
            for p in [root, *root.children(recursive=True)]:
                try:
                    info = p.memory_full_info()
                    name = "server" if p is root else role(p)
                except psutil.Error:  # a child that just ended
                    continue
                pss, rss = pss + info.pss, rss + info.rss
                parts[name] = parts.get(name, 0) + info.pss
                if p is root:
                    self.peak_root_rss = max(self.peak_root_rss, info.rss)
            if pss > self.peak_pss:
                self.at_peak = parts
            for name, v in parts.items():
                self.role_peak[name] = max(self.role_peak.get(name, 0), v)
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)

    def breakdown(self) -> str:
        """The tree's peak by process ("server 512, baseline child 700, ..." in MB of PSS), then
        each role's own peak."""
        def mb(parts: dict[str, int]) -> str:
            return ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))

        return f"{mb(self.at_peak)}; each alone at its peak: {mb(self.role_peak)}"


def role(proc) -> str:
    """What a process of the app's tree is: the fork server, the baseline's child, a page's
    one-off child (:mod:`rldiag.app.worker` names them: ``/proc/PID/comm``), or its command's name."""
    comm, title = proc.name(), " ".join(proc.cmdline())
    for mark, name in (("rldiag-baseline", "baseline child"), ("rldiag-page", "page child")):
        if comm.startswith(mark):
            return name
    for mark, name in (("forkserver", "fork server"), ("resource_tracker", "resource tracker")):
        if mark in title:
            return name
    return comm


@contextlib.contextmanager
def watched_page(run: Path, exe: str, path: str, server_timeout: float, page_timeout_ms: int):
    """``rldiag app RUN`` started fresh, its process tree's memory watched (:class:`TreeMemory`,
    stopped on exit), and a headless page navigated to ``path``: ``(server, page, memory, t0)``,
    ``t0`` the navigation's start (``time.perf_counter()``)."""
    from playwright.sync_api import sync_playwright

    from rldiag.viz.serve import CHROMIUM_ARGS, AppServer

    with AppServer(run, timeout=server_timeout) as srv, sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        mem = TreeMemory(srv.proc.pid)
        mem.start()
        ctx = p.chromium.launch_persistent_context(profile, executable_path=exe, headless=True, args=CHROMIUM_ARGS,
                                                   viewport={"width": 1400, "height": 1000})
        try:
            pg = ctx.new_page()
            pg.set_default_timeout(page_timeout_ms)
            t0 = time.perf_counter()
            pg.goto(f"{srv.url}/{path}", wait_until="commit")
            yield srv, pg, mem, t0
        finally:
            ctx.close()
            mem.done.set()
            mem.join()


def _caption(pg) -> str:
    """The table's caption ("N rows match · rows 1-50 ..."), or '' before it is drawn."""
    loc = pg.get_by_text(" rows match", exact=False)
    return loc.first.inner_text() if loc.count() else ""


def _until(pg, predicate, timeout_s: float = 600) -> float:
    """Seconds until ``predicate()`` holds (polled every 20 ms)."""
    t0 = time.perf_counter()
    while not predicate():
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError("the page did not show the result in time")
        pg.wait_for_timeout(20)
    return time.perf_counter() - t0


def bench_app(run: Path, steps: int, rows: int, cap: int) -> list[tuple[str, float, str]]:
    from rldiag import api
    from rldiag.viz.serve import chromium_path

    exe = chromium_path()
    if exe is None:
        return [("the app", float("nan"), "skipped: no chromium (apt-get install chromium)")]
    meta_file = run / "rldiag" / "scenarios" / "baseline" / "scenario.json"

    def steps_written() -> int:
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            return 0
        return len(meta.get("steps_done", [])) + len(meta.get("steps_failed", {}))

    out = []
    with watched_page(run, exe, "rollouts", 300, 600_000) as (srv, pg, mem, t0):
        pg.wait_for_selector('[data-testid="stDataFrame"]', state="attached")
        t_first = time.perf_counter() - t0
        out.append(("Rollouts while the baseline computes: the first page", t_first,
                    f"{_caption(pg)!r}; {steps_written()} of {steps} steps written then"))
        while steps_written() < steps:
            time.sleep(0.1)
        t_app = time.perf_counter() - t0
        mem.done.set()
        mem.join()  # the baseline's peak (watched_page stops it again on exit: a no-op)
        seconds = json.loads(meta_file.read_text()).get("seconds", float("nan"))
        out.append(("the app's baseline (page opened -> every step written)", t_app,
                    f"the worker's recompute {seconds:.1f} s; load average {os.getloadavg()[0]:.1f}"))
        out.append(("server process tree memory while the baseline computes (GB, max PSS)", mem.peak_pss / 1e9,
                    f"GB, not seconds; target 1.5; the sum of the resident sizes {mem.peak_rss / 1e9:.2f} GB; "
                    f"at the peak (MB of PSS): {mem.breakdown()}"))

        # what the page must show, counted through the API (the same DuckDB query)
        expect = {"all": api.rows_count(run), "cap": api.rows_count(run, f"length = {cap}"),
                  "search": api.rows_count(run, search=SEARCH)}
        if expect["all"] != steps * rows:
            raise SystemExit(f"the per-row tables hold {expect['all']} rows, not {steps} x {rows}")
        t0 = time.perf_counter()
        pg.goto(f"{srv.url}/rollouts", wait_until="commit")
        want_all = f"{expect['all']} rows match"
        t = _until(pg, lambda: want_all in _caption(pg))
        out.append(("Rollouts: the table's first page on opening the page", t, f"{want_all}; target 2 s"))

        want_cap = f"{expect['cap']} rows match"
        t0 = time.perf_counter()
        pg.get_by_text(f"Length at the cap ({cap})").click()
        t = _until(pg, lambda: want_cap in _caption(pg))
        out.append(("Rollouts: widget filter 'Length at the cap' over every row", t, f"{want_cap}; target 2 s"))
        # the filter opens its first row, at the cap: its transcript, coloured by the advantage (the
        # step's per-token values computed on demand), timed from the same click
        t += _until(pg, lambda: pg.locator(".rldiag-transcript .turn .tok, .rldiag-transcript .tool-obs .tok").count()
                    >= cap)
        out.append((f"Rollouts: a {cap:,}-token transcript drawn, coloured by the advantage", t,
                    "from the filter's click (the filter's time included); target 2 s"))

        pg.get_by_text(f"Length at the cap ({cap})").click()  # off again: search every row
        _until(pg, lambda: want_all in _caption(pg))
        want_search = f"{expect['search']} rows match"
        box = pg.get_by_label("Search the responses")
        t0 = time.perf_counter()
        box.fill(SEARCH)
        box.press("Enter")
        _until(pg, lambda: want_search in _caption(pg))
        t = time.perf_counter() - t0
        out.append((f"Rollouts: text search {SEARCH!r} over every response", t, f"{want_search}; target 15 s"))
        errors = pg.locator('[data-testid="stException"]').count()
        if errors:
            out.append(("exceptions shown on the page", float(errors), "count, not seconds"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--median", type=int, default=600, help="median response length (tokens)")
    ap.add_argument("--cap", type=int, default=16384, help="data.max_response_length")
    ap.add_argument("--capped", type=float, default=0.02, help="share of the rows at the cap")
    ap.add_argument("--dir", type=Path, help="where to write the runs (default: a temporary directory)")
    ap.add_argument("--no-cli", action="store_true", help="skip the CLI recompute to compare with")
    ap.add_argument("--keep", action="store_true", help="with --dir: reuse the run written there the last time "
                    "with the same shape (its outputs removed) instead of writing it again")
    args = ap.parse_args()

    from bench_app import print_table  # this script's folder is on the path when it runs

    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        os.environ["RLDIAG_HOME"] = str(root / "rldiag-home")  # never the user's
        need = int(1.3 * run_bytes(args.steps, args.rows, args.median, args.cap, args.capped)) + 2**30
        free = shutil.disk_usage(root).free
        if free < need:
            raise SystemExit(f"not enough free disk under {root}: {free / 2**30:.1f} GB free, about "
                             f"{need / 2**30:.1f} GB needed (use --dir elsewhere, or fewer --steps)")
        shape_file = root / "shape.json"
        want = json.dumps([args.steps, args.rows, args.median, args.cap, args.capped])
        t0 = time.perf_counter()
        if args.keep and shape_file.is_file() and shape_file.read_text() == want:
            run = root / "app"  # the run of the last time, its outputs removed
            for d in (run / "rldiag", root / "cli", root / "rldiag-home"):
                shutil.rmtree(d, ignore_errors=True)
        else:
            for d in ("app", "cli"):
                shutil.rmtree(root / d, ignore_errors=True)
            shape_file.unlink(missing_ok=True)
            run = make_run(root / "app", args.steps, args.rows, args.median, args.cap, args.capped)
            shape_file.write_text(want)
        size = sum(f.stat().st_size for f in (run / "batches").iterdir())
        shape = (f"{args.steps} steps x {args.rows} rows, median {args.median} tokens, {args.capped:.0%} at "
                 f"{args.cap:,}; {size / 2**30:.2f} GB of batches")
        print(f"wrote {run} ({shape}) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        rows = []
        if not args.no_cli:
            cli = link_copy(run, root / "cli")
            cmd = [sys.executable, "-m", "rldiag.cli.main", "recompute", str(cli), "--no-reuse", "--device", "cpu",
                   "--no-progress"]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            t_cli = time.perf_counter() - t0
            meta = json.loads((cli / "rldiag" / "scenarios" / "baseline" / "scenario.json").read_text())
            rows.append(("rldiag recompute --no-reuse (CLI, another copy)", t_cli,
                         f"its recompute {meta['seconds']:.1f} s; load average {os.getloadavg()[0]:.1f}"))
        rows += bench_app(run, args.steps, args.rows, args.cap)
        if not args.no_cli:
            t_app = next(s for name, s, _ in rows if name.startswith("the app's baseline"))
            rows.append(("the app's baseline / the CLI's (wall)", t_app / t_cli, "ratio, not seconds; target 1.3"))
    print_table(f"rldiag app, Rollouts: {shape}", rows)

if __name__ == "__main__":
    main()
