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

Usage:
  .venv/bin/python bench/bench_app.py                      # 10,000 steps x 150 metrics
  .venv/bin/python bench/bench_app.py --steps 2000 --metrics 50 --no-browser
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
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
    from rldiag.recompute import recompute
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--metrics", type=int, default=150)
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--whatif", default="100x256x512", help="what-if run STEPSxROWSxTOKENS ('' to skip)")
    ap.add_argument("--dir", type=Path, help="where to write the run (default: a temporary directory)")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from rldiag.viz.runs import default_run

    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        t, (run, names) = timed(lambda: make_run(root / "bigrun", args.steps, args.metrics))
        print(f"generated {run} ({args.steps} steps x {args.metrics} metrics) in {t:.1f} s", file=sys.stderr)
        rows = bench_store(run, names)
        if args.whatif:
            rows += bench_whatif(root, *(int(v) for v in args.whatif.lower().split("x")))
        if not args.no_browser:
            rows += bench_browser(run, names, default_run(), root / "whatif" if args.whatif else None)
    table = Table(title=f"rldiag app: {args.steps:,} steps x {args.metrics} metrics")
    table.add_column("measure")
    table.add_column("seconds", justify="right")
    table.add_column("notes")
    for name, secs, note in rows:
        table.add_row(name, f"{secs:.3f}", note)
    Console().print(table)


if __name__ == "__main__":
    main()
