"""``rldiag doctor``: health rules over a run's logged and recomputed metrics.

Use :func:`diagnose` from Python (the CLI and the app only format its report)."""

from rldiag.doctor.counterfactual import counterfactuals
from rldiag.doctor.doctor import DoctorReport, diagnose
from rldiag.doctor.evaluators import Evidence, Finding
from rldiag.doctor.rule import Rule
from rldiag.doctor.rules import load_rules

__all__ = ["DoctorReport", "Evidence", "Finding", "Rule", "counterfactuals", "diagnose", "load_rules"]
