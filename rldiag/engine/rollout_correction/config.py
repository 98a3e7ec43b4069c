"""The rollout-correction settings: ``rollout_is_threshold`` and ``rollout_rs`` /
``rollout_rs_threshold`` parsed as verl reads them, and :class:`CorrectionConfig` (one block,
checked against :data:`IS_LEVELS` and :data:`RS_OPTIONS`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rldiag.engine.rollout_correction.rejection import RS_OPTIONS
from rldiag.engine.rollout_correction.weights import IS_LEVELS
from rldiag.errors import ConfigError, UnknownKeyError


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """``rollout_is_threshold`` -> ``(upper, lower)``; ``lower`` is None for TIS (one number)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ConfigError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower: float | None = None
    try:
        if isinstance(spec, str):
            text = spec.strip()
            if not text:
                raise ConfigError("rollout_is_threshold must not be an empty string")
            if "_" in text:
                lo, up = text.split("_", 1)
                lower, upper = float(lo), float(up)
            else:
                upper = float(text)
        else:
            upper = float(spec)
    except ValueError:
        raise ConfigError(f"invalid rollout_is_threshold {spec!r}") from None
    if not upper > 0:
        raise ConfigError(f"rollout_is_threshold upper bound must be positive, got {upper}")
    if lower is not None:
        if not lower > 0:
            raise ConfigError(f"rollout_is_threshold lower bound must be positive, got {lower}")
        if lower > upper:
            raise ConfigError("rollout_is_threshold lower bound must be <= upper bound")
    return upper, lower


def parse_rs(options_spec: Any, threshold_spec: Any) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs`` (comma list, duplicates dropped) and ``rollout_rs_threshold`` (one value
    for all, or one per option) -> ``{option: (lower, upper)}`` in verl's units: k1 options
    carry ratio bounds (``lower`` = ``1/upper`` unless given as ``lower_upper``); the others an
    upper bound only."""
    if not isinstance(options_spec, str):
        raise ConfigError(f"rollout_rs must be a string of comma separated options, got {options_spec!r}")
    options = list(dict.fromkeys(o.strip() for o in options_spec.split(",") if o.strip()))
    if not options:
        raise ConfigError("rollout_rs must contain at least one option")
    for opt in options:
        if opt not in RS_OPTIONS:
            raise UnknownKeyError("rollout_rs option", opt, RS_OPTIONS.names())
    if threshold_spec is None:
        raise ConfigError("rollout_rs_threshold must be provided when rollout_rs is set")
    if isinstance(threshold_spec, (int, float)):
        specs = [str(threshold_spec)]
    elif isinstance(threshold_spec, str):
        specs = [p.strip() for p in threshold_spec.split(",") if p.strip()]
    else:
        raise ConfigError(f"rollout_rs_threshold must be a number or a string, got {threshold_spec!r}")
    if not specs:
        raise ConfigError("rollout_rs_threshold must contain at least one threshold value")
    if len(specs) not in (1, len(options)):
        raise ConfigError(
            f"rollout_rs_threshold needs one threshold shared by all options or exactly {len(options)} "
            f"(one per rollout_rs option {options}), got {len(specs)}"
        )
    if len(specs) == 1:
        specs = specs * len(options)
    out: dict[str, tuple[float | None, float]] = {}
    for opt, spec in zip(options, specs):
        try:
            if opt.endswith("k1"):
                lo_s, up_s = spec.split("_", 1) if "_" in spec else (str(1.0 / float(spec)), spec)
                lower, upper = float(lo_s), float(up_s)
                if lower <= 0 or upper <= 0:
                    raise ConfigError(f"rollout_rs_threshold for {opt!r} must be positive, got {spec!r}")
                out[opt] = (lower, upper)
            else:
                if "_" in spec:
                    raise ConfigError(f"rollout_rs_threshold for {opt!r} takes a single upper bound, got {spec!r}")
                upper = float(spec)
                if upper <= 0:
                    raise ConfigError(f"rollout_rs_threshold for {opt!r} must be positive, got {spec!r}")
                out[opt] = (None, upper)
        except (ValueError, ZeroDivisionError):
            raise ConfigError(f"invalid rollout_rs_threshold {spec!r} for option {opt!r}") from None
    return out


@dataclass(frozen=True)
class CorrectionConfig:
    """A parsed rollout-correction block (verl's ``RolloutCorrectionConfig``)."""

    rollout_is: str | None = None
    is_upper: float = 2.0
    is_lower: float | None = None
    batch_normalize: bool = False
    rs: dict[str, tuple[float | None, float]] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | Any, prefix: str) -> CorrectionConfig:
        """Read ``<prefix>.rollout_is``, ``.rollout_is_threshold``, ``.rollout_is_batch_normalize``,
        ``.rollout_rs``, ``.rollout_rs_threshold``; errors as verl raises them, as ConfigError."""
        level = settings[f"{prefix}.rollout_is"]
        threshold = settings[f"{prefix}.rollout_is_threshold"]
        if level is not None and threshold is not None:  # verl skips IS when either is null
            IS_LEVELS.get(level)
            upper, lower = parse_is_threshold(threshold)
        else:
            level, upper, lower = None, 2.0, None
        rs_spec = settings[f"{prefix}.rollout_rs"]
        rs = parse_rs(rs_spec, settings[f"{prefix}.rollout_rs_threshold"]) if rs_spec is not None else {}
        return cls(level, upper, lower, bool(settings[f"{prefix}.rollout_is_batch_normalize"]), rs)

    @property
    def active(self) -> bool:
        """IS weights or rejection enabled (diagnostics are computed either way)."""
        return self.rollout_is is not None or bool(self.rs)
