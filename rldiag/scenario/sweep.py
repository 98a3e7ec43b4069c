"""``rldiag sweep RUN``: many what-ifs of one run, from one read of each of its step files.

The grid's Cartesian product (plus the fixed overrides) gives the scenarios. Each is planned as
``rldiag recompute`` plans it (:mod:`rldiag.scenario.plan`: the steps, what its previous write
lets it reuse), the executor (:class:`rldiag.executors.sweep.SweepExecutor`) reads, validates and
hashes each step file once and computes every scenario from it, running each engine stage once
for the scenarios that agree on it (:mod:`rldiag.engine.sweep`), and each scenario is written
as a recompute writes it (:class:`rldiag.scenario.write.ScenarioWriter`:
``RUN/rldiag/scenarios/<name>/``, atomically). Then the sweep's own
record: ``RUN/rldiag/sweeps/<name>/summary.parquet`` (every scenario's metrics, long format)
and ``sweep.json``, written last.

``--executor ray`` recomputes each scenario on its own on the cluster (a recompute per
scenario: each reads the step files), and writes the same outputs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from rldiag.config.settings import Settings, resolve_settings, scenario_slug, unchanged_overrides, unchanged_warning
from rldiag.errors import ConfigError, DiskSpaceError
from rldiag.io.fs import RemotePath, is_remote
from rldiag.io.outputs import TOKEN_OUTPUTS, json_safe, metrics_table
from rldiag.io.run_layout import SweepLayout
from rldiag.io.rundir import RunDir, Steps, parse_steps
from rldiag.io.staged import open_staged
from rldiag.scenario.plan import Previous, check_name, check_settings, known_inputs, plan_steps, previous
from rldiag.scenario.sampling import SampledRun
from rldiag.scenario.write import ScenarioReport, ScenarioWriter
from rldiag.version import __version__

if TYPE_CHECKING:
    import polars as pl

    from rldiag.executors.sweep import SweepHooks

__all__ = [
    "DEFAULT_METRICS", "MAX_SCENARIOS", "SweepReport", "estimate_token_bytes", "sweep", "sweep_name", "yaml_text",
]

ProgressFn = Callable[[int, int, int], None]
DiskUsage = Callable[[str], Any]  # shutil.disk_usage's shape: .free in bytes

#: the metrics ``rldiag sweep`` prints by default (those the run has): mean over the steps
DEFAULT_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "critic/advantages/mean",
                   "rollout_corr/rollout_is_eff_sample_size")
#: more scenarios than this is a mistake on the command line rather than a sweep
MAX_SCENARIOS = 1024
#: bytes per token value of a token table (float32; the mask's int8 counted as 4: an upper bound)
TOKEN_VALUE_BYTES = 4


def yaml_text(value: Any) -> str:
    """A value as YAML text, the way ``--grid`` / ``--set`` read it back: ``0.1``, ``null``,
    ``true``, ``grpo`` (the document end marker dropped)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text[:-4].rstrip() if text.endswith("\n...") else text


def sweep_name(grid: Mapping[str, Sequence[Any]]) -> str:
    """The default name of a sweep: ``sweep-`` and the first 8 hex digits of the SHA-256 of the
    sorted grid, ``json.dumps(sorted([key, [values...]] for each swept key))`` (Python's json
    defaults; the values as parsed, in the order given; ``--estimators`` is the key
    ``algorithm.adv_estimator``). The fixed overrides (``--set``) are not part of it."""
    text = json.dumps(sorted([key, list(values)] for key, values in grid.items()), default=str)
    return "sweep-" + hashlib.sha256(text.encode()).hexdigest()[:8]


def _grid(grid: Mapping[str, Sequence[Any]] | None, estimators: Sequence[str] | None,
          fixed: Mapping[str, Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for key, values in (grid or {}).items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise ConfigError(f"--grid {key}: expected a list of values, not {values!r}")
        vals = list(values)
        if not vals:
            raise ConfigError(f"--grid {key}: no values")
        texts = [yaml_text(v) for v in vals]
        if len(set(texts)) != len(texts):
            raise ConfigError(f"--grid {key}: a value is given twice ({', '.join(texts)})")
        out[str(key)] = vals
    if estimators:
        names = [e.strip() for e in estimators if e.strip()]
        if "algorithm.adv_estimator" in out:
            raise ConfigError("--estimators is short for --grid algorithm.adv_estimator=...: give one of them")
        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"--estimators {','.join(names)}: each estimator once")
        out["algorithm.adv_estimator"] = names
    if not out:
        raise ConfigError("nothing to sweep: give --grid KEY=V1,V2,... or --estimators A,B,...")
    both = sorted(set(out) & set(fixed))
    if both:
        raise ConfigError(f"{', '.join(both)}: swept (--grid) and fixed (--set) at once")
    return out


def estimate_token_bytes(token_counts: Sequence[int], scenarios: int) -> int:
    """The size of the token tables a sweep with ``--save-tokens`` writes, at most: the steps'
    tokens x every token column (:data:`~rldiag.io.outputs.TOKEN_OUTPUTS`) x 4 bytes x the
    scenarios (Parquet's compression and the columns a setting leaves out make it less)."""
    return sum(token_counts) * len(TOKEN_OUTPUTS) * TOKEN_VALUE_BYTES * scenarios


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _check_disk(rd: RunDir, files: list, scenarios: int, disk_usage: DiskUsage) -> int:
    from rldiag.io.loader import token_count

    need = estimate_token_bytes([token_count(sf) for sf in files], scenarios)
    where: Path = Path(str(rd.layout.output_dir))
    while not where.exists() and where.parent != where:
        where = where.parent
    free = int(disk_usage(str(where)).free)
    if need > free:
        raise DiskSpaceError(
            f"--save-tokens: {scenarios} scenarios x {len(files)} steps would write about {_gib(need)} of token "
            f"tables ({len(TOKEN_OUTPUTS)} columns x 4 bytes a token), more than the {_gib(free)} free on {where}; "
            "sweep fewer steps (--steps) or scenarios, or leave out --save-tokens")
    return need


@dataclass
class SweepReport:
    """One ``rldiag sweep``: its scenarios (name -> overrides, written under
    ``RUN/rldiag/scenarios/``), the long summary of their metrics, and each one's steps."""

    name: str
    path: Path | RemotePath  # RUN/rldiag/sweeps/<name>/
    run: str
    grid: dict[str, list[Any]]
    overrides: dict[str, Any]  # fixed, every scenario
    scenarios: dict[str, dict[str, Any]]  # name -> its overrides (grid values + fixed)
    summary: pl.DataFrame
    steps_done: dict[str, list[int]] = field(default_factory=dict)
    steps_failed: dict[str, dict[int, str]] = field(default_factory=dict)
    steps_reused: dict[str, list[int]] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    seconds: float = 0.0
    device: str = "cpu"
    executor: str = "local"
    notes: list[str] = field(default_factory=list)
    #: the scenario whose resolved settings are the run's own (None: the grid has none); marked
    #: in the tables and figures, their colour scales centred on its value
    own: str | None = None

    @property
    def ok(self) -> bool:
        """Every step of every scenario was written."""
        return not any(self.steps_failed.values())

    @property
    def keys(self) -> list[str]:
        """The swept keys, in the order of the grid."""
        return list(self.grid)

    def summary_frame(self) -> pl.DataFrame:
        """``summary.parquet``: one row per scenario, step and metric (``scenario``, ``step``,
        ``metric``, ``value``) and one column per swept key (its value as YAML text)."""
        return self.summary

    def table_frame(self, metrics: Sequence[str] | None = None) -> pl.DataFrame:
        """One row per scenario, in the grid's order: the swept keys' values (YAML text) and
        the mean over the steps of each of ``metrics`` (default :data:`DEFAULT_METRICS`: those
        the sweep has), NaN steps left out."""
        import polars as pl

        have = set(self.summary["metric"].unique().to_list()) if self.summary.height else set()
        names = [m for m in (metrics if metrics is not None else DEFAULT_METRICS) if metrics is not None or m in have]
        means = (self.summary.filter(pl.col("metric").is_in(names))
                 .with_columns(pl.col("value").fill_nan(None))
                 .group_by("scenario", "metric").agg(pl.col("value").mean()))
        by = {(r["scenario"], r["metric"]): r["value"] for r in means.iter_rows(named=True)}
        rows = []
        for name, overrides in self.scenarios.items():
            row: dict[str, Any] = {"scenario": name}
            row.update({k: yaml_text(overrides[k]) for k in self.grid})
            row.update({m: by.get((name, m)) for m in names})
            rows.append(row)
        schema = {"scenario": pl.String, **{k: pl.String for k in self.grid}, **{m: pl.Float64 for m in names}}
        return pl.DataFrame(rows, schema=schema, orient="row") if rows else pl.DataFrame(schema=schema)

    def to_dict(self, metrics: Sequence[str] | None = None) -> dict:
        """``rldiag sweep --json``: the sweep, each scenario's overrides, steps and the mean of
        ``metrics`` over its steps."""
        table = {r["scenario"]: r for r in self.table_frame(metrics).iter_rows(named=True)}
        keys = set(self.grid) | {"scenario"}
        return json_safe({
            "name": self.name, "path": str(self.path), "run": self.run, "grid": self.grid, "overrides": self.overrides,
            "steps": self.steps, "seconds": round(self.seconds, 3), "device": self.device, "executor": self.executor,
            "notes": self.notes, "ok": self.ok,
            "scenarios": {
                name: {
                    "overrides": ov,
                    "steps_done": self.steps_done.get(name, []),
                    "steps_reused": self.steps_reused.get(name, []),
                    "steps_failed": {str(k): v for k, v in sorted(self.steps_failed.get(name, {}).items())},
                    "metrics": {k: v for k, v in table.get(name, {}).items() if k not in keys},
                } for name, ov in self.scenarios.items()
            },
        })


@dataclass
class _Scenario:
    name: str
    overrides: dict[str, Any]
    settings: Settings
    report: ScenarioReport | None = None
    table: pa.Table | None = None  # metrics.parquet, once written


def _scenarios(rd: RunDir, grid: dict[str, list[Any]], fixed: dict[str, Any]) -> list[_Scenario]:
    combos = list(itertools.product(*grid.values()))
    if len(combos) > MAX_SCENARIOS:
        raise ConfigError(f"the grid makes {len(combos)} scenarios; at most {MAX_SCENARIOS}")
    out: list[_Scenario] = []
    for combo in combos:
        overrides = {**fixed, **dict(zip(grid, combo))}
        name = scenario_slug(overrides)
        try:
            settings = resolve_settings(rd.path, overrides)
            check_settings(settings)
        except ConfigError as exc:
            if type(exc) is not ConfigError:
                raise
            raise ConfigError(f"scenario {name}: {exc}") from None
        out.append(_Scenario(name, overrides, settings))
    # a slug is cut at 120 characters: names that would collide get their overrides' hash
    seen: dict[str, int] = {}
    for sc in out:
        seen[sc.name] = seen.get(sc.name, 0) + 1
    for sc in out:
        if seen[sc.name] > 1:
            digest = hashlib.sha256(json.dumps(sorted((k, yaml_text(v)) for k, v in sc.overrides.items())).encode())
            sc.name = f"{sc.name[:111]}-{digest.hexdigest()[:8]}"
    return out


def _summary(scenarios: list[_Scenario], grid: dict[str, list[Any]]) -> pa.Table:
    """The long table: ``scenario``, ``step``, ``metric``, ``value``, one string column per key."""
    import polars as pl

    frames = []
    for sc in scenarios:
        assert sc.report is not None
        table = sc.table if sc.table is not None else metrics_table(sc.report.metrics)
        if table.num_columns <= 1 or table.num_rows == 0:
            continue
        wide = pl.from_arrow(table)
        assert isinstance(wide, pl.DataFrame)
        long = (wide.unpivot(index="step", variable_name="metric", value_name="value")
                .filter(pl.col("value").is_not_null())
                .with_columns(pl.lit(sc.name).alias("scenario"), pl.col("value").cast(pl.Float64),
                              pl.col("step").cast(pl.Int64),
                              *[pl.lit(yaml_text(sc.overrides[k])).alias(k) for k in grid])
                .sort("step", "metric"))
        frames.append(long.select("scenario", "step", "metric", "value", *grid))
    schema = pa.schema([("scenario", pa.string()), ("step", pa.int64()), ("metric", pa.string()),
                        ("value", pa.float64()), *[(k, pa.string()) for k in grid]])
    if not frames:
        return schema.empty_table()
    return pl.concat(frames).to_arrow().cast(schema)


def sweep(
    run: str | Path | RemotePath,
    grid: Mapping[str, Sequence[Any]] | None,
    overrides: Mapping[str, Any] | None = None,
    *,
    estimators: Sequence[str] | None = None,
    name: str | None = None,
    steps: Steps = None,
    save_tokens: bool = False,
    reuse: bool = True,
    device: str = "auto",
    executor: Any = "local",
    progress: ProgressFn | None = None,
    pack_tokens: int | None = None,
    chunk_steps: int | None = None,
    disk_usage: DiskUsage = shutil.disk_usage,
    hooks: SweepHooks | None = None,
) -> SweepReport:
    """Recompute ``run`` under every combination of ``grid`` (key -> values; ``estimators`` is
    short for the key ``algorithm.adv_estimator``) plus the fixed ``overrides``; write each
    scenario as :func:`rldiag.scenario.recompute.recompute` writes it (named by the slug of its
    overrides), then the sweep's summary and record under ``RUN/rldiag/sweeps/<name>/`` (default
    name: :func:`sweep_name`). ``executor``: ``"local"`` (one read of each step file, shared
    stages), ``"ray"`` or a Ray executor (each scenario recomputed on its own there).
    ``disk_usage``: what tells the free space (``shutil.disk_usage``'s shape), checked with
    ``save_tokens``. ``hooks``: seams of the local executor (:class:`~rldiag.executors.sweep.SweepHooks`).
    ``progress(done, total, step)`` counts scenario-steps. Raises :class:`RldiagError` for what
    stops the whole sweep; a failed step of a scenario is in ``steps_failed[scenario]``."""
    from rldiag.executors.steps import DEFAULT_CHUNK_STEPS, DEFAULT_PACK_TOKENS

    t0 = time.perf_counter()
    pack_tokens = pack_tokens or DEFAULT_PACK_TOKENS
    chunk_steps = chunk_steps or DEFAULT_CHUNK_STEPS
    rd = RunDir(run)
    fixed = dict(overrides or {})
    g = _grid(grid, estimators, fixed)
    name = name or sweep_name(g)
    check_name(name, "sweep")
    if rd.layout.sweep(name).dir == rd.layout.layout_audit.dir:
        raise ConfigError(f"--name {name!r}: that directory is rldiag layout-audit's; choose another name")
    if chunk_steps < 1:
        raise ConfigError(f"chunk_steps must be >= 1, not {chunk_steps}")
    scenarios = _scenarios(rd, g, fixed)
    files = {sf.step: sf for sf in rd.require_steps()}
    chosen = parse_steps(steps, sorted(files))
    if save_tokens and not is_remote(rd.path):
        _check_disk(rd, [files[s] for s in chosen], len(scenarios), disk_usage)
    notes = own_value_notes(rd, g, fixed)
    if executor == "local" or executor is None:
        dev, ex_name = _run_local(rd, scenarios, files, chosen, save_tokens, reuse, device, progress, pack_tokens,
                                  chunk_steps, hooks, name)
    else:
        dev, ex_name = _run_each(rd, scenarios, chosen, save_tokens, reuse, device, executor, progress, pack_tokens,
                                 chunk_steps)
        notes.append(f"executor {ex_name}: each scenario recomputed on its own (its step files read once per "
                     "scenario, no stage shared)")
    return _write_sweep(rd, name, g, fixed, scenarios, chosen, save_tokens, dev, ex_name, notes, t0)


def own_value_notes(rd: RunDir, grid: dict[str, list[Any]], fixed: dict[str, Any]) -> list[str]:
    """A note for each swept value and fixed override equal to the run's own value
    (:func:`rldiag.config.settings.unchanged_overrides`): that what-if changes nothing there."""
    base = resolve_settings(rd.path, {})
    notes = []
    same = unchanged_overrides(base, fixed)
    if same:
        notes.append(f"--set {unchanged_warning(same, False)}: every scenario keeps it")
    for key, values in grid.items():
        for v in values:
            if unchanged_overrides(base, {key: v}):
                notes.append(f"{key}={yaml_text(v)} is the run's own value")
    return notes


def own_scenario(rd: RunDir, scenarios: list[_Scenario]) -> str | None:
    """The scenario whose resolved settings are the run's own (None: none is)."""
    want = resolve_settings(rd.path, {}).resolved()
    return next((sc.name for sc in scenarios if sc.settings.resolved() == want), None)


def _run_local(rd: RunDir, scenarios: list[_Scenario], files: dict, chosen: list[int], save_tokens: bool, reuse: bool,
               device: str, progress: ProgressFn | None, pack_tokens: int, chunk_steps: int,
               hooks: SweepHooks | None, label: str) -> tuple[str, str]:
    from rldiag.executors.steps import Job
    from rldiag.executors.sweep import SweepExecutor

    known = known_inputs(rd.path, "") if reuse else {}
    prevs = [previous(rd.path, sc.name, sc.settings, save_tokens, known=known) if reuse else Previous()
             for sc in scenarios]
    ex = SweepExecutor(hooks)
    t0 = time.perf_counter()
    writers: list[ScenarioWriter] = []
    try:
        dev = ex.start(device)
        plans = [plan_steps(rd, files, chosen, Job(settings=sc.settings, device=dev, save_tokens=save_tokens,
                                                   pack_tokens=pack_tokens), prev, chunk_steps)
                 for sc, prev in zip(scenarios, prevs)]
        try:
            for sc, prev in zip(scenarios, prevs):
                target = rd.layout.scenario(sc.name)
                sc.report = ScenarioReport(name=sc.name, path=target.dir, settings=sc.settings, device=dev,
                                           executor=ex.name)
                writers.append(ScenarioWriter(target, sc.report, prev, sc.overrides, save_tokens))
            total = len(chosen) * len(scenarios)
            with closing(ex.run(plans)) as outcomes:
                for done, (i, out) in enumerate(outcomes, 1):
                    writers[i].record(out)
                    if progress:
                        progress(done, total, out.step)
            seconds = time.perf_counter() - t0
            # a capture policy's run: its sampled and uncaptured steps marked (the adaptive KL chain of a
            # swept scenario does not take the logged statistics: rldiag recompute of that scenario does)
            sample = SampledRun.of(rd, scenarios[0].settings, files, chosen) if scenarios else None
            for sc, writer in zip(scenarios, writers):
                extra = sample.mark(sc.report) if sample is not None else {}
                writer.commit(seconds, {"sweep": label, **extra})  # the sweep that wrote it
                sc.table = writer.table
        except BaseException:
            for writer in writers:
                writer.abort()
            raise
    finally:
        ex.close()
    return dev, ex.name


def _run_each(rd: RunDir, scenarios: list[_Scenario], chosen: list[int], save_tokens: bool, reuse: bool,
              device: str, executor: Any, progress: ProgressFn | None, pack_tokens: int,
              chunk_steps: int) -> tuple[str, str]:
    """Each scenario recomputed on its own on ``executor`` (a name, started and closed here, or
    an executor, left open)."""
    from rldiag.executors import get_executor
    from rldiag.scenario.recompute import recompute

    ex = get_executor(executor)
    owned = isinstance(executor, str)
    dev, offset = device, 0
    n = len(scenarios)
    try:
        for sc in scenarios:
            def update(done: int, total: int, step: int, base: int = offset) -> None:
                if progress:
                    progress(base + done, total * n, step)

            sc.report = recompute(rd.path, sc.overrides, name=sc.name, steps=chosen, device=device,
                                  save_tokens=save_tokens, progress=update, pack_tokens=pack_tokens, reuse=reuse,
                                  executor=ex, chunk_steps=chunk_steps)
            dev = sc.report.device
            offset += len(sc.report.steps_done) + len(sc.report.steps_failed)
    finally:
        if owned:
            ex.close()
    return dev, ex.name


def _write_sweep(rd: RunDir, name: str, grid: dict[str, list[Any]], fixed: dict[str, Any], scenarios: list[_Scenario],
                 chosen: list[int], save_tokens: bool, device: str, executor: str, notes: list[str],
                 t0: float) -> SweepReport:
    import polars as pl

    layout = rd.layout.sweep(name)
    table = _summary(scenarios, grid)
    seconds = time.perf_counter() - t0
    reports = {sc.name: sc.report for sc in scenarios if sc.report is not None}
    own = own_scenario(rd, scenarios)
    if own is not None:
        notes.append(f"scenario {own} has the run's own settings (marked *)")
    meta = {
        "name": name,
        "grid": grid,
        "overrides": fixed,
        "scenarios": {sc.name: sc.overrides for sc in scenarios},
        "steps": chosen,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
        "save_tokens": save_tokens,
        "device": device,
        "executor": executor,
        "rldiag_version": __version__,
        "notes": notes,
        "own": own,
        "steps_failed": {n: {str(k): v for k, v in sorted(r.steps_failed.items())} for n, r in reports.items()
                         if r.steps_failed},
    }
    with open_staged(layout.dir, marker=SweepLayout.META) as writer:
        writer.write_table(SweepLayout.SUMMARY, table)
        writer.commit(json_safe(meta))
    summary = pl.from_arrow(table)
    assert isinstance(summary, pl.DataFrame)
    return SweepReport(
        name=name, path=layout.dir, run=str(rd.path), grid=grid, overrides=fixed,
        scenarios={sc.name: sc.overrides for sc in scenarios}, summary=summary,
        steps_done={n: list(r.steps_done) for n, r in reports.items()},
        steps_failed={n: dict(r.steps_failed) for n, r in reports.items()},
        steps_reused={n: sorted(r.steps_reused) for n, r in reports.items()},
        steps=chosen, seconds=seconds, device=device, executor=executor, notes=notes, own=own,
    )

