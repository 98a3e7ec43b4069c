"""``rldiag calibrate CORPUS``: every doctor rule and gap cause measured on a labelled corpus.

A corpus (``python -m rldiag.toy.corpus OUT``) holds run directories, each with ``labels.json``
(``healthy``, ``pathologies``: ``[{"kind", "cause"?, "onset_step", "signal", "implied_by"?}]``,
``split``), and ``OUT/manifest.json``. For each run, :func:`replay_run` recomputes the run under
its own settings (the baseline scenario, written and kept as ``rldiag doctor`` writes it) and
replays the doctor step by step, as ``rldiag doctor --follow`` evaluates a growing run
(:class:`rldiag.doctor.live.LiveDoctor`: each step's logged and recomputed metrics added, every
rule evaluated, the events taken). An *alert* is a finding reaching severity
``warning`` or ``critical`` (a ``fired`` event at that severity, or an ``info`` finding
``changed`` up to it): ``info`` never counts, as it never counts as a health finding.

Per rule and gap cause (:func:`summarise`), over the runs of one split:

- a general rule's alert is a true positive on a run with a planted pathology and a false
  positive on a healthy run; its recall is per planted kind, and the kind it detects best is
  the one reported (``detects``) with that kind's false negatives and lead time;
- a gap cause (rule ``rollout_mismatch``, ``evidence.cause``) is a true positive on a run whose
  labels plant that cause, a false positive on any other run, except one whose labels name the
  cause as implied by another (``implied_by``: neither counted); a planted cause whose label says
  ``"expected_severity": "info"`` is detected when named at any severity;
- precision and recall carry Wilson 95 % intervals; false alarms per 100 healthy steps count the
  alerts on healthy runs (events, not active steps); the lead time of a detected run is its
  labelled onset minus the step of the first alert (positive: the finding came first), the median
  over the runs is reported;
- fewer than :data:`MIN_FIRINGS` alerted runs is ``not enough data``; alerts on no planted run
  ``uncalibrated``; a warning or critical rule meets the floor with precision >= 0.9 and at most
  one false alarm per 100 healthy steps (an uncalibrated one that fires does not).

Runs whose planted pathology was not produced (no onset) are left out and listed.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rldiag.errors import RunDirError

#: alerts on fewer runs than this: "not enough data"
MIN_FIRINGS = 5
#: the floor of a warning or critical rule (issue 35)
FLOOR_PRECISION = 0.9
FLOOR_FALSE_ALARMS = 1.0
#: severities that count as a health finding
ALERT = ("warning", "critical")
SPLITS = ("train", "test")
#: the file ``rldiag calibrate`` writes into the corpus
OUTPUT = "calibration.json"
WILSON_Z = 1.959963984540054

Key = tuple[str, "str | None"]


def wilson(successes: int, n: int, z: float = WILSON_Z) -> list[float] | None:
    """The Wilson score interval ``[low, high]`` of a proportion ``successes / n`` (None when n == 0)."""
    if n == 0:
        return None
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [max(0.0, centre - half), min(1.0, centre + half)]


@dataclass
class Alert:
    """A finding that reached warning or critical at ``step`` during the replay."""

    rule: str
    cause: str | None
    step: int
    severity: str
    confidence: float | None = None


@dataclass
class RunReplay:
    """One run replayed: its labels, its steps, its alerts in step order, the findings that held at
    the end (``rule[/cause]`` -> severity, info included) and what could not be recomputed."""

    name: str
    labels: dict[str, Any]
    steps: int
    alerts: list[Alert] = field(default_factory=list)
    # each gap cause the first time it was named at all (info included): a planted cause whose
    # label expects severity info is detected when named
    named: list[Alert] = field(default_factory=list)
    final: dict[str, str] = field(default_factory=dict)
    recompute_failed: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "split": self.labels.get("split"), "healthy": bool(self.labels.get("healthy")),
                "kinds": [kind_of(p) for p in self.labels.get("pathologies", [])], "steps": self.steps,
                "alerts": [asdict(a) for a in self.alerts], "named": [asdict(a) for a in self.named],
                "final": self.final,
                "recompute_failed": {str(k): v for k, v in self.recompute_failed.items()}}


def kind_of(pathology: Mapping[str, Any]) -> str:
    """A pathology's kind as calibration counts it: a gap cause is ``rollout_gap/<cause>``."""
    cause = pathology.get("cause")
    return f"{pathology['kind']}/{cause}" if cause else str(pathology["kind"])


def key_name(key: Key) -> str:
    return key[0] + (f"/{key[1]}" if key[1] else "")


def read_labels(run: Path) -> dict[str, Any]:
    path = run / "labels.json"
    try:
        labels = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path}: cannot read the run's labels: {exc}") from exc
    for k in ("healthy", "pathologies", "split"):
        if k not in labels:
            raise RunDirError(f"{path}: labels have no {k!r}")
    if labels["split"] not in SPLITS:
        raise RunDirError(f"{path}: split must be one of {SPLITS}, not {labels['split']!r}")
    return labels


def corpus_runs(corpus: Path) -> list[Path]:
    """The run directories of ``corpus``: ``manifest.json``'s ``runs`` when present, else every
    directory holding a ``labels.json``."""
    manifest = corpus / "manifest.json"
    if manifest.is_file():
        try:
            runs = json.loads(manifest.read_text())["runs"]
        except (OSError, ValueError, KeyError) as exc:
            raise RunDirError(f"{manifest}: cannot read the corpus manifest: {exc}") from exc
        return [corpus / r["dir"] for r in runs]
    found = sorted(p.parent for p in corpus.glob("*/labels.json"))
    if not found:
        raise RunDirError(f"{corpus}: no manifest.json and no run directory with a labels.json")
    return found


def replay_run(run: Path, rules: list[Any] | None = None, device: str = "cpu") -> RunReplay:
    """Recompute ``run`` (its baseline scenario written, as ``rldiag doctor`` writes it, and reused later) and
    evaluate the doctor's rules after each step, as ``doctor --follow`` does on a growing run."""
    from rldiag.analysis.logged import logged_metrics
    from rldiag.config.settings import resolve_settings
    from rldiag.doctor.live import LiveDoctor
    from rldiag.io.rundir import RunDir
    from rldiag.scenario.recompute import recompute

    labels = read_labels(run)
    settings = resolve_settings(run, {})
    rec = recompute(run, {}, device=device)
    recomputed = {int(r["step"]): {k: float(v) for k, v in r.items() if k != "step" and v is not None}
                  for r in rec.metrics}
    logged = logged_metrics(RunDir(run).metrics_file)
    doctor = LiveDoctor({**settings.values, **settings.resolved()}, rules)
    out = RunReplay(run.name, labels, steps=len(set(logged) | set(recomputed)),
                    recompute_failed=dict(rec.steps_failed))
    # a rule declared at info (never a health finding) is measured at its own severity
    info_rules = {r.id for r in doctor.rules if r.severity == "info"}
    alerting: set[Key] = set()
    seen: set[Key] = set()
    for step in sorted(set(logged) | set(recomputed)):
        if step in logged:
            doctor.add_logged(step, logged[step])
        if step in recomputed:
            doctor.add_recomputed(step, recomputed[step])
        doctor.evaluate(step)
        now = {(f.rule, f.evidence.cause): f for f in doctor.active() if f.severity in ALERT or f.rule in info_rules}
        for key, f in now.items():
            if key not in alerting:
                out.alerts.append(Alert(f.rule, f.evidence.cause, step, f.severity, f.evidence.confidence))
        alerting = set(now)
        for f in doctor.active():
            if f.evidence.cause is not None and (f.rule, f.evidence.cause) not in seen:
                seen.add((f.rule, f.evidence.cause))
                out.named.append(Alert(f.rule, f.evidence.cause, step, f.severity, f.evidence.confidence))
    out.final = {key_name((f.rule, f.evidence.cause)): f.severity for f in doctor.active()}
    return out


def replay_corpus(corpus: str | Path, device: str = "cpu", split: str | None = None,
                  progress: Callable[[int, int, str], None] | None = None) -> list[RunReplay]:
    """Every run of ``corpus`` (of ``split`` only, when given) replayed."""
    from rldiag.doctor.rules import load_rules

    root = Path(corpus)
    rules = load_rules(())
    runs = corpus_runs(root)
    out = []
    for i, run in enumerate(runs):
        if split is not None and read_labels(run)["split"] != split:
            continue
        out.append(replay_run(run, rules, device))
        if progress is not None:
            progress(i + 1, len(runs), run.name)
    return out


def produced(rep: RunReplay) -> bool:
    """Every planted pathology of the run came (has an onset)."""
    return all(p.get("onset_step") is not None for p in rep.labels.get("pathologies", []))


def _planted(rep: RunReplay) -> dict[str, int | None]:
    """The run's planted kinds (implied causes left out) -> their onset step."""
    return {kind_of(p): p.get("onset_step") for p in rep.labels.get("pathologies", []) if not p.get("implied_by")}


def _expects_info(rep: RunReplay) -> set[str]:
    """The run's planted kinds whose label expects severity info (a finding at info detects them)."""
    return {kind_of(p) for p in rep.labels.get("pathologies", [])
            if not p.get("implied_by") and p.get("expected_severity") == "info"}


def _implied(rep: RunReplay) -> set[str]:
    return {kind_of(p) for p in rep.labels.get("pathologies", []) if p.get("implied_by")}


def _rate(x: int, n: int) -> float | None:
    return x / n if n else None


def summarise_key(key: Key, runs: list[RunReplay], severity: str) -> dict[str, Any]:
    """One rule's (or gap cause's) figures over ``runs`` (one split, produced runs only)."""
    healthy_steps = sum(r.steps for r in runs if r.labels["healthy"])
    first: dict[str, int] = {}
    false_alarms = 0
    target = f"rollout_gap/{key[1]}" if key[0] == "rollout_mismatch" and key[1] else None
    for r in runs:
        steps = [a.step for a in r.alerts if (a.rule, a.cause) == key]
        if target is not None and target in _expects_info(r):  # named at info is what the label expects
            steps = sorted(steps + [a.step for a in r.named if (a.rule, a.cause) == key][:1])
        if steps:
            first[r.name] = steps[0]
        if r.labels["healthy"]:
            false_alarms += len(steps)
    if target is not None:  # a gap cause: right only on the runs that plant it
        counted = [r for r in runs if target not in _implied(r)]
        positive = {r.name for r in counted if target in _planted(r)}
        by_kind = {target: [r for r in counted if r.name in positive]}
    else:
        counted = runs
        positive = {r.name for r in runs if _planted(r)}
        by_kind = {}
        for r in runs:
            for kind in _planted(r):
                by_kind.setdefault(kind, []).append(r)
    fired = [r for r in counted if r.name in first]
    tp = sum(r.name in positive for r in fired)
    fp = len(fired) - tp
    recall_by_kind = {k: _rate(sum(r.name in first for r in rs), len(rs)) for k, rs in sorted(by_kind.items())}
    # the kind it detects best (on a tie, the kind the rule is named after)
    detects = max(recall_by_kind, key=lambda k: (recall_by_kind[k] or 0.0, k == key[0], k), default=None)
    if detects is not None and not recall_by_kind[detects]:
        detects = None  # it detects no kind: its false negatives are every planted run's
    pos = by_kind.get(detects, []) if detects is not None else [r for r in counted if r.name in positive]
    hit = [r for r in pos if r.name in first]
    leads = []
    for r in hit:
        onset = _planted(r).get(detects) if detects is not None else None
        if onset is not None:
            leads.append(onset - first[r.name])
    fa100 = 100.0 * false_alarms / healthy_steps if healthy_steps else None
    precision = _rate(tp, tp + fp)
    if not fired:
        status = "never fired"
    elif tp == 0:
        status = "uncalibrated"
    elif len(fired) < MIN_FIRINGS:
        status = "not enough data"
    else:
        status = "calibrated"
    floor = None
    if status == "calibrated" and severity in ALERT:
        floor = bool(precision is not None and precision >= FLOOR_PRECISION
                     and fa100 is not None and fa100 <= FLOOR_FALSE_ALARMS)
    elif status == "uncalibrated" and severity in ALERT:
        floor = False  # it fires, and only on healthy runs
    return {
        "rule": key[0], "cause": key[1], "severity": severity, "runs": len(counted), "fired": len(fired),
        "tp": tp, "fp": fp, "fn": len(pos) - len(hit), "precision": precision, "precision_ci": wilson(tp, tp + fp),
        "detects": detects, "recall": _rate(len(hit), len(pos)), "recall_ci": wilson(len(hit), len(pos)),
        "recall_by_kind": recall_by_kind, "false_alarms": false_alarms, "healthy_steps": healthy_steps,
        "false_alarms_per_100_steps": fa100, "lead_steps": statistics.median(leads) if leads else None,
        "lead_runs": len(leads), "status": status, "meets_floor": floor,
    }


def rule_keys(rules: Iterable[Any], runs: Iterable[RunReplay]) -> list[tuple[Key, str]]:
    """Every rule (and every gap cause of a rule naming causes), with its severity: the rules'
    declared ones first, then any other key an alert named."""
    from rldiag.analysis.mismatch import CAUSES

    keys: dict[Key, str] = {}
    for rule in rules:
        if rule.kind == "mismatch":
            for cause in CAUSES:
                keys[(rule.id, cause)] = rule.severity
        else:
            keys[(rule.id, None)] = rule.severity
    for r in runs:
        for a in r.alerts:
            keys.setdefault((a.rule, a.cause), a.severity)
    return list(keys.items())


def summarise(runs: list[RunReplay], rules: Iterable[Any], split: str) -> dict[str, Any]:
    """The figures of every rule and gap cause over the produced runs of ``split``."""
    chosen = [r for r in runs if r.labels["split"] == split and produced(r)]
    kinds: dict[str, int] = {}
    for r in chosen:
        for k in (_planted(r) or {"healthy": None}):
            kinds[k] = kinds.get(k, 0) + 1
    rows = [summarise_key(key, chosen, sev) for key, sev in rule_keys(rules, chosen)]
    return {"split": split, "runs": len(chosen), "runs_by_kind": kinds,
            "healthy_steps": sum(r.steps for r in chosen if r.labels["healthy"]),
            "left_out": sorted(r.name for r in runs if r.labels["split"] == split and not produced(r)),
            "rules": rows}


def calibrate(corpus: str | Path, device: str = "cpu", progress: Callable[[int, int, str], None] | None = None,
              write: bool = True) -> dict[str, Any]:
    """Replay every run of ``corpus`` and summarise both splits; writes ``CORPUS/calibration.json``
    (unless ``write`` is False) and returns what it holds."""
    from rldiag.doctor.rules import load_rules
    from rldiag.version import __version__

    root = Path(corpus)
    runs = replay_corpus(root, device=device, progress=progress)
    rules = load_rules(())
    manifest = root / "manifest.json"
    meta = json.loads(manifest.read_text()) if manifest.is_file() else {}
    out = {"corpus": {"path": str(root), "size": meta.get("size"), "seed": meta.get("seed"), "runs": len(runs)},
           "rldiag_version": __version__, "min_firings": MIN_FIRINGS,
           "floor": {"precision": FLOOR_PRECISION, "false_alarms_per_100_steps": FLOOR_FALSE_ALARMS},
           "splits": {s: summarise(runs, rules, s) for s in SPLITS},
           "runs": [r.to_dict() for r in runs]}
    if write:
        (root / OUTPUT).write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
    return out
