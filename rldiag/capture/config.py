"""A trainer's config -> ``run.yaml`` (safe YAML, verl's nested keys).

Accepted, duck-typed: a mapping (nested dicts), an object with a ``to_container()`` method, an
OmegaConf ``DictConfig`` (converted with ``OmegaConf.to_container(resolve=True)`` when omegaconf
is importable; it is never a dependency), or a dataclass. Leaves that safe YAML cannot hold
(numpy scalars, tensors, enums, paths, ...) become plain numbers or strings.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import yaml

from rldiag.errors import CaptureError
from rldiag.io.run_layout import RUN_CONFIG
from rldiag.io.staged import replace_bytes


def _container(cfg: Any) -> Any:
    to_container = getattr(cfg, "to_container", None)
    if callable(to_container):
        try:
            return to_container(resolve=True)
        except TypeError:
            return to_container()
    if type(cfg).__module__.startswith("omegaconf"):
        try:
            from omegaconf import OmegaConf

            return OmegaConf.to_container(cfg, resolve=True)
        except ImportError:  # pragma: no cover - an OmegaConf object without omegaconf
            pass
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    return cfg


def plain(value: Any) -> Any:
    """``value`` as nested dicts / lists / str / int / float / bool / None."""
    value = _container(value)
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, enum.Enum):
        return plain(value.value)
    for kind in (bool, int, float, str):  # subclasses (numpy.float64, ...) -> the built-in type
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, PurePath):
        return str(value)
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(value, "ndim", 1) == 0:
        return plain(item())
    tolist = getattr(value, "tolist", None)  # small arrays
    if callable(tolist):
        return plain(tolist())
    return str(value)


def config_yaml(config: Any) -> str:
    """The YAML text of ``config``; its top level must be a mapping."""
    tree = plain(config)
    if not isinstance(tree, dict):
        raise CaptureError(f"the config must be a mapping at the top, not {type(tree).__name__}")
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=False)


def write_config(run_dir: Path, config: Any, name: str = RUN_CONFIG) -> Path:
    """Write ``config`` to ``run_dir/run.yaml`` atomically; returns the path."""
    path = Path(run_dir) / name
    replace_bytes(path, config_yaml(config).encode("utf-8"))
    return path
