"""W&B values -> run-directory values: history rows, metric keys, config trees.

Shared by the offline and online paths so that both give the same ``metrics.jsonl`` and
``run.yaml`` for the same run.

- A history key logged flat (``"actor/pg_clipfrac"``, verl's names) stays as it is. A value
  logged as a nested dict (``{"actor": {"kl": 0.1}}``) becomes one key per leaf, joined with
  ``sep`` (``"."`` by default, the name the W&B UI shows: ``actor.kl``). W&B media and table
  references (dicts with a ``"_type"``) stay whole.
- ``_step`` is the row's step and is not repeated in its data; ``_timestamp`` and ``_runtime``
  are kept like any other key.
- Numbers keep their JSON type: an integer stays an ``int`` (exact, any size), a float a
  ``float``; NaN and +-Infinity are kept (written as ``NaN``/``Infinity`` in JSON, as Python and
  verl's file logger write them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

#: keys of a history row that describe the row rather than hold a metric
STEP_KEY = "_step"
#: top-level config keys wandb adds for itself
WANDB_CONFIG_KEYS = ("_wandb",)


def is_media(value: Any) -> bool:
    """A W&B media / table / histogram reference: a dict with a ``_type``."""
    return isinstance(value, Mapping) and "_type" in value


def flatten_into(out: dict[str, Any], path: Sequence[str], value: Any, sep: str) -> None:
    """Put ``value`` under the key ``path`` joined with ``sep``; nested dicts become one key per leaf."""
    if isinstance(value, Mapping) and value and not is_media(value):
        for k, v in value.items():
            flatten_into(out, (*path, str(k)), v, sep)
        return
    out[sep.join(path)] = value


def flatten_row(row: Mapping[str, Any], sep: str = ".") -> dict[str, Any]:
    """A history row with nested dicts (as the public API returns them) as flat keys."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        flatten_into(out, (str(k),), v, sep)
    return out


def step_of(row: Mapping[str, Any]) -> int | None:
    """The row's ``_step`` as an int, or None when it has none."""
    step = row.get(STEP_KEY)
    if isinstance(step, bool) or step is None:
        return None
    if isinstance(step, int):
        return step
    if isinstance(step, float) and math.isfinite(step) and step == int(step):
        return int(step)
    return None


def _parse_int(text: str) -> Any:
    # wandb-core writes a logged -0.0 as "-0"; no integer is negative zero, so it was a float.
    return -0.0 if text == "-0" else int(text)


_DECODER = json.JSONDecoder(parse_int=_parse_int)


def _decode(text: str) -> Any:
    try:
        return _DECODER.decode(text)
    except RecursionError:  # nested deeper than Python's stack: not a value rldiag can keep
        raise ValueError("JSON nested too deeply") from None


def parse_json(text: str) -> Any:
    """Decode one ``value_json``; NaN and +-Infinity are accepted as wandb writes them.
    ValueError when it is not JSON (or is nested too deeply to decode)."""
    return _decode(text)


def parse_json_many(texts: list[str]) -> list[Any]:
    """Decode several ``value_json`` texts with one parser call (a history row's values).

    Raises ValueError when any of them is not one JSON value.
    """
    values = _decode("[" + ",".join(texts) + "]")
    if len(values) != len(texts):
        raise ValueError("a value is not one JSON value")
    return values


def plain(value: Any) -> Any:
    """``value`` as plain JSON/YAML data (dict with str keys, list, str, int, float, bool, None)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return plain(item())
        except (TypeError, ValueError):
            pass
    return str(value)


def _wrapped(value: Any) -> bool:
    return isinstance(value, Mapping) and "value" in value and set(value) <= {"value", "desc"}


def unwrap_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run config as verl's nested tree.

    The W&B backend stores every top-level key as ``{"value": ..., "desc": ...}``. When all of
    them are wrapped that way (the raw form), the wrappers are removed; a config where any
    top-level value is not wrapped is already plain (the public API unwraps it) and is kept as
    it is, so a key that legitimately holds ``{"value": ...}`` is never mangled. wandb's own
    ``_wandb`` key is dropped. Nested keys stay nested.
    """
    items = [(str(k), v) for k, v in config.items() if str(k) not in WANDB_CONFIG_KEYS]
    raw = bool(items) and all(_wrapped(v) for _, v in items)
    return {k: plain(v["value"] if raw else v) for k, v in items}


def set_path(tree: dict[str, Any], path: Sequence[str], value: Any) -> None:
    """``tree[path[0]][path[1]]... = value``, making dicts on the way."""
    node = tree
    for k in path[:-1]:
        nxt = node.get(k)
        if not isinstance(nxt, dict):
            nxt = {}
            node[k] = nxt
        node = nxt
    node[path[-1]] = value


def remove_path(tree: dict[str, Any], path: Sequence[str]) -> None:
    node: Any = tree
    for k in path[:-1]:
        node = node.get(k) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(path[-1], None)
