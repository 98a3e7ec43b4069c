"""The engine's stages in verl's order of operations (:data:`STAGES`), each with its declaration
(:class:`~rldiag.engine.stages.base.Stage`): the columns it reads, the settings keys, the metrics
and token outputs it writes. :func:`rldiag.engine.pipeline.recompute_batch` runs them in order
over one :class:`~rldiag.engine.stages.base.State`.

The modules: :mod:`.base` (the declaration types, the shared state, metric-name patterns),
:mod:`.reward` (anchor, reward KL, rollout correction), :mod:`.advantage` (advantages, data
metrics), :mod:`.actor` (micro-batch layout, policy / entropy / KL losses, their total, the
old-policy metrics), :mod:`.critic` (value loss), :mod:`.filter` (the group filter, the outcome
gate, the no-signal groups' denominator, the gradient weight they drop), :mod:`.signals` (rldiag's
reference KL and group signals), :mod:`.health` (the gradient weight's concentration, empty and
repetitive outputs, the score's spread, reward components), :mod:`.mismatch` (the rollout-vs-trainer mismatch fingerprints),
:mod:`.diag_is` (diagnostic IS weights, never in the loss), :mod:`.turns` (per-turn statistics; the
policy loss's part in ``turns_loss``), :mod:`.rows` (per-row values; the loss's in ``rows_loss``).
``python -m rldiag.engine.stages`` prints docs/metrics.md's table.
"""

from __future__ import annotations

from rldiag.engine.stages.actor import ACTOR_LOSS, ENTROPY_LOSS, KL_LOSS, LAYOUT, OLD_POLICY, TOTAL_LOSS
from rldiag.engine.stages.advantage import ADVANTAGES, DATA_METRICS
from rldiag.engine.stages.base import CheckFamily, Metric, Stage, State, expand, pattern_regex
from rldiag.engine.stages.critic import CRITIC
from rldiag.engine.stages.diag_is import DIAG_IS
from rldiag.engine.stages.filter import FILTER, FILTER_WEIGHT
from rldiag.engine.stages.health import HEALTH
from rldiag.engine.stages.mismatch import MISMATCH
from rldiag.engine.stages.reward import ANCHOR, REWARD_KL, ROLLOUT_CORRECTION
from rldiag.engine.stages.rows import ROWS, ROWS_LOSS
from rldiag.engine.stages.signals import GROUP_SIGNAL, REF_KL
from rldiag.engine.stages.turns import TURNS, TURNS_LOSS

#: verl's order of operations (V1 trainer): pi_old, KL in the reward, rollout correction,
#: advantages, data metrics, then the actor's and the critic's updates; rldiag's own last. The
#: filters (stages/filter.py; nothing without their keys) drop rows before the advantages and,
#: for the no-signal groups, before the actor's loss
STAGES: tuple[Stage, ...] = (
    ANCHOR,
    REWARD_KL,
    ROLLOUT_CORRECTION,
    DIAG_IS,
    FILTER,
    ADVANTAGES,
    DATA_METRICS,
    LAYOUT,
    FILTER_WEIGHT,
    ACTOR_LOSS,
    ENTROPY_LOSS,
    KL_LOSS,
    CRITIC,
    TOTAL_LOSS,
    OLD_POLICY,
    TURNS,
    TURNS_LOSS,
    REF_KL,
    GROUP_SIGNAL,
    HEALTH,
    MISMATCH,
    ROWS,
    ROWS_LOSS,
)

__all__ = ["STAGES", "CheckFamily", "Metric", "Stage", "State", "expand", "markdown_table", "pattern_regex"]


def _columns(cols: tuple[str, ...]) -> str:
    return ", ".join(f"`{c}`" for c in cols)


def markdown_table(stages: tuple[Stage, ...] = STAGES) -> str:
    """docs/metrics.md's table: one row per metric (or pattern) each stage writes, in stage
    order: the name, its meaning, its family, the stage, and what it needs (columns, setting)."""
    lines = ["| metric | meaning | family | stage | needs |", "| --- | --- | --- | --- | --- |"]
    for stage in stages:
        for m in stage.metrics:
            cols = tuple(dict.fromkeys(stage.needs + m.needs))
            needs = "; ".join(p for p in (_columns(cols), m.when) if p) or "always"
            meaning = m.meaning.replace("|", "\\|")  # a pipe would end the cell
            lines.append(f"| `{m.name}` | {meaning} | {m.family} | {stage.name} | {needs} |")
    return "\n".join(lines) + "\n"
