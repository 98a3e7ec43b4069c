"""Settings resolution (docs/run-directory.md, "Settings").

Order, later wins: verl's defaults, the run's config file (``run.yaml``, else ``config.yaml``,
else ``.hydra/config.yaml``), then command-line overrides ``KEY=VALUE``. Keys are verl's own
dotted config keys. YAML is read with the safe loader only, bounded in size, alias expansion
and depth (:mod:`rldiag.config.yaml_bounded`). Every numeric setting is checked against its
valid range wherever it comes from. Every key, its default, type and range is declared once, in
:mod:`rldiag.config.schema`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rldiag.config.schema import DEFAULTS, SETTINGS, check_range, effective, keys_of, needs_critic
from rldiag.config.yaml_bounded import P, ReadablePath, load_yaml, read_text_bounded
from rldiag.errors import ConfigError

#: the keys by type, from the one table of settings (:mod:`rldiag.config.schema`)
_BOOL_KEYS = keys_of("bool")
_FLOAT_KEYS = keys_of("float")
_INT_KEYS = keys_of("int")
#: int keys that also take words ("auto", "run": derived from verl's own batch keys in the run's config)
_AUTO_KEYS = {s.key: s.words for s in SETTINGS if s.words}
#: list-valued keys and their element type; a string value is read as a comma list.
_LIST_KEYS = {s.key: (float if s.kind == "list[float]" else str) for s in SETTINGS if s.kind.startswith("list")}

CONFIG_FILES = ("run.yaml", "config.yaml", ".hydra/config.yaml")

_INTERP = re.compile(r"^\$\{(?:oc\.select:)?([^,}]+)(?:,([^}]*))?\}$")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> ``{"a.b.c": value}``. Lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _resolve_interpolations(flat: dict[str, Any]) -> dict[str, Any]:
    """Resolve Hydra's ``${a.b}`` and ``${oc.select:a.b,default}`` between keys of one file.

    An interpolation that cannot be resolved is dropped, so the key takes verl's default.
    """
    out = dict(flat)
    for _ in range(8):  # bounded: chains of interpolations are short
        changed = False
        for key, value in list(out.items()):
            if not isinstance(value, str):
                continue
            m = _INTERP.match(value.strip())
            if not m:
                continue
            target, default = m.group(1).strip(), m.group(2)
            if target in out and not (isinstance(out[target], str) and out[target].startswith("${")):
                out[key] = out[target]
            elif default is not None:
                out[key] = load_yaml(default, f"the default of {key}", invalid=default) if default.strip() else None
            else:
                del out[key]
            changed = True
        if not changed:
            break
    return {k: v for k, v in out.items() if not (isinstance(v, str) and v.strip().startswith("${"))}


def read_yaml(path: ReadablePath, what: str, error: type[Exception] = ConfigError) -> Any:
    """A YAML file read with the safe loader (``None`` for an empty file); unreadable or invalid
    files raise ``error`` naming ``what`` and the path."""
    where = f"{what} {path}"
    return load_yaml(read_text_bounded(path, where, error), where, error)


def read_yaml_mapping(path: ReadablePath, what: str, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """:func:`read_yaml` that must hold a mapping at the top (an empty file gives ``{}``)."""
    tree = read_yaml(path, what, error)
    if tree is None:
        return {}
    if not isinstance(tree, Mapping):
        raise error(f"{what} {path} must hold a mapping at the top, not {type(tree).__name__}")
    return dict(tree)


def load_config_file(path: ReadablePath) -> dict[str, Any]:
    """Read a YAML config file safely and flatten it to dotted keys."""
    tree = read_yaml_mapping(path, "config file")
    return _resolve_interpolations(flatten(tree))


def find_config_file(run_dir: P) -> P | None:
    for name in CONFIG_FILES:
        p = run_dir / name
        if p.is_file():
            return p
    return None


def parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as a YAML scalar (``true``, ``null``, ``0.95``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form KEY=VALUE")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    value = load_yaml(raw, f"override {text!r}", invalid=raw) if raw.strip() else None
    if isinstance(value, (dict, list)):
        raise ConfigError(f"override {text!r}: VALUE must be a scalar, not a {type(value).__name__}")
    return key, value


def _number(value: Any) -> float:
    """A float setting's value: a number or numeric text, never a bool or NaN."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    out = float(value)
    if math.isnan(out):
        raise ValueError("NaN is not a valid setting")
    return out


def _integer(value: Any) -> int:
    """An integer setting's value: an int, an integral float or integer text (``1e3`` too)."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    x = float(value)
    if not math.isfinite(x) or not x.is_integer():
        raise ValueError(f"expected an integer, got {value!r}")
    return int(x)


def _coerce_list(key: str, value: Any, kind: type) -> list:
    """A YAML list, or a comma list ``a,b`` (brackets optional), as a list of ``kind``."""
    if isinstance(value, str):
        items: list[Any] = [p.strip() for p in value.strip().strip("[]").split(",") if p.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    if kind is not float:
        return [kind(v) for v in items]
    out = [_number(v) for v in items]
    for v in out:
        check_range(key, v, integer=False)
    return out


def _coerce(key: str, value: Any, source: str) -> Any:
    if value is None:
        return None
    try:
        if key in _BOOL_KEYS:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            raise ValueError(f"expected true or false, got {value!r}")
        if key in _FLOAT_KEYS:
            out = _number(value)
            check_range(key, out, integer=False)
            return out
        if key in _LIST_KEYS:
            return _coerce_list(key, value, _LIST_KEYS[key])
        if key in _INT_KEYS:
            if value in _AUTO_KEYS.get(key, ()):
                return value
            out = _integer(value)
            check_range(key, out, integer=True)
            return out
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{key} from {source}: {exc}") from None
    return value


@dataclass(frozen=True)
class Settings:
    """Resolved settings: every key of :data:`DEFAULTS` plus any extra keys the run carries."""

    values: dict[str, Any]
    overrides: dict[str, Any] = field(default_factory=dict)
    config_file: str | None = None
    #: the keys the run's config file (or ``config``) sets: what the run says, not a default
    configured: frozenset[str] = frozenset()

    def __getitem__(self, key: str) -> Any:
        try:
            return self.values[key]
        except KeyError:
            raise ConfigError(f"unknown setting {key!r}") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    # Convenience accessors for the keys the engine reads most.
    def has(self, change: str) -> bool:
        """Whether the verl release these settings reproduce has the new behaviour of ``change``
        (:mod:`rldiag.config.verl_versions`)."""
        from rldiag.config.verl_versions import has

        return has(self, change)

    @property
    def estimator(self) -> str:
        return self.values["algorithm.adv_estimator"]

    @property
    def actor_agg_mode(self) -> str:
        return self.values["actor_rollout_ref.actor.loss_agg_mode"]

    @property
    def critic_agg_mode(self) -> str:
        return self.effective("critic.loss_agg_mode")

    @property
    def uses_critic(self) -> bool:
        """Whether the trainer trains and logs a critic: verl's ``need_critic`` (``critic.enable``
        when set, else ``adv_estimator == "gae"``; :func:`rldiag.config.schema.needs_critic`)."""
        return needs_critic(self.values)

    def effective(self, key: str) -> Any:
        """``key``'s value as verl reads it: a null takes the value of the key its schema row
        ``inherits`` (:func:`rldiag.config.schema.effective`)."""
        return effective(self.values, key)

    @property
    def critic_loss_scale_factor(self) -> float | None:
        return self.effective("critic.loss_scale_factor")

    @property
    def clip_low(self) -> float:
        return self.effective("actor_rollout_ref.actor.clip_ratio_low")

    @property
    def clip_high(self) -> float:
        return self.effective("actor_rollout_ref.actor.clip_ratio_high")

    def resolved(self) -> dict[str, Any]:
        """Every known setting with its resolved value: inherited nulls filled in, ``critic.enable``
        as verl's ``need_critic`` decides it."""
        out = {k: self.effective(k) for k in DEFAULTS}
        out["critic.enable"] = self.uses_critic
        return out


def known_keys() -> list[str]:
    return sorted(DEFAULTS)


def resolve_settings(
    run_dir: ReadablePath | None = None,
    overrides: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
) -> Settings:
    """Defaults, then the run's config file (or ``config``), then ``overrides``.

    Overrides must name known keys (an unknown one lists the valid keys); the config file may
    carry any other keys, which are kept but not read.
    """
    values: dict[str, Any] = dict(DEFAULTS)
    config_file = None
    configured: frozenset[str] = frozenset()
    if config is None and run_dir is not None:
        if isinstance(run_dir, str):
            if "://" in run_dir:  # the I/O layer makes object-store paths: RunDir(uri).path
                raise TypeError(f"resolve_settings takes a Path or a RemotePath, not the URI {run_dir!r}")
            run_dir = Path(run_dir)
        path = find_config_file(run_dir)
        if path is not None:
            config = load_config_file(path)
            config_file = str(path)
    if config is not None:
        flat = flatten(config) if any(isinstance(v, Mapping) for v in config.values()) else dict(config)
        src = config_file or "config"
        configured = frozenset(flat)
        for key, value in flat.items():
            values[key] = _coerce(key, value, src) if key in DEFAULTS else value
    overrides = dict(overrides or {})
    for key, value in overrides.items():
        if key not in DEFAULTS:
            close = [k for k in DEFAULTS if k.split(".")[-1] == key.split(".")[-1]]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown setting {key!r}{hint}; valid: {', '.join(known_keys())}")
        values[key] = _coerce(key, value, "the command line")
    return Settings(values=values, overrides=overrides, config_file=config_file, configured=configured)


def scenario_slug(overrides: Mapping[str, Any]) -> str:
    """Default scenario name: ``baseline`` with no overrides, else a readable slug of them.

    ``{"algorithm.adv_estimator": "rloo"}`` -> ``adv_estimator=rloo``. Each key is named by its
    last part, except keys that share their last part with another key of ``overrides``, which
    are named in full (``actor_rollout_ref.actor.loss_agg_mode=...__critic.loss_agg_mode=...``).
    """
    if not overrides:
        return "baseline"
    lasts: dict[str, int] = {}
    for key in overrides:
        lasts[key.split(".")[-1]] = lasts.get(key.split(".")[-1], 0) + 1
    parts = []
    for key in sorted(overrides):
        value = overrides[key]
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        last = key.split(".")[-1]
        parts.append(f"{key if lasts[last] > 1 else last}={text}")
    slug = "__".join(parts)
    return re.sub(r"[^A-Za-z0-9._=+-]+", "-", slug)[:120]


def unchanged_overrides(base: Settings, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The overrides that set a key to the value it already has in ``base`` (the run's own
    settings), as verl reads both (an inherited null resolved, :func:`rldiag.config.schema.effective`;
    values after ``--set`` coercion, numbers by value): a what-if on them changes nothing."""
    try:
        changed = resolve_settings(config=base.values, overrides=overrides)
    except ConfigError:
        return {}
    return {k: v for k, v in overrides.items() if same_setting(base.effective(k), changed.effective(k))}


def same_setting(a: Any, b: Any) -> bool:
    """Two values of a setting are the same: a bool only a bool, numbers by value, else ``==``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def unchanged_warning(same: Mapping[str, Any], every: bool) -> str:
    """The warning a what-if prints for overrides equal to the run's values (``every``: all of them)."""
    keys = ", ".join(f"{k}={v}" for k, v in same.items())
    tail = "; the scenario equals the run's own settings (baseline)" if every else ""
    return f"{keys}: the run already has {'this value' if len(same) == 1 else 'these values'}{tail}"
