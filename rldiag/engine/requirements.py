"""The one column planner: which batch columns each part of a recompute needs, derived from the
registries' metadata (an estimator's or a policy loss's ``needs=``, ``optional=``, ``needs_fn``)
and the stages' declarations (:mod:`rldiag.engine.stages`), never from a list written here.

- :func:`recompute_columns` (settings -> :class:`ColumnPlan`): what a recompute loads: the
  columns every stage reads (its estimator's, its policy loss's, the PPO anchor under bypass
  mode) when the file has them; the base columns and the estimator's needs are required.
- :func:`reward_kl_columns`: what the adaptive KL chain loads to replay the steps ``--steps``
  leaves out (the reward-KL stage's columns alone).
- :func:`estimator_need`, :func:`policy_loss_need`, :func:`metric_family_needs`: what
  ``rldiag check`` reports each estimator, policy loss and metric family needs.

The callers resolve the settings and pass a :class:`ColumnPlan` down to the loader
(:func:`rldiag.io.loader.load_step`), which reads the plan's columns that a file has.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rldiag.engine.policy_loss import POLICY_LOSSES
from rldiag.engine.settings import EngineSettings
from rldiag.engine.stages import REWARD_KL, STAGES, Stage
from rldiag.engine.stages.advantage import estimator_columns, estimator_optional
from rldiag.engine.stages.mismatch import MISMATCH

__all__ = [
    "BASE_NEED", "ColumnPlan", "Need", "columns_by_stage", "estimator_need", "estimator_optional",
    "metric_family_needs", "mismatch_columns", "policy_loss_need", "recompute_columns", "reward_kl_columns",
]


@dataclass(frozen=True)
class Need:
    """What a setting needs: all of ``all_of`` and at least one of each group in ``any_of``."""

    all_of: tuple[str, ...] = ()
    any_of: tuple[tuple[str, ...], ...] = ()

    def missing(self, present: Iterable[str]) -> list[str]:
        present = set(present)
        out = [c for c in self.all_of if c not in present]
        for group in self.any_of:
            if not any(c in present for c in group):
                out.append(" or ".join(group))
        return out


#: the columns every batch has: the group id, the mask, the scores (per token, or one per row)
BASE_NEED = Need(all_of=("uid", "response_mask"), any_of=(("token_level_scores", "score"),))


@dataclass(frozen=True)
class ColumnPlan:
    """The columns one load reads from a batch file.

    ``wanted``: read when the file has them; ``required``: a file lacking one of these cannot be
    loaded (``who`` needs it: the error names both). The base columns (``uid``,
    ``response_mask``, the scores) and ``step`` (checked against the file name) are always read."""

    wanted: tuple[str, ...]
    required: tuple[Need, ...] = ()
    who: str = ""

    def missing(self, names: Iterable[str]) -> list[str]:
        """The required columns a file having ``names`` lacks (a group as ``a or b``)."""
        present = set(names)
        return [c for need in self.required for c in need.missing(present)]

    def select(self, names: Iterable[str]) -> list[str]:
        """The columns to read from a file having ``names``: ``uid``, ``response_mask``, the
        scores column, those of :attr:`wanted` the file has, each once, and ``step`` last."""
        present = set(names)
        cols = ["uid", "response_mask"]
        cols.append("token_level_scores" if "token_level_scores" in present else "score")
        cols += [c for c in dict.fromkeys(self.wanted) if c in present and c not in cols and c != "step"]
        if "step" in present:
            cols.append("step")
        return cols


def estimator_need(name: str, settings: EngineSettings | None = None) -> Need:
    """Columns an advantage estimator needs beyond the base ones: its registration's ``needs=``
    (with ``settings``, also those its settings name, e.g. gdpo's reward-component columns)."""
    return Need(all_of=estimator_columns(name, settings))


def policy_loss_need(name: str) -> Need:
    """The columns ``loss_mode=name``'s ``actor/*`` metrics need (its registration's ``needs=``)."""
    return Need(all_of=tuple(POLICY_LOSSES.meta(name).needs))


def columns_by_stage(settings: EngineSettings | None = None) -> dict[str, tuple[str, ...]]:
    """Each stage's columns, required and optional (under ``settings`` when given), in stage order."""
    return {stage.name: stage.reads(settings) for stage in STAGES}


def _union(stages: Iterable[Stage], settings: EngineSettings) -> tuple[str, ...]:
    return tuple(dict.fromkeys(c for stage in stages for c in stage.reads(settings)))


def recompute_columns(settings: EngineSettings) -> ColumnPlan:
    """What a recompute under ``settings`` reads: every stage's columns that a file has (the
    estimator's ``needs`` / ``optional`` through the advantages stage), the base columns and the
    estimator's needs required."""
    name = settings.estimator
    return ColumnPlan(wanted=_union(STAGES, settings), required=(BASE_NEED, estimator_need(name, settings)), who=name)


def reward_kl_columns(settings: EngineSettings) -> ColumnPlan:
    """What the adaptive KL chain reads to replay a step's reward-KL statistic: the reward-KL
    stage's columns (π_old, ``ref_log_prob``, ``loss_mask`` when the file has it) besides the
    base ones; nothing required (a step lacking them is skipped)."""
    return ColumnPlan(wanted=_union((REWARD_KL,), settings))


def mismatch_columns(settings: EngineSettings) -> ColumnPlan:
    """What the mismatch diagnosis reads to look at a step's tokens: the mismatch stage's
    columns (both log-probs required; ``loss_mask``, ``policy_version`` when the file has them)."""
    return ColumnPlan(wanted=_union((MISMATCH,), settings), required=(BASE_NEED, Need(all_of=MISMATCH.required(settings))),
                      who="the rollout-vs-trainer mismatch diagnosis")


def metric_family_needs() -> dict[str, Need]:
    """``rldiag check``'s metric families -> the columns each needs: the stages' declared
    families (in the order the command lists them), then ``loss_mode=<key> (actor/*)`` for every
    registered policy loss."""
    families = sorted(((f, stage) for stage in STAGES for f in stage.checks), key=lambda fs: fs[0].listed)
    out = {f.label: Need(all_of=f.needs if f.needs is not None else stage.needs) for f, stage in families}
    out.update({f"loss_mode={name} (actor/*)": policy_loss_need(name) for name in POLICY_LOSSES.names()})
    return out
