"""``rldiag compare``: two scenarios of one run, or a scenario and the logged values.

Per step: the delta of every metric both sides have, and the per-token agreement of the
advantages (:mod:`.agreement`): sign agreement, Pearson and Spearman correlation, share of
tokens whose sign flips, groups that carry signal in one and not the other, and the mean
absolute change of the effective per-token weight

    W_t = A_t * N * w_t * rho_t

where ``w_t`` is the token's weight in the actor loss under the side's ``loss_agg_mode``
(the derivative of verl's ``agg_loss`` with respect to the token's loss, in closed form:
:mod:`.weights`), ``N`` the step's loss-mask token count (so that ``token-mean`` gives
``w_t * N = 1``), and ``rho_t`` the rollout IS weight where the scenario has one (else 1).

Steps are streamed (each step's agreement to ``on_step`` as it is known); results go to
``RUN/rldiag/comparisons/<A>__vs__<B>/`` (replaced atomically; for a run in an object store,
there, ``comparison.json`` written last: :mod:`rldiag.io.staged`): ``metrics.parquet``,
``tokens.parquet``, ``groups.parquet``, ``comparison.json``. The side name ``logged`` means the
values the trainer logged (``metrics.jsonl`` and the batch files' ``advantages`` column).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rldiag.analysis.agreement import TokenAgreement, agreement_frame, token_agreement
from rldiag.analysis.logged import flat_list_column, logged_metrics
from rldiag.analysis.weights import effective_weights
from rldiag.config.settings import resolve_settings
from rldiag.errors import BatchError, ConfigError, OutputError, RunDirError
from rldiag.io.arrays import parquet_file, rows_frame
from rldiag.io.fs import RemotePath, arrow_source
from rldiag.io.loader import read_schema, read_table
from rldiag.io.outputs import json_safe, read_scenario
from rldiag.io.run_layout import PAIR_SEP, ComparisonLayout, ScenarioLayout
from rldiag.io.rundir import RunDir, StepFile, Steps, parse_steps
from rldiag.io.schema import id_type_problem
from rldiag.io.staged import open_staged
from rldiag.scenario.tokens import ensure_scenario, read_meta
from rldiag.version import __version__

if TYPE_CHECKING:
    import polars as pl

LOGGED = "logged"
ProgressFn = Callable[[int, int, int], None]
StepFn = Callable[[TokenAgreement], None]


@dataclass
class MetricDelta:
    """One metric over the steps both sides have: B - A."""

    metric: str
    steps: int
    mean_a: float
    mean_b: float
    mean_delta: float
    max_abs_delta: float


@dataclass
class CompareReport:
    run: str
    a: str
    b: str
    path: Path | RemotePath  # where the comparison was written (RunLayout.comparison)
    metric_steps: list[int] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)
    steps_without_tokens: dict[str, list[int]] = field(default_factory=dict)
    metrics: list[MetricDelta] = field(default_factory=list)
    tokens: list[TokenAgreement] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)
    recomputed: list[str] = field(default_factory=list)  # scenarios this comparison (re)computed

    def to_dict(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        return json_safe(d)

    def metrics_frame(self) -> pl.DataFrame:
        """One row per metric both sides have: its mean on each side, mean delta (B - A) and
        largest absolute delta over the steps compared."""
        return rows_frame([asdict(m) for m in self.metrics], [f.name for f in fields(MetricDelta)])

    def tokens_frame(self) -> pl.DataFrame:
        """One row per step with per-token outputs on both sides: the agreement of their
        advantages (sign agreement, Pearson, Spearman, sign flips, groups with signal, ...)."""
        return agreement_frame(self.tokens)


# ---- the two sides ----------------------------------------------------------------------------


#: the columns of a scenario's tokens file the compare reads (the file has more)
_TOKEN_COLUMNS = ("row", "advantages", "response_mask", "rollout_is_weights")


class _Side:
    """Metrics and per-token advantages of one side (a scenario, or the logged values)."""

    def __init__(self, rd: RunDir, name: str):
        self.rd, self.name = rd, name
        if name == LOGGED:
            self.settings = resolve_settings(rd.path)
            self.metrics = logged_metrics(rd.metrics_file)
            self.scenario: ScenarioLayout | None = None
        else:
            meta, table = read_scenario(rd.path, name)
            self.settings = resolve_settings(config={k: v for k, v in meta["settings"].items() if v is not None})
            self.metrics = _metrics_by_step(table)
            self.scenario = rd.layout.scenario(name)

    def tokens(self, sf: StepFile, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """(advantages, response_mask, rollout IS weights or None), flat; None when absent."""
        if self.scenario is None:
            if "advantages" not in read_schema(sf).names:
                return None
            t = read_table(sf, ["advantages", "response_mask"])
            return (flat_list_column(t, "advantages", lengths, sf), flat_list_column(t, "response_mask", lengths, sf), None)
        p = self.scenario.tokens_file(sf.step)
        if not p.is_file():
            return None
        try:
            pf = parquet_file(*arrow_source(p))
            names = pf.schema_arrow.names
            t = pf.read(columns=[c for c in _TOKEN_COLUMNS if c in names])
        except (pa.ArrowException, OSError) as exc:
            raise OutputError(f"scenario {self.name!r}, step {sf.step}: cannot read {p}: {exc}") from exc
        if "row" not in names:
            raise OutputError(f"scenario {self.name!r}, step {sf.step}: {p} has no row column; recompute the scenario")
        rows = t["row"].to_numpy()
        if len(rows) != len(lengths) or not np.array_equal(rows, np.arange(len(lengths))):
            raise OutputError(f"scenario {self.name!r}, step {sf.step}: its rows do not match the batch file "
                              f"({len(rows)} vs {len(lengths)}); recompute the scenario")
        try:
            adv = flat_list_column(t, "advantages", lengths, sf)
            mask = flat_list_column(t, "response_mask", lengths, sf)
            isw = flat_list_column(t, "rollout_is_weights", lengths, sf) if "rollout_is_weights" in t.column_names else None
        except BatchError as exc:
            raise OutputError(f"scenario {self.name!r} does not match the batch file: {exc}; recompute it") from exc
        return adv, mask, isw



def _metrics_by_step(table: pa.Table) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    cols = {c: table[c].to_pylist() for c in table.column_names}
    for i, step in enumerate(cols.get("step", [])):
        out[int(step)] = {k: float(v[i]) for k, v in cols.items() if k != "step" and v[i] is not None}
    return out


# ---- the comparison ---------------------------------------------------------------------------


def _step_frame(sf: StepFile) -> tuple[np.ndarray, np.ndarray, int, pa.Array, float]:
    """(lengths, token -> group index, n_groups, uid per group, loss-mask token count) of a step."""
    names = read_schema(sf).names
    cols = ["uid", "response_mask"] + (["loss_mask"] if "loss_mask" in names else [])
    t = read_table(sf, cols)
    lengths = pc.list_value_length(t["response_mask"].combine_chunks()).to_numpy(zero_copy_only=False).astype(np.int64)
    uid = t["uid"].combine_chunks()
    if (problem := id_type_problem(uid.type)) is not None:
        raise BatchError(problem, file=str(sf.path), step=sf.step, column="uid")
    enc = pc.dictionary_encode(pc.cast(uid, pa.string()))
    row_group = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    norm_col = "loss_mask" if "loss_mask" in names else "response_mask"
    n_norm = float(flat_list_column(t, norm_col, lengths, sf).sum())
    return lengths, np.repeat(row_group, lengths), len(enc.dictionary), enc.dictionary, n_norm


def summarise(tokens: list[TokenAgreement]) -> dict[str, float]:
    """The comparison's summary over the steps in ``tokens`` (pooled over tokens, or the mean
    over steps for the correlations); on the steps so far while a compare streams."""
    n = sum(t.n_tokens for t in tokens)
    nw = sum(t.weight_tokens for t in tokens)

    def pooled(attr: str, weight: str = "n_tokens") -> float:
        tot = sum(getattr(t, weight) for t in tokens if not math.isnan(getattr(t, attr)))
        if not tot:
            return math.nan
        return sum(getattr(t, attr) * getattr(t, weight) for t in tokens if not math.isnan(getattr(t, attr))) / tot

    def mean(attr: str) -> float:
        vals = [getattr(t, attr) for t in tokens if not math.isnan(getattr(t, attr))]
        return float(np.mean(vals)) if vals else math.nan

    return {
        "steps": len(tokens),
        "tokens": n,
        "sign_agreement": pooled("sign_agreement"),
        "sign_flip_fraction": pooled("sign_flip_fraction"),
        "pearson_mean": mean("pearson"),
        "spearman_mean": mean("spearman"),
        "adv_mean_abs_change": pooled("adv_mean_abs_change"),
        "weight_mean_abs_change": pooled("weight_mean_abs_change", "weight_tokens") if nw else math.nan,
        "groups": sum(t.groups for t in tokens),
        "groups_signal_a": sum(t.groups_signal_a for t in tokens),
        "groups_signal_b": sum(t.groups_signal_b for t in tokens),
        "groups_signal_only_a": sum(t.groups_signal_only_a for t in tokens),
        "groups_signal_only_b": sum(t.groups_signal_only_b for t in tokens),
    }


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or PAIR_SEP in name:
        raise ConfigError(f"{name!r} is not a scenario name")


def compare(
    run: str | Path | RemotePath,
    a: str,
    b: str,
    steps: Steps = None,
    recompute_missing: bool = True,
    device: str = "auto",
    progress: ProgressFn | None = None,
    on_step: StepFn | None = None,
) -> CompareReport:
    """Compare side ``a`` with side ``b`` (scenario names, or ``logged``) and write the results.

    Steps are compared one at a time: ``on_step`` gets each step's :class:`TokenAgreement` as
    soon as it is known (steps where both sides have tokens), then ``progress(done, total,
    step)`` is called; an exception raised by either stops the compare with nothing written.

    A scenario without per-token outputs (or computed from other inputs) is recomputed first with
    ``save_tokens`` and its own overrides, unless ``recompute_missing`` is False. Returns a
    :class:`CompareReport` (deltas are B - A). Raises :class:`RldiagError` for a missing scenario
    or a scenario that does not match the batch files.
    """
    rd = RunDir(run)
    _check_name(a)
    _check_name(b)
    if a == b:
        raise ConfigError(f"compare needs two different sides, got {a!r} twice")
    files = {sf.step: sf for sf in rd.require_steps()}
    chosen = parse_steps(steps, sorted(files))
    recomputed = []
    scenarios = [n for n in (a, b) if n != LOGGED]
    for name in scenarios:
        if read_meta(rd.path, name) is None:
            raise RunDirError(f"no scenario {name!r} in {rd.path}; run `rldiag recompute` first (or use {LOGGED!r})")
    for name in scenarios:
        if recompute_missing and ensure_scenario(rd.path, name, None, steps, device=device):
            recomputed.append(name)
    side_a, side_b = _Side(rd, a), _Side(rd, b)
    report = CompareReport(run=str(rd.path), a=a, b=b, path=rd.layout.comparison(a, b).dir, recomputed=recomputed,
                           steps_without_tokens={a: [], b: []})
    metric_rows: list[tuple[int, str, float, float]] = []
    group_rows: dict[str, list] = {k: [] for k in ("step", "uid", "signal_a", "signal_b")}
    for i, step in enumerate(chosen):
        ma, mb = side_a.metrics.get(step), side_b.metrics.get(step)
        if ma is not None and mb is not None:
            report.metric_steps.append(step)
            for name in sorted(set(ma) & set(mb)):
                metric_rows.append((step, name, ma[name], mb[name]))
        sf = files[step]
        lengths, token_group, n_groups, uids, n_norm = _step_frame(sf)
        ta, tb = side_a.tokens(sf, lengths), side_b.tokens(sf, lengths)
        for name, t in ((a, ta), (b, tb)):
            if t is None:
                report.steps_without_tokens[name].append(step)
        if ta is not None and tb is not None:
            wa = effective_weights(ta[0] * (ta[1] > 0), ta[1], lengths, side_a.settings, n_norm, ta[2])
            wb = effective_weights(tb[0] * (tb[1] > 0), tb[1], lengths, side_b.settings, n_norm, tb[2])
            agreement, sig_a, sig_b = token_agreement(step, ta[0], tb[0], ta[1], tb[1], wa, wb, token_group, n_groups)
            report.tokens.append(agreement)
            report.token_steps.append(step)
            if on_step:
                on_step(agreement)
            group_rows["step"].extend([step] * n_groups)
            group_rows["uid"].extend(uids.to_pylist())
            group_rows["signal_a"].extend(sig_a.tolist())
            group_rows["signal_b"].extend(sig_b.tolist())
        if progress:
            progress(i + 1, len(chosen), step)
    report.metrics = _metric_summary(metric_rows)
    report.summary = summarise(report.tokens)
    _write(report, metric_rows, group_rows, side_a, side_b)
    return report


def _metric_summary(rows: list[tuple[int, str, float, float]]) -> list[MetricDelta]:
    by: dict[str, list[tuple[float, float]]] = {}
    for _, name, va, vb in rows:
        by.setdefault(name, []).append((va, vb))
    out = []
    for name, pairs in sorted(by.items()):
        arr = np.array(pairs, dtype=np.float64)
        d = arr[:, 1] - arr[:, 0]
        fin = np.isfinite(d)
        mean_a = float(np.nanmean(arr[:, 0])) if np.isfinite(arr[:, 0]).any() else math.nan
        mean_b = float(np.nanmean(arr[:, 1])) if np.isfinite(arr[:, 1]).any() else math.nan
        out.append(MetricDelta(metric=name, steps=len(pairs), mean_a=mean_a, mean_b=mean_b,
                               mean_delta=float(d[fin].mean()) if fin.any() else math.nan,
                               max_abs_delta=float(np.abs(d[fin]).max()) if fin.any() else math.nan))
    return out


def _write(report: CompareReport, metric_rows, group_rows, side_a: _Side, side_b: _Side) -> None:
    """The comparison's files, ``comparison.json`` last: a staging directory swapped in on disk,
    objects in place with ``comparison.json`` marking them complete in an object store."""
    writer = open_staged(report.path, marker=ComparisonLayout.META)
    try:
        steps, names, va, vb = (list(x) for x in zip(*metric_rows)) if metric_rows else ([], [], [], [])
        writer.write_table(ComparisonLayout.METRICS, pa.table({
            "step": pa.array(steps, pa.int64()), "metric": pa.array(names, pa.string()),
            "a": pa.array(va, pa.float64()), "b": pa.array(vb, pa.float64()),
            "delta": pa.array([y - x for x, y in zip(va, vb)], pa.float64()),
        }))
        tok_fields = [f for f in TokenAgreement.__dataclass_fields__]
        cols = {f: [getattr(t, f) for t in report.tokens] for f in tok_fields}
        types = {f: (pa.int64() if f in ("step", "n_tokens", "weight_tokens") or f.startswith("groups") else pa.float64())
                 for f in tok_fields}
        writer.write_table(ComparisonLayout.TOKENS, pa.table({f: pa.array(cols[f], types[f]) for f in tok_fields}))
        writer.write_table(ComparisonLayout.GROUPS, pa.table({
            "step": pa.array(group_rows["step"], pa.int64()), "uid": pa.array(group_rows["uid"], pa.string()),
            "signal_a": pa.array(group_rows["signal_a"], pa.bool_()), "signal_b": pa.array(group_rows["signal_b"], pa.bool_()),
        }))
        writer.commit({
            "a": report.a, "b": report.b, "run": report.run, "rldiag_version": __version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "settings_a": side_a.settings.resolved(), "settings_b": side_b.settings.resolved(),
            "metric_steps": report.metric_steps, "token_steps": report.token_steps,
            "steps_without_tokens": report.steps_without_tokens, "recomputed": report.recomputed,
            "summary": report.summary, "metrics": [asdict(m) for m in report.metrics],
        })
    except BaseException:
        writer.abort()
        raise


# ---- several estimators -----------------------------------------------------------------------


@dataclass
class EstimatorComparison:
    """``compare RUN --estimators a,b,c``: the scenarios and every pair's comparison."""

    run: str
    scenarios: dict[str, str]  # estimator -> scenario name
    recomputed: list[str]
    pairs: list[CompareReport]

    def to_dict(self) -> dict:
        return json_safe({"run": self.run, "scenarios": self.scenarios, "recomputed": self.recomputed,
                          "pairs": [p.to_dict() for p in self.pairs]})

    def summary_frame(self) -> pl.DataFrame:
        """One row per pair: its scenarios ``a`` and ``b`` and the summary of their comparison."""
        keys = list(dict.fromkeys(k for p in self.pairs for k in p.summary))
        return rows_frame([{"a": p.a, "b": p.b, **p.summary} for p in self.pairs], ["a", "b", *keys])


def compare_estimators(
    run: str | Path | RemotePath,
    estimators: list[str],
    steps: Steps = None,
    device: str = "auto",
    progress: ProgressFn | None = None,
    on_scenario: Callable[[str], None] | None = None,
) -> EstimatorComparison:
    """Recompute (or reuse) one scenario per estimator, named ``adv_estimator=<name>`` with
    per-token outputs, then compare every pair (in the order given). ``on_scenario(name)`` is
    called before each scenario is looked at (and recomputed, with ``progress``, when needed)."""
    from rldiag.config.settings import scenario_slug
    from rldiag.engine.advantage import ESTIMATORS

    names = list(dict.fromkeys(e.strip() for e in estimators if e.strip()))
    if len(names) < 2:
        raise ConfigError("--estimators needs at least two estimator names, comma separated")
    for e in names:
        ESTIMATORS.get(e)  # unknown -> UnknownKeyError listing the valid ones
    rd = RunDir(run)
    scenarios, recomputed = {}, []
    for e in names:
        overrides = {"algorithm.adv_estimator": e}
        scenarios[e] = scenario_slug(overrides)
        if on_scenario:
            on_scenario(scenarios[e])
        if ensure_scenario(rd.path, scenarios[e], overrides, steps, device=device, progress=progress):
            recomputed.append(scenarios[e])
    pairs = []
    for i, ea in enumerate(names):
        for eb in names[i + 1:]:
            pairs.append(compare(rd.path, scenarios[ea], scenarios[eb], steps=steps, recompute_missing=False, device=device))
    return EstimatorComparison(run=str(rd.path), scenarios=scenarios, recomputed=recomputed, pairs=pairs)
