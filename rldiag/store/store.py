"""The store: every query the app makes about one run, over one DuckDB connection of its own.

Sources: the logged ``metrics.jsonl`` (followed live, :mod:`rldiag.store.logged`), the
scenarios' Parquet outputs (:mod:`rldiag.store.scenarios`) and the batch files
(:mod:`rldiag.store.batches`). Results are cached on the size and modification time of the
files they read (:mod:`rldiag.store.cache`); results are polars frames or plain values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from rldiag.io.fs import as_path
from rldiag.io.rundir import RunDir
from rldiag.store import offpolicy, stepview, tokentext
from rldiag.store.batches import Batches
from rldiag.store.cache import FileSig, SigCache, file_sig, local_path
from rldiag.store.comparisons import SavedComparison, saved_comparison
from rldiag.store.db import Db, quote_ident
from rldiag.store.downsample import DEFAULT_POINTS, m4_sql
from rldiag.store.logged import LoggedMetrics
from rldiag.store.sandbox import served_dirs
from rldiag.store.scenarios import Scenarios

LOGGED = "logged"
#: logged metrics that hold a step's wall-clock time in seconds since the epoch (W&B's, then others)
WALL_TIME_METRICS = ("_timestamp", "timestamp", "wall_time", "time/timestamp")


@dataclass(frozen=True)
class LiveStatus:
    """Where the logged metrics stand: the latest step and when the file last changed."""

    latest_step: int | None
    steps: int
    lines: int
    size: int
    mtime: float | None  # seconds since the epoch, of metrics.jsonl's last write


class Store:
    """All queries about one run directory, on a connection of its own that reads only the run's
    directories (:mod:`rldiag.store.sandbox`; ``db``: one opened with those directories)."""

    def __init__(self, run: str | Path, db: Db | None = None):
        self.run = local_path(as_path(run))  # a URI is refused before any request to its store
        self.rd = RunDir(self.run)
        self.db = db or Db(served_dirs(self.run))
        self.cache = SigCache()
        self.logged = LoggedMetrics(self.db, local_path(self.rd.metrics_file))
        self.scenarios = Scenarios(self.db, self.run, self.cache)
        self.batches = Batches(self.db, self.run, self.cache)

    # -- logged metrics -----------------------------------------------------------------------

    def refresh(self) -> FileSig | None:
        """Follow ``metrics.jsonl``: read what was appended since the last call."""
        return self.logged.refresh()

    def status(self) -> LiveStatus:
        sig = self.refresh()
        latest, steps = self.cache.get(("latest",), sig, self.logged.latest)
        return LiveStatus(latest, steps, self.logged.lines, sig.size if sig else 0, sig.mtime if sig else None)

    def logged_names(self) -> list[str]:
        sig = self.refresh()
        frame = self.cache.get(("logged-names",), sig, self.logged.names)
        return frame["metric"].to_list()

    def logged_long(self, metrics: list[str], lo: int | None = None, hi: int | None = None) -> pl.DataFrame:
        sig = self.refresh()
        key = ("logged-long", tuple(metrics), lo, hi)
        return self.cache.get(key, sig, lambda: self.logged.long(list(metrics), lo, hi))

    def logged_wide(self, metrics: list[str], lo: int | None = None, hi: int | None = None) -> pl.DataFrame:
        sig = self.refresh()
        key = ("logged-wide", tuple(metrics), lo, hi)
        return self.cache.get(key, sig, lambda: self.logged.wide(list(metrics), lo, hi))

    # -- scenarios ----------------------------------------------------------------------------

    def scenario_names(self) -> list[str]:
        return self.scenarios.names()

    def scenario_meta(self, name: str) -> dict:
        return self.scenarios.meta(name)

    def scenario_metric_names(self, name: str) -> list[str]:
        return self.scenarios.metric_names(name)

    def metric_names(self, scenarios: Sequence[str] = ()) -> list[str]:
        """Logged metric names and those of ``scenarios``, sorted, each once."""
        names = set(self.logged_names())
        for s in scenarios:
            names.update(self.scenario_metric_names(s))
        return sorted(names)

    def step_bounds(self, scenarios: Sequence[str] = ()) -> tuple[int, int] | None:
        """Smallest and largest step with a logged or recomputed value (None: no values)."""
        sig = self.refresh()
        sigs = (sig,) + tuple(self.scenarios.sig(s) for s in scenarios)

        def compute():
            parts = [f"SELECT min(step) AS lo, max(step) AS hi FROM {self.logged.table}"]
            for s in scenarios:
                t = self.scenarios.table(s)
                if t:
                    parts.append(f"SELECT min(step), max(step) FROM {t}")
            with self.logged.lock:
                lo, hi = self.db.rows(f"SELECT min(lo), max(hi) FROM ({' UNION ALL '.join(parts)})")[0]
            return None if lo is None else (int(lo), int(hi))

        return self.cache.get(("bounds", tuple(scenarios)), sigs, compute)

    def joined(self, metrics: list[str], scenarios: Sequence[str] = (), lo: int | None = None,
               hi: int | None = None, points: int | None = None) -> pl.DataFrame:
        """Logged and recomputed values joined by step and metric name:
        ``step, metric, logged, <scenario>...`` (null where a source has no value).

        With ``points``, each metric is downsampled in DuckDB to the rows that draw the same
        line at ``points`` buckets across its steps (:mod:`.downsample`); a range of about
        ``points`` steps or fewer comes back whole."""
        sig = self.refresh()
        scenarios = [s for s in scenarios if self.scenarios.table(s)]
        sigs = (sig,) + tuple(self.scenarios.sig(s) for s in scenarios)
        key = ("joined", tuple(metrics), tuple(scenarios), lo, hi, points)
        return self.cache.get(key, sigs, lambda: self._joined(list(metrics), scenarios, lo, hi, points))

    def downsample(self, frame: pl.DataFrame, columns: list[str], points: int = DEFAULT_POINTS) -> pl.DataFrame:
        """``frame`` (``step, metric, <columns>``, e.g. after EMA smoothing) downsampled like
        :meth:`joined` with ``points``."""
        if frame.is_empty():
            return frame
        cols = [c for c in columns if c in frame.columns]
        return self.db.frame(m4_sql("SELECT * FROM frame", cols, points), arrow={"frame": frame.to_arrow()},
                             where=str(self.run))

    def clip_bounds(self, metrics: list[str], scenarios: Sequence[str] = (), lo: int | None = None,
                    hi: int | None = None, q: float = 0.01) -> dict[str, tuple[float, float]]:
        """Per metric, the ``q`` and ``1 - q`` quantiles of every source's finite values over
        the steps (at full resolution): the y range that leaves out the outliers."""
        joined = self.joined(metrics, scenarios, lo, hi)
        cols = [c for c in self.source_columns(list(scenarios)).values() if c in joined.columns]
        if joined.is_empty() or not cols:
            return {}
        union = " UNION ALL ".join(f"SELECT metric, {quote_ident(c)} AS v FROM joined" for c in cols)
        rows = self.db.rows(
            f"SELECT metric, quantile_cont(v, {float(q)}), quantile_cont(v, {1 - float(q)}) FROM ({union}) "
            f"WHERE v IS NOT NULL AND isfinite(v) GROUP BY metric", arrow={"joined": joined.to_arrow()},
            where=str(self.run))
        return {m: (float(a), float(b)) for m, a, b in rows if a is not None}

    def wall_time_metric(self) -> str | None:
        """The logged metric that holds each step's wall-clock time (seconds since the epoch), if any."""
        names = set(self.logged_names())
        return next((m for m in WALL_TIME_METRICS if m in names), None)

    def with_wall_time(self, frame: pl.DataFrame) -> pl.DataFrame:
        """``frame`` (with a ``step`` column) and a ``wall_time`` column (a datetime; null where
        the step logged no time)."""
        metric = self.wall_time_metric()
        if metric is None or frame.is_empty():
            return frame.with_columns(pl.lit(None, pl.Datetime("us")).alias("wall_time"))
        times = self.logged_long([metric]).select("step", (pl.col("value") * 1e6).cast(pl.Int64)
                                                  .cast(pl.Datetime("us")).alias("wall_time"))
        return frame.join(times, on="step", how="left").sort("metric", "step")

    def source_columns(self, scenarios: list[str]) -> dict[str, str]:
        """Source name -> column of :meth:`joined` (a scenario named ``logged`` gets a suffix)."""
        cols = {LOGGED: LOGGED}
        for s in sorted(scenarios, key=lambda s: s != "baseline"):  # baseline first: the same colour everywhere
            cols[s] = s if s != LOGGED else f"{s} (scenario)"
        return cols

    def _joined(self, metrics: list[str], scenarios: list[str], lo, hi, points: int | None = None) -> pl.DataFrame:
        flt = "list_contains($metrics::VARCHAR[], metric) AND step >= $lo AND step <= $hi"
        ctes = [f"l AS (SELECT step, metric, value FROM {self.logged.table} WHERE {flt})"]
        cols = self.source_columns(scenarios)
        select = ["step", "metric", f"l.value AS {LOGGED}"]
        joins = []
        for i, s in enumerate(scenarios):
            ctes.append(f"s{i} AS (SELECT step, metric, value FROM {self.scenarios.table(s)} WHERE {flt})")
            select.append(f"s{i}.value AS {quote_ident(cols[s])}")
            joins.append(f"FULL JOIN s{i} USING (step, metric)")
        sql = f"WITH {', '.join(ctes)} SELECT {', '.join(select)} FROM l {' '.join(joins)}"
        sql = m4_sql(sql, list(cols.values()), points) if points else sql + " ORDER BY metric, step"
        params = {"metrics": metrics, "lo": -(2**62) if lo is None else lo, "hi": 2**62 if hi is None else hi}
        with self.logged.lock:
            return self.db.frame(sql, params, where=str(self.run))

    def summary(self, metrics: list[str], scenarios: list[str], lo: int | None = None,
                hi: int | None = None) -> pl.DataFrame:
        """Per metric, the mean over steps of each source (``logged`` and each scenario) and,
        with two scenarios or more, the difference of each later scenario's mean from the first's."""
        joined = self.joined(metrics, scenarios, lo, hi)
        present = [c for c in self.source_columns(list(scenarios)).values() if c in joined.columns]
        means = [f"avg({quote_ident(c)}) AS {quote_ident(c)}" for c in present]
        counts = [f"count({quote_ident(c)}) AS {quote_ident('steps ' + c)}" for c in present]
        scen = [c for c in present if c != LOGGED]
        deltas = [
            f"avg({quote_ident(c)}) - avg({quote_ident(scen[0])}) AS {quote_ident(f'{c} - {scen[0]}')}" for c in scen[1:]
        ]
        sql = f"SELECT metric, {', '.join(means + deltas + counts)} FROM joined GROUP BY metric ORDER BY metric"
        return self.db.frame(sql, arrow={"joined": joined.to_arrow()}, where=str(self.run))

    # -- one step -----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a batch file."""
        return self.batches.steps()

    def inputs_sig(self) -> tuple[tuple[str, int, int], ...]:
        """``(name, size, mtime_ns)`` of every batch file and of the config files present: what a
        result computed from the batches and the run's settings is keyed on (it changes when the
        run writes a step or its config changes)."""
        paths = [local_path(sf.path) for sf in self.batches.files()] + [local_path(p) for p in self.rd.layout.config_files]
        return tuple((str(p.relative_to(self.run)), sig.size, sig.mtime_ns) for p in paths
                     if (sig := file_sig(p)) is not None)

    def token_steps(self, scenario: str) -> list[int]:
        return self.scenarios.token_steps(scenario)

    def _tokens(self, scenario: str | None, step: int) -> tuple[Path, list[str]] | None:
        if scenario is None:
            return None
        path = self.scenarios.tokens_file(scenario, step)
        if path is None:
            return None
        return path, self.scenarios.token_columns(scenario, step)

    def scenarios_with_tokens(self, step: int, column: str | None = None) -> list[str]:
        """Scenarios that saved tokens for ``step`` (having ``column``, when given), or whose
        token cache holds them (a scenario not written yet included)."""
        out = []
        names = self.scenario_names()
        for s in names + [c for c in self.scenarios.cached_names() if c not in names]:
            t = self._tokens(s, step)
            if t is not None and (column is None or column in t[1]):
                out.append(s)
        return out

    def scenarios_with_token_column(self, column: str) -> list[str]:
        """Scenarios whose saved tokens have ``column`` (judged on their first tokens file)."""
        out = []
        for s in self.scenario_names():
            steps = self.token_steps(s)
            if steps and column in self.scenarios.token_columns(s, steps[0]):
                out.append(s)
        return out

    def step_rows(self, step: int, scenarios: Sequence[str] = ()) -> pl.DataFrame:
        """The step's rows from the batch, with each scenario's mean advantage and reward per row
        (from its per-row table, else from its tokens)."""
        src = self.batches.source(step)
        rows = {s: p for s in scenarios if (p := self.scenarios.rows_file(s, step)) is not None}
        tokens = {s: t for s in scenarios if s not in rows and (t := self._tokens(s, step)) is not None}
        sigs = (file_sig(src.path),) + tuple(file_sig(p) for p in rows.values()) + tuple(
            file_sig(p) for p, _ in tokens.values())
        return self.cache.get(("step-rows", step, tuple(rows), tuple(tokens)), sigs,
                              lambda: stepview.step_rows(self.db, src, tokens, rows))

    def step_facts(self, step: int, scenario: str | None = None) -> stepview.StepFacts:
        """The numbers the step checklist judges: the batch's, and ``scenario``'s (its per-row
        table and its tokens for the step, when it has them)."""
        src = self.batches.source(step)
        tokens = self._tokens(scenario, step)
        rows = self.scenarios.rows_file(scenario, step) if scenario is not None else None
        sigs = (file_sig(src.path), file_sig(tokens[0]) if tokens else None, file_sig(rows) if rows else None)
        return self.cache.get(("step-facts", step, scenario), sigs,
                              lambda: stepview.step_facts(self.db, src, scenario, tokens, rows))

    def row_tokens(self, step: int, row: int, scenario: str | None = None) -> dict[str, Any]:
        src = self.batches.source(step)
        tokens = self._tokens(scenario, step)
        sigs = (file_sig(src.path), file_sig(tokens[0]) if tokens else None)
        return self.cache.get(("row-tokens", step, row, scenario), sigs,
                              lambda: stepview.row_tokens(self.db, src, row, tokens))

    def row_text(self, step: int, row: int) -> list[str] | None:
        """One row's response tokens as text (the batch's ``response_tokens``; None without it)."""
        src = self.batches.source(step)
        return self.cache.get(("row-text", step, row), file_sig(src.path), lambda: tokentext.row_text(self.db, src, row))

    def row_prompt(self, step: int, row: int) -> list[str] | None:
        """One row's prompt tokens as text (the batch's ``prompt_tokens``; None without it)."""
        src = self.batches.source(step)
        return self.cache.get(("row-prompt", step, row), file_sig(src.path),
                              lambda: tokentext.row_text(self.db, src, row, tokentext.PROMPT_COLUMN))

    def scenarios_with_rows(self) -> list[str]:
        """Scenarios that wrote per-row tables (``rows/step_<N>.parquet``), ``baseline`` first."""
        have = [s for s in self.scenario_names() if self.scenarios.layout(s).row_steps()]
        return sorted(have, key=lambda s: s != "baseline")

    def top_tokens(self, step: int, scenario: str | None, kind: str, k: int = 10) -> pl.DataFrame | None:
        """The step's top-``k`` tokens by ``kind`` (|log ratio|, ref KL, IS weight) with their
        context (:func:`rldiag.store.tokentext.top_tokens`); None without the scenario's tokens."""
        src = self.batches.source(step)
        tokens = self._tokens(scenario, step)
        if tokens is None:
            return None
        sigs = (file_sig(src.path), file_sig(tokens[0]))
        return self.cache.get(("top-tokens", step, scenario, kind, k), sigs,
                              lambda: tokentext.top_tokens(self.db, src, tokens, kind, k))

    def metrics_at(self, step: int, metrics: list[str], scenarios: Sequence[str] = ()) -> pl.DataFrame:
        """``metric, logged, <scenario>...`` at one step."""
        return self.joined(metrics, scenarios, step, step).drop("step")

    # -- off-policy ---------------------------------------------------------------------------

    def is_weights(self, scenario: str, step: int) -> pl.DataFrame:
        tokens = self._tokens(scenario, step)
        if tokens is None or "rollout_is_weights" not in tokens[1]:
            return pl.DataFrame(schema={"row": pl.Int64, "weight": pl.Float32})
        return self.cache.get(("is-weights", scenario, step), file_sig(tokens[0]),
                              lambda: offpolicy.is_weights(self.db, tokens[0]))

    def is_quantiles(self, scenario: str) -> pl.DataFrame:
        steps = self.token_steps(scenario)
        if not steps or "rollout_is_weights" not in self.scenarios.token_columns(scenario, steps[0]):
            return pl.DataFrame(schema={"step": pl.Int64})
        sc = self.scenarios.layout(scenario)
        d = sc.tokens_dir
        sigs = (file_sig(sc.meta), tuple(steps))
        return self.cache.get(("is-quantiles", scenario), sigs, lambda: offpolicy.is_quantiles(self.db, d))

    # -- comparisons --------------------------------------------------------------------------

    def comparison(self, a: str, b: str) -> SavedComparison | None:
        """The comparison ``rldiag compare RUN A B`` saved, if any (``stale`` when a side changed)."""
        return saved_comparison(self.db, self.cache, self.run, a, b)
