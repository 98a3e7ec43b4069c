"""The valid values of a string setting, from the one place each is declared: the engine registry
its schema row names (``choices="ESTIMATORS"``: the registry's keys), else the row's own
``values``. The registries are imported when asked for (the engine imports torch), never when
the settings are read.
"""

from __future__ import annotations

import importlib

from rldiag.config.schema import BY_KEY, Setting
from rldiag.registry import Registry

#: the registries a schema row's ``choices`` may name, as ``module:attribute``
REGISTRIES: dict[str, str] = {
    "ESTIMATORS": "rldiag.engine.advantage:ESTIMATORS",
    "AGG_MODES": "rldiag.engine.aggregation:AGG_MODES",
    "KL_ESTIMATORS": "rldiag.engine.kl:KL_ESTIMATORS",
    "POLICY_LOSSES": "rldiag.engine.policy_loss:POLICY_LOSSES",
    "IS_LEVELS": "rldiag.engine.rollout_correction:IS_LEVELS",
    "RS_OPTIONS": "rldiag.engine.rollout_correction:RS_OPTIONS",
}


def registry(name: str) -> Registry:
    """The registry a schema row's ``choices`` names."""
    module, attr = REGISTRIES[name].split(":")
    return getattr(importlib.import_module(module), attr)


def choices(setting: Setting | str) -> list[str] | None:
    """The values ``setting`` (a row or its key) takes: its registry's keys, else its ``values``;
    None for a setting whose values no list bounds (a number, a free string)."""
    row = BY_KEY[setting] if isinstance(setting, str) else setting
    if row.choices is not None:
        return registry(row.choices).names()
    return list(row.values) if row.values else None


def grouped_estimators() -> list[str]:
    """The advantage estimators whose baseline is the other responses of the same prompt (the uid
    group): those registered with ``grouped=True``."""
    reg = registry("ESTIMATORS")
    return [name for name in reg.names() if reg.meta(name).grouped]
