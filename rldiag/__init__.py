"""rldiag: recompute and diagnose RL post-training runs with verl's numbers.

The Python API (:mod:`rldiag.api`) is here too, imported on first use, so ``import rldiag``
stays cheap::

    import rldiag

    rloo = rldiag.recompute("runs/grpo", estimator="rloo")
    rloo.metrics  # polars frame, one row per step

``rldiag.<name>`` is ``rldiag.api.<name>`` for every name of ``rldiag.api.__all__`` (declared
there once); no module or package directly under ``rldiag/`` is named like one of them.
"""

from __future__ import annotations

from rldiag.version import __version__ as __version__

#: ``typing.TYPE_CHECKING`` without importing typing (type checkers take the name as true)
TYPE_CHECKING = False

if TYPE_CHECKING:
    from typing import Any

    from rldiag.api import *  # noqa: F403 - the API's names, for type checkers

#: the names offered besides the API's (``__all__`` is ``rldiag.api.__all__`` plus these)
_OWN = ("__version__",)


def __getattr__(name: str) -> Any:
    # ``__all__`` too (``from rldiag import *``): the API's list, read on first use
    if name == "api" or (name.startswith("__") and name != "__all__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # (a submodule: imported as such)
    api = _api()

    if name == "__all__":
        return [*_OWN, *api.__all__]
    if name in api.__all__:
        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_api().__all__})


def _api() -> Any:
    from importlib import import_module

    return import_module("rldiag.api")
