"""Reference bands: where published figures put a metric, and where a run's value sits in them.

The bands are declared once, in ``bands.yaml`` beside this module: per band the ``metric`` (a
name the engine's stages declare, :data:`rldiag.engine.stages.STAGES`), its ``band`` name,
``low`` and ``high`` (inclusive; null for an open side), the ``conditions`` that select it and
the ``source`` (a URL, or a repository file and line). The file is read through the bounded safe
YAML loader and checked when loaded: an unknown metric, ``low > high``, an unknown condition or
condition value is a :class:`~rldiag.errors.ConfigError` naming the file and the entry.

Conditions (:data:`CONDITIONS`) are read from the run's resolved settings (the schema's keys and
any other key the run's config carries) by :func:`run_conditions`:

- ``model``: ``dense`` or ``moe``: the run config's ``rldiag.model`` when it says so, else ``moe``
  when ``actor_rollout_ref.actor.megatron.expert_model_parallel_size`` > 1 (expert parallelism
  only exists for MoE models), else unknown;
- ``precision``: the rollout copy's dtype, ``actor_rollout_ref.rollout.dtype`` (``bf16``,
  ``fp16`` or ``fp32``), unknown when the config does not carry it;
- ``mini_batches``: mini-batches per step, ``data.train_batch_size`` //
  ``actor_rollout_ref.actor.ppo_mini_batch_size`` (both in prompts, as verl counts them);
- ``ppo_epochs``: ``actor_rollout_ref.actor.ppo_epochs``;
- ``policy``: ``on`` when a step makes one update on its own batch (one mini-batch, one epoch),
  ``off`` otherwise.

A band whose condition contradicts the run's settings does not apply; one whose condition is
unknown for the run is still reported, under its name ("above the dense band, inside the MoE
band"), so that the reader sees which it would be. :func:`place` gives one placement;
:func:`render_markdown` the docs table (``python -m rldiag.doctor.bands`` prints it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from rldiag.config.yaml_bounded import load_yaml
from rldiag.errors import ConfigError

BANDS_FILE = Path(__file__).with_name("bands.yaml")

#: every condition a band may name, with the values it takes (None: any positive integer)
CONDITIONS: dict[str, tuple[str, ...] | None] = {
    "model": ("dense", "moe"),
    "precision": ("bf16", "fp16", "fp32"),
    "policy": ("on", "off"),
    "mini_batches": None,
    "ppo_epochs": None,
}
KEYS = ("metric", "band", "low", "high", "conditions", "source")
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "fp32": "fp32", "float": "fp32"}


@dataclass(frozen=True)
class Band:
    metric: str
    band: str
    low: float | None
    high: float | None
    source: str
    conditions: dict[str, Any] = field(default_factory=dict)

    def where(self, value: float) -> str:
        """``below``, ``inside`` or ``above`` (NaN: ``undefined``)."""
        if math.isnan(value):
            return "undefined"
        if self.low is not None and value < self.low:
            return "below"
        if self.high is not None and value > self.high:
            return "above"
        return "inside"


def _number(v: Any, where: str, key: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}: '{key}' must be a finite number or null, got {v!r}")
    return float(v)


def _declared(metric: str) -> bool:
    from rldiag.engine.stages import STAGES, pattern_regex

    return any(pattern_regex(m.name).fullmatch(metric) for s in STAGES for m in s.metrics)


def _condition(key: Any, value: Any, where: str) -> Any:
    if key not in CONDITIONS:
        raise ConfigError(f"{where}: unknown condition {key!r}; valid: {', '.join(CONDITIONS)}")
    allowed = CONDITIONS[key]
    if allowed is None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: condition {key!r} takes a positive integer, got {value!r}")
        return value
    if value not in allowed:
        raise ConfigError(f"{where}: condition {key!r} takes {' or '.join(allowed)}, got {value!r}")
    return value


def parse_bands(doc: Any, origin: str) -> list[Band]:
    """The bands of a parsed ``bands.yaml`` document, each checked; ``origin`` names the file."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("bands"), list):
        raise ConfigError(f"bands file {origin} must hold a mapping with a list under 'bands:'")
    out = []
    for i, raw in enumerate(doc["bands"]):
        where = f"bands file {origin}, entry #{i + 1}"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: every entry is a mapping")
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; valid: {', '.join(KEYS)}")
        for key in ("metric", "band", "source"):
            if not isinstance(raw.get(key), str) or not raw[key].strip():
                raise ConfigError(f"{where}: '{key}' is required (a string)")
        where = f"{where} ({raw['metric']}, {raw['band']})"
        if not _declared(raw["metric"]):
            raise ConfigError(f"{where}: unknown metric {raw['metric']!r} (not declared by any engine stage; "
                              "see docs/metrics.md)")
        low, high = _number(raw.get("low"), where, "low"), _number(raw.get("high"), where, "high")
        if low is None and high is None:
            raise ConfigError(f"{where}: 'low' and 'high' cannot both be null")
        if low is not None and high is not None and low > high:
            raise ConfigError(f"{where}: low {low:g} is above high {high:g}")
        cond = raw.get("conditions") or {}
        if not isinstance(cond, Mapping):
            raise ConfigError(f"{where}: 'conditions' must map conditions to values")
        conditions = {str(k): _condition(k, v, where) for k, v in cond.items()}
        out.append(Band(raw["metric"], raw["band"], low, high, " ".join(raw["source"].split()), conditions))
    return out


def read_bands(path: Path) -> list[Band]:
    """The checked bands of the file at ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"bands file {path}: cannot be read ({exc})") from None
    return parse_bands(load_yaml(text, f"bands file {path}"), str(path))


@cache
def builtin_bands() -> tuple[Band, ...]:
    """The shipped bands (``bands.yaml``), read once."""
    return tuple(read_bands(BANDS_FILE))


def bands_for(metric: str, bands: Sequence[Band] | None = None) -> list[Band]:
    return [b for b in (builtin_bands() if bands is None else bands) if b.metric == metric]


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def run_conditions(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Each condition's value for a run's resolved settings (None: the settings do not say)."""
    model = settings.get("rldiag.model")
    if model not in ("dense", "moe"):
        ep = _int(settings.get("actor_rollout_ref.actor.megatron.expert_model_parallel_size"))
        model = "moe" if ep is not None and ep > 1 else None
    dtype = settings.get("actor_rollout_ref.rollout.dtype")
    batch = _int(settings.get("data.train_batch_size"))
    mini = _int(settings.get("actor_rollout_ref.actor.ppo_mini_batch_size"))
    minis = batch // mini if batch and mini and mini > 0 else None
    epochs = _int(settings.get("actor_rollout_ref.actor.ppo_epochs"))
    policy = None
    if (minis is not None and minis > 1) or (epochs is not None and epochs > 1):
        policy = "off"
    elif minis == 1 and epochs == 1:
        policy = "on"
    return {"model": model, "precision": _DTYPES.get(str(dtype).lower()) if dtype is not None else None,
            "policy": policy, "mini_batches": minis, "ppo_epochs": epochs}


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def place(metric: str, value: float, settings: Mapping[str, Any],
          bands: Sequence[Band] | None = None) -> dict[str, Any]:
    """Where ``value`` of ``metric`` sits among its bands under ``settings``.

    Returns ``{"metric", "value", "bands": [{"band", "low", "high", "where", "source",
    "conditions", "assumed"}], "text"}``: one entry per band whose conditions the run does not
    contradict (``assumed``: the conditions the settings do not decide), and a line such as
    ``rollout_corr/k3_kl 0.003: above the dense band, inside the MoE band``; without a band,
    ``bands`` is empty and the line says ``no reference band``."""
    have = run_conditions(settings)
    rows = []
    for b in bands_for(metric, bands):
        if any(have.get(k) is not None and have[k] != v for k, v in b.conditions.items()):
            continue
        assumed = sorted(k for k in b.conditions if have.get(k) is None)
        rows.append({"band": b.band, "low": b.low, "high": b.high, "where": b.where(value), "source": b.source,
                     "conditions": dict(b.conditions), "assumed": assumed})
    if rows:
        parts = [f"{r['where']} the {r['band']} band {_bounds(r)}" for r in rows]
        text = f"{metric} {_fmt(value)}: {', '.join(parts)}"
    else:
        text = f"{metric} {_fmt(value)}: no reference band"
    return {"metric": metric, "value": value, "bands": rows, "text": text}


def _bounds(row: Mapping[str, Any]) -> str:
    lo = "-inf" if row["low"] is None else f"{row['low']:g}"
    hi = "inf" if row["high"] is None else f"{row['high']:g}"
    return f"[{lo}, {hi}]"


def band_metrics(bands: Sequence[Band] | None = None) -> list[str]:
    """The metrics with a band, in the file's order."""
    return list(dict.fromkeys(b.metric for b in (builtin_bands() if bands is None else bands)))


def place_means(values: Mapping[str, Sequence[float]], settings: Mapping[str, Any],
                bands: Sequence[Band] | None = None) -> list[dict[str, Any]]:
    """For each metric of ``values`` (``metric -> per-step values``) that has a band: the mean of
    its finite values placed by :func:`place`, with ``steps`` (how many) and ``statistic``;
    metrics without a band or without a finite value are left out."""
    out = []
    for metric, vals in values.items():
        finite = [float(v) for v in vals if v is not None and math.isfinite(float(v))]
        if not finite or not bands_for(metric, bands):
            continue
        mean = math.fsum(finite) / len(finite)
        out.append({**place(metric, mean, settings, bands), "steps": len(finite),
                    "statistic": f"mean over {len(finite)} steps"})
    return out


def render_markdown(bands: Sequence[Band] | None = None) -> str:
    """The bands table of ``docs/bands.md``."""
    lines = ["| metric | band | low | high | conditions | source |", "| --- | --- | --- | --- | --- | --- |"]
    for b in builtin_bands() if bands is None else bands:
        cond = ", ".join(f"{k}={v}" for k, v in b.conditions.items()) or "any run"
        lo = "" if b.low is None else f"{b.low:g}"
        hi = "" if b.high is None else f"{b.high:g}"
        lines.append(f"| `{b.metric}` | {b.band} | {lo} | {hi} | {cond} | {b.source.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
