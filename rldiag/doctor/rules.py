"""Doctor rules: a YAML data file (``rules.yaml`` beside this module) that users extend.

A rules file holds ``rules:``, a list of mappings. Built-in rules load first; each user file
(``--rules FILE``) then adds rules, or overrides a rule with the same ``id`` key by key
(``enabled: false`` turns one off). Files are read with ``yaml.safe_load`` only. Every rule is
checked when loaded: an unknown kind, a missing or misspelt parameter, or a bad value is a
:class:`ConfigError` naming the file and the rule.

Imports go one way: :mod:`.rule` (the Rule) <- :mod:`.evaluators` (the kinds) <- this module
(the files, checked against the kinds).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rldiag.config.settings import known_keys, read_yaml, resolve_settings
from rldiag.doctor import composite as _while_kind  # noqa: F401  (registers kind while)
from rldiag.doctor import mismatch_rule as _mismatch_kind  # noqa: F401  (registers kind mismatch)
from rldiag.doctor.evaluators import RULE_KINDS
from rldiag.doctor.rule import Rule
from rldiag.errors import ConfigError

BUILTIN_RULES = Path(__file__).with_name("rules.yaml")

SEVERITIES = ("info", "warning", "critical")
SOURCES = ("any", "logged", "recomputed")
#: keys every rule may have, whatever its kind.
COMMON_KEYS = {"id", "kind", "title", "why", "severity", "enabled", "when", "source", "window", "min_steps", "warmup",
               "metric", "addresses"}
#: how a counterfactual reduces a metric over the window's steps
ADDRESS_STATISTICS = ("mean", "median", "max", "last")
ADDRESS_KEYS = ("settings", "metrics", "statistic")


def read_rules_file(path: Path) -> list[dict]:
    """The raw rule mappings of one file."""
    doc = read_yaml(Path(path), "rules file")
    if doc is None:
        return []
    if not isinstance(doc, Mapping) or not isinstance(doc.get("rules", []), list):
        raise ConfigError(f"rules file {path} must hold a mapping with a list under 'rules:'")
    out = []
    for i, item in enumerate(doc.get("rules") or []):
        if not isinstance(item, Mapping) or not isinstance(item.get("id"), str) or not item["id"].strip():
            raise ConfigError(f"rules file {path}, rule #{i + 1}: every rule is a mapping with a string 'id'")
        out.append(dict(item))
    return out


def _build(raw: dict, origin: str) -> Rule:
    rid = raw["id"]
    where = f"rules file {origin}, rule {rid!r}"
    for key in ("kind", "title", "why"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise ConfigError(f"{where}: '{key}' is required (a string)")
    kind = raw["kind"]
    if kind not in RULE_KINDS:
        raise ConfigError(f"{where}: unknown kind {kind!r}; valid: {', '.join(RULE_KINDS.names())}")
    meta = RULE_KINDS.meta(kind)
    allowed = COMMON_KEYS | set(meta.params) | set(meta.required)
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} for kind {kind}; "
                          f"valid: {', '.join(sorted(allowed))}")
    for key in meta.required:
        if raw.get(key) is None:
            raise ConfigError(f"{where}: kind {kind} needs '{key}'")
    severity = raw.get("severity", "warning")
    if severity not in SEVERITIES:
        raise ConfigError(f"{where}: severity must be one of {', '.join(SEVERITIES)}, got {severity!r}")
    source = raw.get("source", "any")
    if source not in SOURCES:
        raise ConfigError(f"{where}: source must be one of {', '.join(SOURCES)}, got {source!r}")
    when = raw.get("when") or {}
    if not isinstance(when, Mapping):
        raise ConfigError(f"{where}: 'when' must map settings to values")
    window, min_steps = raw.get("window"), raw.get("min_steps", meta.min_steps)
    for name, v in (("window", window), ("min_steps", min_steps)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{where}: '{name}' must be a positive integer, got {v!r}")
    warmup = raw.get("warmup", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"{where}: 'warmup' must be a non-negative integer, got {warmup!r}")
    params = {k: v for k, v in raw.items() if k not in COMMON_KEYS}
    addresses = _addresses(raw.get("addresses"), raw.get("metric"), where)
    rule = Rule(id=rid, kind=kind, title=raw["title"].strip(), why=" ".join(raw["why"].split()), severity=severity,
                metric=raw.get("metric"), source=source, when=dict(when), window=window, min_steps=min_steps,
                warmup=warmup, params=params, origin=origin, addresses=addresses)
    check = meta.check
    if check is not None:
        problem = check(rule)
        if problem:
            raise ConfigError(f"{where}: {problem}")
    return rule


def _recomputed_key(key: str) -> bool:
    """Whether an engine stage reads ``key`` (so a recompute under another value can differ)."""
    from rldiag.engine.stages import STAGES
    from rldiag.engine.sweep import stage_keys

    return any(stage_keys(stage, [key]) for stage in STAGES)


def _addresses(raw: Any, metric: Any, where: str) -> dict[str, Any]:
    """A rule's ``addresses`` checked and completed (``metrics`` defaults to the rule's metric,
    ``statistic`` to mean); {} when absent. Each alternative's keys must be settings an engine
    stage reads: a setting whose effect a recompute cannot show (a learning rate) is refused."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: 'addresses' must be a mapping with 'settings' (and optionally 'metrics', "
                          "'statistic')")
    unknown = sorted(set(raw) - set(ADDRESS_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(str, unknown))} under 'addresses'; "
                          f"valid: {', '.join(ADDRESS_KEYS)}")
    alternatives = raw.get("settings")
    if not isinstance(alternatives, list) or not alternatives:
        raise ConfigError(f"{where}: 'addresses.settings' must be a non-empty list of mappings "
                          "(verl dotted keys -> value), one per alternative")
    known = set(known_keys())
    out_settings = []
    for i, alt in enumerate(alternatives):
        if not isinstance(alt, Mapping) or not alt:
            raise ConfigError(f"{where}: 'addresses.settings' #{i + 1} must be a non-empty mapping of settings")
        for key in alt:
            if not isinstance(key, str) or key not in known:
                raise ConfigError(f"{where}: 'addresses.settings' #{i + 1}: unknown setting {key!r} "
                                  "(see docs/settings.md)")
            if not _recomputed_key(key):
                raise ConfigError(f"{where}: 'addresses.settings' #{i + 1}: {key} is read by no engine stage, so a "
                                  "recompute cannot show its effect")
        try:
            resolve_settings(None, dict(alt))
        except ConfigError as exc:
            raise ConfigError(f"{where}: 'addresses.settings' #{i + 1}: {exc}") from None
        out_settings.append(dict(alt))
    metrics = raw.get("metrics", [metric] if metric is not None else None)
    if metrics is None:
        raise ConfigError(f"{where}: 'addresses.metrics' is required when the rule has no 'metric'")
    if (not isinstance(metrics, list) or not metrics
            or not all(isinstance(m, str) and m.strip() for m in metrics)):
        raise ConfigError(f"{where}: 'addresses.metrics' must be a non-empty list of metric names")
    statistic = raw.get("statistic", "mean")
    if statistic not in ADDRESS_STATISTICS:
        raise ConfigError(f"{where}: 'addresses.statistic' must be one of {', '.join(ADDRESS_STATISTICS)}, "
                          f"got {statistic!r}")
    return {"settings": out_settings, "metrics": list(dict.fromkeys(metrics)), "statistic": statistic}


def load_rules(extra: Iterable[str | Path] = (), builtin: bool = True) -> list[Rule]:
    """The built-in rules (unless ``builtin`` is False) with each file of ``extra`` merged in
    order. Returns the enabled rules, in definition order."""
    merged: dict[str, dict] = {}
    origins: dict[str, str] = {}
    sources = ([BUILTIN_RULES] if builtin else []) + [Path(p) for p in extra]
    for path in sources:
        for raw in read_rules_file(path):
            rid = raw["id"]
            merged[rid] = {**merged.get(rid, {}), **raw}
            origins[rid] = str(path)
    rules = []
    for rid, raw in merged.items():
        enabled = raw.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ConfigError(f"rules file {origins[rid]}, rule {rid!r}: 'enabled' must be true or false")
        if enabled:
            rules.append(_build(raw, origins[rid]))
    return rules


def metric_limits(rules: Iterable[Rule] | None = None) -> dict[str, dict[str, Any]]:
    """The healthy side of each metric a threshold rule judges step by step, for anything else
    that quotes a healthy band (the Step page's checklist): ``metric -> {"rule", "above", "below",
    "abs", "title"}`` (the first rule of a metric; ``above`` / ``below`` None when the rule has
    no such bound). ``rules``: default the built-in ones."""
    out: dict[str, dict[str, Any]] = {}
    for r in load_rules(()) if rules is None else rules:
        if r.kind != "threshold" or r.metric is None or r.metric in out:
            continue
        out[r.metric] = {"rule": r.id, "above": r.params.get("above"), "below": r.params.get("below"),
                         "abs": bool(r.params.get("abs")), "title": r.title}
    return out
