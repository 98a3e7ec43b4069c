"""A run captured under a capture policy (:mod:`rldiag.capture.policy`), read honestly.

Such a run has batch files for some steps only (``RLDIAG_CAPTURE_EVERY``, ``_MAX_GB``) and, in
those, some of each step's prompt groups (``RLDIAG_CAPTURE_GROUPS``). Its ``run.yaml`` records
the policy (``rldiag.capture.every``, ``.groups``, ``.max_gb``) and each batch file its step's
groups and rows before and after sampling (Parquet metadata, ``rldiag.capture``).

What a recompute of it says (issue 38):

- per row and per group (advantages of per-group estimators, the per-row table, the per-token
  values): exact on the kept rows, since a kept group is whole;
- per step (every ``metrics.parquet`` metric: means, extremes and fractions over the step's
  rows or tokens, the layout-dependent actor and critic metrics, and per-token values that an
  estimator whitens over the whole step): an *estimate* from the kept groups on a sampled step;
- ``metrics.parquet`` gains ``rldiag/sample/groups_kept_share`` (1.0 for a whole step) and
  ``rldiag/sample/captured`` (1.0), plus a row for each logged step with no batch file
  (``captured`` 0.0, share 0.0, no other value); ``scenario.json`` gains ``"sampled_steps":
  {step: share}`` (the steps with share < 1) and ``"uncaptured_steps"``.

Nothing is added for a run captured without a policy: its outputs stay as they were.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rldiag.config.settings import Settings
from rldiag.io.capture_record import BATCH_ROWS_KEY, groups_kept_share, read_record
from rldiag.io.loader import read_schema
from rldiag.io.rundir import RunDir, StepFile, iter_metrics_lines

SHARE_KEY = "rldiag/sample/groups_kept_share"
CAPTURED_KEY = "rldiag/sample/captured"
#: verl's logged reward-KL statistic (``apply_kl_penalty``'s ``current_kl``) and coefficient
LOGGED_KL_KEY = "actor/reward_kl_penalty"


def is_sampled_run(settings: Settings | Mapping[str, Any]) -> bool:
    """Whether the run's config records a capture policy that leaves batches or groups out."""
    every = settings.get("rldiag.capture.every")
    return (every not in (None, 1) or settings.get("rldiag.capture.groups") is not None
            or settings.get("rldiag.capture.max_gb") is not None)


def step_record(sf: StepFile) -> dict[str, Any] | None:
    """A batch file's capture record (None without one, or when its footer cannot be read: its
    load reports why)."""
    try:
        return read_record(read_schema(sf).metadata)
    except Exception:  # noqa: BLE001 - the step's own load names the problem
        return None


def shares(files: Mapping[int, StepFile], steps: Iterable[int]) -> dict[int, float]:
    """``{step: share of its prompt groups in its batch file}`` for ``steps`` (1.0 without a record)."""
    return {s: groups_kept_share(step_record(files[s])) for s in steps if s in files}


def uncaptured(logged: Iterable[int], files: Mapping[int, StepFile], chosen: list[int]) -> list[int]:
    """The logged steps with no batch file, within the chosen steps' span."""
    if not chosen:
        return []
    lo, hi = min(chosen), max(chosen)
    return sorted(s for s in set(logged) if lo <= s <= hi and s not in files)


def mark_rows(metrics: list[dict[str, Any]], step_shares: Mapping[int, float], missing: list[int]) -> list[dict]:
    """The scenario's metric rows with the sample metrics added, and a row per ``missing`` step,
    in step order."""
    out = []
    for row in metrics:
        share = step_shares.get(int(row["step"]), 1.0)
        out.append({**row, SHARE_KEY: share, CAPTURED_KEY: 1.0})
    out += [{"step": s, SHARE_KEY: 0.0, CAPTURED_KEY: 0.0} for s in missing]
    return sorted(out, key=lambda r: int(r["step"]))


def scenario_keys(step_shares: Mapping[int, float], done: Iterable[int], missing: list[int]) -> dict[str, Any]:
    """``scenario.json``'s ``sampled_steps`` and ``uncaptured_steps``."""
    done = set(done)
    return {"sampled_steps": {str(s): v for s, v in sorted(step_shares.items()) if v < 1.0 and s in done},
            "uncaptured_steps": list(missing)}


def logged_kl(logged: Mapping[int, Mapping[str, float]], shares_of: Mapping[int, float],
              files: Mapping[int, StepFile]) -> dict[int, tuple[float, int]]:
    """``{step: (current_kl, rows)}``: verl's logged reward-KL statistic of each step whose batch
    file does not hold the whole batch (no file, or a sampled one), with the whole batch's rows
    (``rldiag/capture/batch_rows``): what the adaptive KL controller advanced over there."""
    out = {}
    for step, values in logged.items():
        whole = step in files and shares_of.get(step, 1.0) >= 1.0
        if whole or LOGGED_KL_KEY not in values or BATCH_ROWS_KEY not in values:
            continue
        rows = int(values[BATCH_ROWS_KEY])
        if rows > 0:
            out[step] = (float(values[LOGGED_KL_KEY]), rows)
    return out


class SampledRun:
    """What a recompute of a run captured under a capture policy needs: each chosen step's share
    of groups, the logged steps with no batch file, and (adaptive KL in reward) the logged
    statistics the controller advances over where the batch is not whole."""

    def __init__(self, shares_of: dict[int, float], missing: list[int], logged_kl_of: dict[int, tuple[float, int]]):
        self.shares, self.missing, self.logged_kl = shares_of, missing, logged_kl_of

    @classmethod
    def of(cls, rd: RunDir, settings: Settings, files: Mapping[int, StepFile], chosen: list[int]) -> SampledRun | None:
        """None for a run captured without a policy (nothing changes for it)."""
        if not is_sampled_run(settings):
            return None
        logged: dict[int, dict[str, float]] = {}
        if rd.metrics_file.exists():  # a step logged twice (a resumed run): the later line wins, name by name
            for step, values in iter_metrics_lines(rd.metrics_file):
                logged.setdefault(step, {}).update({k: float(v) for k, v in values.items()})
        step_shares = shares(files, files)
        adaptive = bool(settings["algorithm.use_kl_in_reward"]) and settings["algorithm.kl_ctrl.type"] == "adaptive"
        return cls({s: step_shares[s] for s in chosen}, uncaptured(logged, files, chosen),
                   logged_kl(logged, step_shares, files) if adaptive else {})

    def mark(self, report: Any) -> dict[str, Any]:
        """Add the sample metrics (and the uncaptured steps' rows) to ``report.metrics``; the keys
        ``scenario.json`` gains."""
        report.metrics = mark_rows(report.metrics, self.shares, self.missing)
        return scenario_keys(self.shares, report.steps_done, self.missing)

