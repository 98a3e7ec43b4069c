"""rldiag: recompute and diagnose RL post-training runs with verl's numbers.

The Python API (:mod:`rldiag.api`) is here too, imported on first use, so ``import rldiag``
stays cheap::

    import rldiag

    rloo = rldiag.recompute("runs/grpo", estimator="rloo")
    rloo.metrics  # polars frame, one row per step

``rldiag.recompute`` and ``rldiag.check`` are the API's functions even though modules of those
names exist (``from rldiag.recompute import ...`` still reaches the module; ``import
rldiag.recompute as m`` would give the function).
"""

from __future__ import annotations

import sys
import types

from rldiag.version import __version__

#: ``typing.TYPE_CHECKING`` without importing typing (type checkers take the name as true)
TYPE_CHECKING = False

__all__ = [
    "CheckResult", "CompareResult", "DiagnoseResult", "EstimatorsResult", "ImportResult", "MismatchResult",
    "RecomputeResult", "VerifyResult", "__version__", "check", "compare", "compare_estimators", "diagnose",
    "import_wandb", "logged", "mismatch", "mismatch_tokens", "recompute", "settings", "tolerances", "verify",
    "LayoutAuditResult", "layout_audit", "rows", "rows_count", "step_tokens", "step_token_frame",
    "SweepResult", "sweep", "sweep_summary", "sweeps", "FollowDoctorResult", "HealthEvent", "follow_doctor",
]
#: what ``import rldiag`` offers from :mod:`rldiag.api`, imported on first use
_API = frozenset(__all__) - {"__version__"}

if TYPE_CHECKING:
    from typing import Any

    from rldiag.api import (
        CheckResult,
        CompareResult,
        DiagnoseResult,
        EstimatorsResult,
        FollowDoctorResult,
        HealthEvent,
        ImportResult,
        LayoutAuditResult,
        MismatchResult,
        RecomputeResult,
        SweepResult,
        VerifyResult,
        check,
        compare,
        compare_estimators,
        diagnose,
        follow_doctor,
        import_wandb,
        layout_audit,
        logged,
        mismatch,
        mismatch_tokens,
        recompute,
        rows,
        rows_count,
        settings,
        step_token_frame,
        step_tokens,
        sweep,
        sweep_summary,
        sweeps,
        tolerances,
        verify,
    )


def __getattr__(name: str) -> Any:
    if name in _API:
        from rldiag import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


class _Package(types.ModuleType):
    """The ``rldiag`` package: importing its submodule ``rldiag.recompute`` (or ``rldiag.check``)
    does not replace the API function of that name (Python sets a submodule as an attribute of
    its package after importing it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
