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

from rldiag.config.settings import read_yaml
from rldiag.doctor import composite as _while_kind  # noqa: F401  (registers kind while)
from rldiag.doctor import mismatch_rule as _mismatch_kind  # noqa: F401  (registers kind mismatch)
from rldiag.doctor.evaluators import RULE_KINDS
from rldiag.doctor.rule import Rule
from rldiag.errors import ConfigError

BUILTIN_RULES = Path(__file__).with_name("rules.yaml")

SEVERITIES = ("warning", "critical")
SOURCES = ("any", "logged", "recomputed")
#: keys every rule may have, whatever its kind.
COMMON_KEYS = {"id", "kind", "title", "why", "severity", "enabled", "when", "source", "window", "min_steps", "metric"}


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
    params = {k: v for k, v in raw.items() if k not in COMMON_KEYS}
    rule = Rule(id=rid, kind=kind, title=raw["title"].strip(), why=" ".join(raw["why"].split()), severity=severity,
                metric=raw.get("metric"), source=source, when=dict(when), window=window, min_steps=min_steps,
                params=params, origin=origin)
    check = meta.check
    if check is not None:
        problem = check(rule)
        if problem:
            raise ConfigError(f"{where}: {problem}")
    return rule


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
