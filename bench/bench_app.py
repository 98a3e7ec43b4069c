"""Benchmark: the app's first chart and a metrics-page interaction on a big run.

Generates a run whose metrics.jsonl has --steps steps x --metrics metrics (verl's nested form,
names with '/', grouped by prefix) and a few small batches, then measures:

  store (in process, what one Streamlit rerun of the metrics page does):
    cold load      metrics.jsonl -> DuckDB long table (first Store.status())
    names          the metric catalogue (cached afterwards)
    interaction    a new selection of 4 metrics: joined query + EMA + the 4 ECharts panels
    append         10 lines appended while "training": incremental read + the same query
  what-if (in process, what the What-if page runs on Recompute; --whatif STEPSxROWSxTOKENS):
    the scenario's recompute with tokens, then the compare of the baseline with it
  browser (`rldiag app RUN` + Debian's chromium; skipped without chromium):
    first chart    from the page's load event to the first panel's logged line drawn
                   (on the bundled sample, then on the big run); from the navigation's start
                   and from launch to chart in the notes
    interaction    adding a metric to the multiselect until its panel is drawn
    append         a line appended to metrics.jsonl until the first panel shows its step
    second tab     a new tab on the same server until its first chart
    What-if        the first switch to the What-if page until its chart
    memory         the server's resident memory after all of the above
    what-if        on the what-if run (--whatif): three what-ifs from the page, each from
                   Recompute until the compare's result is drawn, and the server's memory
  pages on open (--pages; a fresh copy of the bundled sample and a server started fresh for
  each page, headless chromium): from navigating to the page's URL until its content is drawn,
  nothing pressed (target: 5 s each): Training metrics (a panel), What-if (a panel), Step (the
  groups with the baseline's advantages, the checklist), Off-policy (the mismatch diagnosis and
  a picture), Health (the findings with the baseline's signals; the first findings, from the
  logged metrics, in the notes), Rollouts where the app has it (a table or chart)
  the app's baseline (--baseline STEPSxROWSxTOKENS, or --baseline-steps with the default
  shape): a synthetic run opened in a server started fresh, from navigating to its first page
  until the background worker has written the baseline of every step, against `rldiag
  recompute --no-reuse --device cpu` on another copy of the run (target: 1.3x); the free disk
  is checked first (two copies of the run and their outputs)
  opening a 16 M-token step (--only open; --open-run RUN, default bench_memory.py's step16m):
  a server started fresh, the Step page opened until the baseline is written and the page drawn
  with it; the peak resident memory of the server and of its process tree (PSS, by process:
  the server, the fork server, the baseline's child, a page's child)

Usage:
  .venv/bin/python bench/bench_app.py                      # 10,000 steps x 150 metrics
  .venv/bin/python bench/bench_app.py --steps 2000 --metrics 50 --no-browser
  .venv/bin/python bench/bench_app.py --only pages,baseline --baseline-steps 50
  .venv/bin/python bench/bench_app.py --only open --dir /tmp/app-bench      # the 16 M-token step
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFIXES = ("actor/", "critic/", "rollout_corr/", "response_length/", "perf/", "timing_s/", "val-core/", "training/")
FIRST = ("critic/score/mean", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss")


def metric_names(n: int) -> list[str]:
    names = list(FIRST)
    i = 0
    while len(names) < n:
        names.append(f"{PREFIXES[i % len(PREFIXES)]}metric_{i:04d}/mean")
        i += 1
    return names[:n]


def make_run(path: Path, steps: int, n_metrics: int) -> tuple[Path, list[str]]:
    from rldiag.synth import SynthSpec, write_synth_run

    names = metric_names(n_metrics)
    write_synth_run(path, SynthSpec(steps=3, write_metrics=False))
    rng = random.Random(0)
    with (path / "metrics.jsonl").open("w") as fh:
        level = {n: rng.random() for n in names}
        for s in range(1, steps + 1):
            for n in names:
                level[n] += rng.gauss(0, 0.01)
            fh.write(json.dumps({"step": s, "data": level}) + "\n")
    return path, names


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_store(run: Path, names: list[str]) -> list[tuple[str, float, str]]:
    from rldiag.store import Store
    from rldiag.store.downsample import DEFAULT_POINTS
    from rldiag.viz.echarts import metric_panel
    from rldiag.viz.smoothing import ema

    rows = []
    store = Store(run)
    t, status = timed(store.status)
    rows.append(("store: cold load of metrics.jsonl", t, f"{status.steps} steps, {status.size / 1e6:.0f} MB"))
    t, all_names = timed(store.logged_names)
    rows.append(("store: metric catalogue", t, f"{len(all_names)} names"))

    def interact(pick):  # as the page does with smoothing on: EMA over every step, both lines downsampled
        cols = store.source_columns([])
        out = []
        for m in pick:
            full = store.joined([m], [])
            raw, smooth = store.downsample(full, list(cols.values())), store.downsample(ema(full, list(cols.values()), 0.6),
                                                                                      list(cols.values()))
            out.append(metric_panel(raw, m, cols, smooth))
        return out

    picks = [names[i:i + 4] for i in range(4, 4 + 4 * 5, 4)]
    times = [timed(lambda p=p: interact(p))[0] for p in picks]
    shown = interact(picks[0])
    points = sum(len(s["data"]) for p in shown for s in p.spec["series"]) // len(shown)
    rows.append(("store: interaction (4 new metrics, EMA, panels)", statistics.median(times),
                 f"median of {len(times)}, {store.status().steps} steps a metric, {points} points a panel "
                 f"(downsampled to {DEFAULT_POINTS} columns)"))
    m = run / "metrics.jsonl"
    last = store.status().latest_step
    with m.open("a") as fh:
        for s in range(last + 1, last + 11):
            fh.write(json.dumps({"step": s, "data": {n: 0.5 for n in names}}) + "\n")
    t, _ = timed(lambda: (store.status(), interact(picks[0])))
    rows.append(("store: 10 lines appended, then the same view", t, f"reloads {store.logged.reloads}, "
                                                                    f"appends {store.logged.appends}"))
    return rows


def bench_whatif(root: Path, steps: int, rows: int, length: int) -> list[tuple[str, float, str]]:
    """What the What-if page does on Recompute (the baseline already there): the scenario's
    recompute with tokens, then the compare of the baseline with it (steps streamed, with progress)."""
    from rldiag import api
    from rldiag.scenario.recompute import recompute
    from rldiag.synth import SynthSpec, write_synth_run

    if (root / "whatif").exists():  # a fresh run: a scenario left by an earlier bench would be reused
        shutil.rmtree(root / "whatif")
    run = write_synth_run(root / "whatif", SynthSpec(steps=steps, prompts=max(1, rows // 8), n=8,
                                                     min_len=max(1, length // 2), max_len=length, seed=3))
    recompute(run, {}, name="baseline", save_tokens=True)
    t_re, _ = timed(lambda: recompute(run, {"algorithm.adv_estimator": "rloo"}, name="rloo", save_tokens=True))
    seen = []
    t_cmp, _ = timed(lambda: api.compare(run, "baseline", "rloo", recompute_missing=False,
                                         progress=lambda i, n, what: seen.append(time.perf_counter())))
    size = f"{steps} steps x {rows} rows x up to {length} tokens"
    return [
        ("what-if: recompute alone (scenario, with tokens)", t_re, size),
        ("what-if: the compare after it", t_cmp, f"{len(seen)} progress updates, one per step"),
        ("what-if: whole / recompute alone", (t_re + t_cmp) / t_re, "ratio, not seconds"),
    ]


def panel_selector() -> str:
    """A metrics or what-if panel (ECharts, SVG) with a line of one of its sources drawn (the
    what-if run logs no metrics: its panels start with the baseline's line)."""
    from rldiag.viz.charts import LOGGED_COLOUR, SCENARIO_COLOURS

    return ", ".join(f'[data-testid="stEChartsChart"] svg path[stroke="{c}"]' for c in (LOGGED_COLOUR, *SCENARIO_COLOURS))


#: the metrics panels' descriptions ("<metric>: logged steps a-b; ..."), in page order
PANEL_LABELS = ("Array.from(document.querySelectorAll('[data-testid=\"stEChartsChart\"]'))"
                ".map(c => c.getAttribute('aria-label') || '')")


def browser_whatif(pg, srv, run: Path, estimators: tuple[str, ...]) -> list[tuple[str, float, str]]:
    """On the What-if page of ``srv`` (serving ``run``, whose baseline has tokens): one what-if
    per estimator, Recompute pressed until the compare's result is drawn, then the server's RSS."""
    from rldiag.app.memory import rss_mb

    rows = []
    pg.goto(srv.url + "/whatif", wait_until="load")
    pg.get_by_role("heading", name="What-if").wait_for()
    pg.wait_for_selector(panel_selector())
    rows.append(("server memory (RSS, MB) on the what-if run, before a what-if", rss_mb(srv.proc.pid),
                 "MB, not seconds"))
    steps = len(list((run / "batches").glob("step_*.parquet")))
    for k, est in enumerate(estimators):
        box = pg.get_by_role("combobox", name="Advantage estimator")
        box.click()
        pg.get_by_role("option", name=est, exact=True).click()
        pg.get_by_text(f"adv_estimator={est}", exact=False).first.wait_for()
        t0 = time.perf_counter()
        pg.get_by_role("button", name="Recompute").click()
        pg.get_by_text(f"compare: {steps} steps", exact=True).wait_for()
        pg.wait_for_selector(".js-plotly-plot .main-svg")  # the agreement chart (plotly), after the compare
        rows.append((f"browser: what-if #{k + 1} ({est}), Recompute -> compare drawn", time.perf_counter() - t0,
                     f"{steps} steps, the compare's steps drawn as they come"))
        rows.append((f"server memory (RSS, MB) after what-if #{k + 1}", rss_mb(srv.proc.pid), "MB, not seconds"))
    return rows


def bench_browser(run: Path, names: list[str], sample: Path | None,
                  whatif_run: Path | None = None) -> list[tuple[str, float, str]]:
    from playwright.sync_api import sync_playwright

    from rldiag.app.memory import rss_mb
    from rldiag.viz.serve import CHROMIUM_ARGS, AppServer, chromium_path

    exe = chromium_path()
    if exe is None:
        return [("browser", float("nan"), "skipped: no chromium (apt-get install chromium)")]
    rows = []
    panel = panel_selector()
    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=exe, headless=True, args=CHROMIUM_ARGS,
                                                   viewport={"width": 1400, "height": 1000})
        pg = ctx.new_page()
        pg.set_default_timeout(180_000)
        for label, target in (("sample", sample), ("big run", run)):
            if target is None:
                continue
            with AppServer(target, timeout=180) as srv:
                pg.goto(srv.url, wait_until="load")
                t_load = time.perf_counter()
                pg.wait_for_selector(panel)
                t = time.perf_counter()
                nav = pg.evaluate("() => performance.now()") / 1000  # the page's clock: from navigation
                rows.append((f"browser: page loaded -> first chart ({label})", t - t_load,
                             f"from navigation {nav:.1f} s; rldiag app -> first chart {t - srv.started_at:.1f} s "
                             f"(server up after {srv.ready_after:.1f} s)"))
                if target != run:
                    continue
                times = []
                for metric in names[10:13]:
                    box = pg.get_by_role("combobox", name="Metrics", exact=False)
                    box.click()
                    box.fill(metric)
                    t0 = time.perf_counter()
                    box.press("Enter")
                    pg.wait_for_function(f"(m) => {PANEL_LABELS}.some(l => l.startsWith(m + ': logged steps'))",
                                         arg=metric)
                    times.append(time.perf_counter() - t0)
                    pg.keyboard.press("Escape")
                rows.append(("browser: add a metric -> its panel drawn", statistics.median(times),
                             f"median of {len(times)}"))
                pg.wait_for_function(f"() => /logged steps \\d+-\\d+/.test({PANEL_LABELS}[0] || '')")
                last = int(re.search(r"logged steps \d+-(\d+)", pg.evaluate(f"() => {PANEL_LABELS}")[0]).group(1))
                with (run / "metrics.jsonl").open("a") as fh:
                    t0 = time.perf_counter()
                    fh.write(json.dumps({"step": last + 1, "data": {n: 0.5 for n in names}}) + "\n")
                pg.wait_for_function(f"() => {PANEL_LABELS}.some(l => /logged steps \\d+-{last + 1}(;|$)/.test(l))")
                rows.append(("browser: line appended -> visible", time.perf_counter() - t0,
                             "the page re-reads metrics.jsonl every second"))
                tab = ctx.new_page()
                t0 = time.perf_counter()
                tab.goto(srv.url, wait_until="load")
                tab.wait_for_selector(panel)
                rows.append(("browser: a second tab -> first chart", time.perf_counter() - t0, ""))
                tab.close()
                t0 = time.perf_counter()
                pg.get_by_role("link", name="What-if").click()
                pg.get_by_role("heading", name="What-if").wait_for()
                pg.wait_for_selector(panel)
                rows.append(("browser: first switch to What-if -> chart", time.perf_counter() - t0, ""))
                rows.append(("server memory (RSS, MB) after all of the above", rss_mb(srv.proc.pid),
                             "MB, not seconds"))
        if whatif_run is not None:
            with AppServer(whatif_run, timeout=180) as srv:
                rows += browser_whatif(pg, srv, whatif_run, ("reinforce_plus_plus", "gpg", "opo"))
        ctx.close()
    return rows


#: (title, url path, what "drawn" is: a CSS selector or a regular expression of text, and for
#: Health the text of its findings from the logged metrics alone) of each page on open
PAGE_CONTENT = (
    ("Training metrics", "metrics", {"css": "PANEL"}),
    ("What-if", "whatif", {"css": "PANEL"}),
    ("Step", "step", {"text": r"advantage · baseline", "css": ".js-plotly-plot .main-svg",
                      "also": r"Debugging checklist"}),
    ("Off-policy", "offpolicy", {"text": r"confidence \d\.\d\d", "css": ".js-plotly-plot .main-svg"}),
    ("Health", "health", {"text": r"over \d+ logged and (?<n>\d+) recomputed steps", "full": True,
                          "first": r"over \d+ logged and \d+ recomputed steps"}),
    ("Rollouts", "rollouts", {"css": '[data-testid="stDataFrame"], .js-plotly-plot .main-svg'}),
)


def _fresh_sample(root: Path, name: str) -> Path:
    from rldiag.viz.runs import default_run

    sample = default_run()
    if sample is None:
        raise SystemExit("no bundled sample run")
    dest = root / "pages" / name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(sample, dest, ignore=shutil.ignore_patterns("rldiag"))
    return dest


def _wait_text(pg, pattern: str, timeout_ms: int, want_n: int | None = None) -> None:
    """Until a text node matches ``pattern`` (with group ``n`` equal to ``want_n`` when given)."""
    js = """([p, n]) => { const re = new RegExp(p); const walk = document.createTreeWalker(document.body, 4);
        for (let t = walk.nextNode(); t; t = walk.nextNode()) { const m = re.exec(t.textContent);
          if (m && (n === null || (m.groups && +m.groups.n === n))) return true; } return false; }"""
    pg.wait_for_function(js, arg=[pattern, want_n], timeout=timeout_ms)


def bench_pages(root: Path) -> list[tuple[str, float, str]]:
    """Each page on open, on a fresh copy of the sample served fresh: navigation -> content drawn."""
    from playwright.sync_api import sync_playwright

    from rldiag.app.main import PAGES
    from rldiag.viz.serve import CHROMIUM_ARGS, AppServer, chromium_path

    exe = chromium_path()
    if exe is None:
        return [("pages on open", float("nan"), "skipped: no chromium (apt-get install chromium)")]
    urls = {u for *_, u in PAGES}
    rows = []
    with sync_playwright() as p:
        for title, url, want in PAGE_CONTENT:
            if url not in urls:
                continue
            run = _fresh_sample(root, url)
            steps = len(list((run / "batches").iterdir()))
            with AppServer(run, timeout=180) as srv, tempfile.TemporaryDirectory() as profile:
                ctx = p.chromium.launch_persistent_context(profile, executable_path=exe, headless=True,
                                                           args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
                pg = ctx.new_page()
                pg.set_default_timeout(180_000)
                t0 = time.perf_counter()
                pg.goto(f"{srv.url}/{url}", wait_until="commit")
                note = f"{steps} steps"
                if "first" in want:
                    _wait_text(pg, want["first"], 180_000)
                    note += f"; first findings (logged metrics) after {time.perf_counter() - t0:.2f} s"
                if "text" in want:
                    _wait_text(pg, want["text"], 180_000, steps if want.get("full") else None)
                if "css" in want:
                    pg.wait_for_selector(panel_selector() if want["css"] == "PANEL" else want["css"], state="attached")
                if "also" in want:
                    _wait_text(pg, want["also"], 180_000)
                t = time.perf_counter() - t0
                errors = pg.locator('[data-testid="stException"]').count()
                note += f"; load average {os.getloadavg()[0]:.1f}"
                rows.append((f"page on open: {title} (fresh sample copy)", t,
                             note + (f"; {errors} exception(s) shown!" if errors else "") +
                             ("; within 5 s" if t <= 5 else "; OVER the 5 s target")))
                print(f"{rows[-1][0]}: {t:.2f} s ({rows[-1][2]})", file=sys.stderr)
                ctx.close()
    return rows


def _run_bytes(steps: int, rows: int, length: int) -> int:
    """About the bytes a synthetic run of this shape takes on disk (eight float columns a token)."""
    return int(steps * rows * (0.75 * length) * 8 * 4)


def check_disk(root: Path, need: int) -> None:
    free = shutil.disk_usage(root).free
    if free < need:
        raise SystemExit(f"not enough free disk under {root}: {free / 2**30:.1f} GB free, the benchmark needs about "
                         f"{need / 2**30:.1f} GB (use --dir elsewhere, or fewer --baseline-steps)")


def bench_baseline(root: Path, steps: int, rows: int, length: int, browser: bool) -> list[tuple[str, float, str]]:
    """The app's background baseline of a synthetic run against ``rldiag recompute --no-reuse``."""
    from rldiag.synth import SynthSpec, write_synth_run

    check_disk(root, 3 * _run_bytes(steps, rows, length) + 2**30)
    base = root / "baseline"
    if base.exists():
        shutil.rmtree(base)
    spec = SynthSpec(steps=steps, prompts=max(1, rows // 8), n=8, min_len=max(1, length // 2), max_len=length, seed=5)
    app_run = write_synth_run(base / "app", spec)
    cli_run = base / "cli"
    shutil.copytree(app_run, cli_run)
    size = sum(f.stat().st_size for f in (app_run / "batches").iterdir())
    shape = f"{steps} steps x {rows} rows x up to {length} tokens, {size / 2**20:.0f} MB of batches"
    cmd = [sys.executable, "-m", "rldiag.cli.main", "recompute", str(cli_run), "--no-reuse", "--device", "cpu"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    t_cli = time.perf_counter() - t0
    cli_meta = json.loads((cli_run / "rldiag" / "scenarios" / "baseline" / "scenario.json").read_text())
    rows_out = [("baseline: rldiag recompute --no-reuse (CLI, wall)", t_cli,
                 f"{shape}; its recompute {cli_meta['seconds']:.2f} s; load average {os.getloadavg()[0]:.1f}")]
    if not browser:
        return rows_out
    from playwright.sync_api import sync_playwright

    from rldiag.viz.serve import CHROMIUM_ARGS, AppServer, chromium_path

    exe = chromium_path()
    if exe is None:
        return rows_out + [("baseline: the app", float("nan"), "skipped: no chromium")]
    meta_file = app_run / "rldiag" / "scenarios" / "baseline" / "scenario.json"
    with AppServer(app_run, timeout=180) as srv, sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        pg = ctx.new_page()
        t0 = time.perf_counter()
        pg.goto(srv.url, wait_until="commit")
        deadline = t0 + 3600
        meta = await_baseline(meta_file, steps, deadline)
        t_app = time.perf_counter() - t0
        ctx.close()
    rows_out += [
        ("baseline: the app (page opened -> every step written)", t_app,
         f"the worker's recompute {meta.get('seconds', float('nan')):.2f} s; load average {os.getloadavg()[0]:.1f}"),
        ("baseline: app / CLI (wall)", t_app / t_cli, "ratio, not seconds; target 1.3"),
        ("baseline: app / CLI (the recomputes alone)", meta.get("seconds", float("nan")) / cli_meta["seconds"],
         "ratio, not seconds"),
    ]
    return rows_out


def await_baseline(meta_file: Path, steps: int, deadline: float) -> dict:
    """The baseline's scenario.json once it lists ``steps`` steps done or failed (the worker writes
    it last), or as it is at ``deadline`` (``time.perf_counter()``)."""
    meta: dict = {}
    while time.perf_counter() < deadline:
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            meta = {}
        if len(meta.get("steps_done", [])) + len(meta.get("steps_failed", {})) >= steps:
            break
        time.sleep(0.05)
    return meta


def _step16m(root: Path) -> Path:
    """bench_memory.py's 16 M-token step (8,192 rows, lognormal lengths, 3.5 % at the 32k cap)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_recompute import CAPPED_SHARE, TAILED, make_tailed_run

    steps, rows, cap, at_cap = TAILED["step16m"]
    return make_tailed_run(root / "step16m", steps, rows, cap, capped=CAPPED_SHARE["step16m"], capped_rows=at_cap)


def bench_open(run: Path) -> list[tuple[str, float, str]]:
    """The app opening ``run`` (issue 38 item 5: the 16 M-token step): a server started fresh
    (its baseline computed anew: a copy of the run without its rldiag/ directory), the Step page
    opened headless, from navigation until the baseline's scenario lists every step and the page
    shows the step's groups with the baseline's advantages; the server's resident memory and its
    process tree's (PSS summed: shared pages once) sampled every 0.2 s (the baseline's recompute
    runs in a child process; the Step page's per-token values in the server)."""
    from rldiag.viz.serve import chromium_path

    exe = chromium_path()
    if exe is None:
        return [("open: the 16 M-token step", float("nan"), "skipped: no chromium")]
    steps = len(list((run / "batches").iterdir()))
    tokens = sum(f.stat().st_size for f in (run / "batches").iterdir())
    meta_file = run / "rldiag" / "scenarios" / "baseline" / "scenario.json"
    if (run / "rldiag").exists():
        shutil.rmtree(run / "rldiag")
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_rollouts import watched_page

    with watched_page(run, exe, "step", 180, 1_800_000) as (_, pg, mem, t0):
        meta = await_baseline(meta_file, steps, t0 + 1800)
        t_base = time.perf_counter() - t0
        _wait_text(pg, r"advantage · baseline", 1_800_000)
        pg.wait_for_selector(".js-plotly-plot .main-svg", state="attached")
        t_page = time.perf_counter() - t0
        errors = pg.locator('[data-testid="stException"]').count()
    shape = f"{steps} step(s), {tokens / 2**20:.0f} MB of batches; load average {os.getloadavg()[0]:.1f}"
    failed = meta.get("steps_failed", {})
    return [
        ("open: baseline written (navigation -> scenario.json)", t_base,
         f"{shape}; its recompute {meta.get('seconds', float('nan')):.1f} s" + (f"; FAILED {failed}" if failed else "")),
        ("open: Step page drawn with the baseline", t_page, f"{errors} exception(s) shown" if errors else "no exception"),
        ("open: peak RSS, the server alone (MB)", mem.peak_root_rss / 2**20, "MB, not seconds"),
        ("open: peak PSS, the server's process tree (MB)", mem.peak_pss / 2**20,
         f"MB, not seconds (RSS summed {mem.peak_rss / 2**20:.0f}); at the peak: {mem.breakdown()}"),
    ]


PARTS = ("store", "whatif", "browser", "pages", "baseline", "open")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--metrics", type=int, default=150)
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--whatif", default="100x256x512", help="what-if run STEPSxROWSxTOKENS ('' to skip)")
    ap.add_argument("--dir", type=Path, help="where to write the run (default: a temporary directory)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"the parts to run, of {','.join(PARTS)}")
    ap.add_argument("--baseline", default="", help="the app's baseline run STEPSxROWSxTOKENS (default: "
                    "--baseline-steps x 256 x 512)")
    ap.add_argument("--baseline-steps", type=int, default=100, help="steps of the app's baseline run")
    ap.add_argument("--open-run", type=Path, help="the run the 'open' part opens (its rldiag/ directory is "
                    "removed first; default: bench_memory.py's step16m workload, made under --dir)")
    args = ap.parse_args()
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        ap.error(f"--only: unknown part(s) {', '.join(sorted(unknown))}; of {', '.join(PARTS)}")
    if args.no_browser:
        parts -= {"browser", "pages"}
    shape = [int(v) for v in (args.baseline or f"{args.baseline_steps}x256x512").lower().split("x")]

    from rldiag.viz.runs import default_run

    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        # the app's own directory (mirrors, recent runs) in the benchmark's, never the user's
        os.environ["RLDIAG_HOME"] = str(root / "rldiag-home")
        rows = []
        if parts & {"store", "browser"}:
            t, (run, names) = timed(lambda: make_run(root / "bigrun", args.steps, args.metrics))
            print(f"generated {run} ({args.steps} steps x {args.metrics} metrics) in {t:.1f} s", file=sys.stderr)
        if "store" in parts:
            rows += bench_store(run, names)
        if args.whatif and parts & {"whatif", "browser"}:
            rows += bench_whatif(root, *(int(v) for v in args.whatif.lower().split("x")))
        if "browser" in parts:
            rows += bench_browser(run, names, default_run(), root / "whatif" if args.whatif else None)
        if "pages" in parts:
            rows += bench_pages(root)
        if "baseline" in parts:
            rows += bench_baseline(root, *shape, browser=not args.no_browser)
        if "open" in parts and not args.no_browser:
            rows += bench_open(args.open_run or _step16m(root))
    print_table(f"rldiag app: {args.steps:,} steps x {args.metrics} metrics", rows)


def print_table(title: str, rows: list[tuple[str, float, str]]) -> None:
    """The benchmark's table: one line per measure, its seconds (or the ratio its notes name)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("measure")
    table.add_column("seconds", justify="right")
    table.add_column("notes")
    for name, secs, note in rows:
        table.add_row(name, f"{secs:.3f}", note)
    Console().print(table)


if __name__ == "__main__":
    main()
