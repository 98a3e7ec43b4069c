"""The debugging order for "reward looks fine but the model does not learn",
evaluated on one step from :class:`rldiag.store.StepFacts`.

Eight checks, in this order: score totals, reward shaping, masks stage by stage, group
sizes (single- vs multi-output agent loops), groups without signal, the advantages' spread,
REINFORCE++ credit cut by mask-0 spans, and only then ratio / clip fraction / loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rldiag.store import StepFacts

OK, WARN, FAIL, INFO, NA = "ok", "warn", "fail", "info", "n/a"
ICONS = {OK: "✅", WARN: "⚠️", FAIL: "❌", INFO: "ℹ️", NA: "➖"}
#: the same in Streamlit markdown (Material icons ship with Streamlit; emoji need a system font)
MD_ICONS = {OK: ":green[:material/check_circle:]", WARN: ":orange[:material/warning:]", FAIL: ":red[:material/cancel:]",
            INFO: ":blue[:material/info:]", NA: ":gray[:material/remove_circle_outline:]"}

#: estimators that reset the return at every mask 0
RESETTING = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
#: estimators whose baseline is a value function, not the group
CRITIC_BASED = ("gae",)
#: above this share of groups without signal the step mostly does not learn
FLAT_WARN = 0.5
#: ratio of the largest reward change to the largest |score| that counts as large
REWARD_CHANGE_WARN = 0.5
#: share of positive advantages outside [LOW, 1 - LOW] is one-sided
ONE_SIDED = 0.05
#: the metrics check 8 judges against the doctor's rules (their healthy side: ``rldiag.api.rule_limits()``,
#: the one source of every healthy band the app quotes; the checklist has no numbers of its own)
JUDGED = ("actor/pg_clipfrac", "actor/ppo_kl")


@dataclass(frozen=True)
class Check:
    order: int
    title: str
    status: str
    finding: str

    @property
    def icon(self) -> str:
        return ICONS[self.status]

    @property
    def markdown(self) -> str:
        """One line of Streamlit markdown: icon, number, title, finding."""
        return f"{MD_ICONS[self.status]} **{self.order}. {self.title}** — {self.finding}"


def _g(v: float | None, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}g}"


def _pct(num: int, den: int) -> str:
    return f"{100 * num / den:.0f}%" if den else "–"


def check_scores(f: StepFacts) -> Check:
    t = "rm_scores.sum(-1) is the trajectory total you expect"
    if f.score_nonfinite:
        return Check(1, t, FAIL, f"{f.score_nonfinite} of {f.rows} rows have a missing or non-finite score total.")
    if f.score_vs_scalar_mismatch:
        return Check(1, t, FAIL, f"{f.score_vs_scalar_mismatch} rows: token_level_scores sums to something other "
                                 "than their `score`.")
    if f.rows and f.score_zero_rows == f.rows:
        return Check(1, t, WARN, f"All {f.rows} rows score 0: no reward reaches this step.")
    return Check(1, t, OK, f"Row totals from {_g(f.score_min)} to {_g(f.score_max)}, mean {_g(f.score_mean)}; "
                           f"{f.score_zero_rows} of {f.rows} rows score 0.")


def check_rewards(f: StepFacts) -> Check:
    t = "token_level_rewards.sum(-1) keeps the scores' sign and scale (KL in reward)"
    if f.scenario is None or not f.rewards_compared:
        return Check(2, t, NA, "Needs a scenario with saved tokens for this step.")
    if f.rewards_sign_flips:
        return Check(2, t, FAIL, f"KL shaping flips the sign of {f.rewards_sign_flips} of {f.rewards_compared} "
                                 f"rows' reward (scenario {f.scenario}).")
    change = f.rewards_max_abs_change or 0.0
    scale = max(abs(f.score_min or 0.0), abs(f.score_max or 0.0))
    if change == 0:
        return Check(2, t, OK, f"Rewards equal the scores (scenario {f.scenario}: no KL in reward).")
    if scale > 0 and change > REWARD_CHANGE_WARN * scale:
        return Check(2, t, WARN, f"KL shaping moves a row total by up to {_g(change)}, "
                                 f"{100 * change / scale:.0f}% of the largest |score|.")
    return Check(2, t, OK, f"KL shaping moves row totals by at most {_g(change)} (largest |score| {_g(scale)}).")


def check_masks(f: StepFacts) -> Check:
    t = "Masks at each stage: agent loop, rollout correction, loss_mask"
    if f.unmasked_tokens:
        return Check(3, t, FAIL, f"{f.unmasked_tokens} tokens with response_mask 0 in the batch are 1 after "
                                 f"rollout correction (scenario {f.scenario}); correction may only zero tokens.")
    if f.rows_outside_loss_mask:
        return Check(3, t, FAIL, f"{f.rows_outside_loss_mask} rows have response_mask tokens that loss_mask (the "
                                 "mask before rollout correction) leaves out; correction may only drop tokens.")
    parts = [f"{f.actor_tokens} actor tokens; tool spans in {f.tool_rows} of {f.rows} rows ({f.tool_tokens} tokens)"]
    if f.rejected_before_capture:
        parts.append(f"{f.rejected_before_capture} tokens of loss_mask were rejected before the capture")
    if f.rejected_tokens is not None:
        parts.append(f"rollout correction zeroed {f.rejected_tokens} assistant tokens")
    if f.rows_outside_loss_mask == 0:
        parts.append("response_mask lies within loss_mask")
    if f.rows_without_actor:
        return Check(3, t, WARN, f"{f.rows_without_actor} rows have no actor token at all. " + "; ".join(parts) + ".")
    return Check(3, t, OK, "; ".join(parts) + ".")


def check_group_sizes(f: StepFacts, estimator: str, rollout_n: int | None) -> Check:
    t = "Group sizes: single-output (rollout.n rows per uid) or multi-output"
    sizes = ", ".join(f"{c}×{n}" for n, c in sorted(f.group_sizes.items()))
    if f.sessions is not None:
        return Check(4, t, INFO, f"Multi-output agent loop: {f.sessions} sessions over {f.groups} uids (rows per uid: "
                                 f"{sizes}). grpo groups the session-final outputs by {{uid}}_{{session_id}}; other "
                                 "group estimators see every output row, so groups can exceed rollout.n.")
    singletons = f.group_sizes.get(1, 0)
    if singletons and estimator not in CRITIC_BASED:
        return Check(4, t, WARN, f"{singletons} of {f.groups} groups have a single row: {estimator} gives them no "
                                 f"relative signal. Rows per uid: {sizes}.")
    if rollout_n is not None and set(f.group_sizes) != {rollout_n}:
        return Check(4, t, WARN, f"Rows per uid ({sizes}) differ from rollout.n = {rollout_n}.")
    if len(f.group_sizes) > 1:
        return Check(4, t, WARN, f"Groups of uneven size: {sizes} (groups×rows).")
    return Check(4, t, OK, f"{f.groups} groups of {next(iter(f.group_sizes), 0)} rows.")


def check_flat_groups(f: StepFacts, estimator: str) -> Check:
    t = "GRPO/RLOO groups with identical scores carry no relative signal"
    if not f.multi_groups:
        return Check(5, t, NA, "No group has two rows or more.")
    share = f.flat_groups / f.multi_groups
    msg = f"{f.flat_groups} of {f.multi_groups} groups ({_pct(f.flat_groups, f.multi_groups)}) have identical scores."
    if estimator in CRITIC_BASED:
        return Check(5, t, INFO, msg + f" ({estimator} uses a critic baseline, so they still learn.)")
    if f.flat_groups == f.multi_groups:
        return Check(5, t, FAIL, msg + " No group has a relative signal: nothing to learn from this step.")
    if share >= FLAT_WARN:
        return Check(5, t, WARN, msg)
    return Check(5, t, OK, msg)


def check_advantages(f: StepFacts) -> Check:
    t = "advantages[response_mask]: mean, spread, share positive"
    if f.adv_tokens is None:
        return Check(6, t, NA, "Needs a scenario with saved tokens for this step.")
    if f.adv_nonfinite:
        return Check(6, t, FAIL, f"{f.adv_nonfinite} of {f.adv_tokens} actor tokens have a non-finite advantage.")
    desc = (f"Over {f.adv_tokens} actor tokens: mean {_g(f.adv_mean)}, std {_g(f.adv_std)}, "
            f"{_g(100 * (f.adv_positive_fraction or 0), 3)}% positive (scenario {f.scenario}).")
    if f.adv_tokens > 1 and (f.adv_std is None or f.adv_std == 0):
        return Check(6, t, FAIL, desc + " Every advantage is the same: no gradient signal.")
    pos = f.adv_positive_fraction or 0.0
    if pos < ONE_SIDED or pos > 1 - ONE_SIDED:
        return Check(6, t, WARN, desc + " Nearly all advantages have one sign.")
    return Check(6, t, OK, desc)


def check_reset(f: StepFacts, estimator: str) -> Check:
    t = "REINFORCE++: mask-0 spans must not cut the final reward"
    if estimator not in RESETTING:
        return Check(7, t, NA, f"{estimator} does not reset the return at mask 0.")
    if f.tool_rows or f.rejected_tokens:
        return Check(7, t, WARN, f"{f.tool_rows} rows have tool-observation spans"
                                 + (f" and rollout correction rejected {f.rejected_tokens} tokens" if f.rejected_tokens else "")
                                 + f": {estimator} resets the reward-to-go at each mask 0, so tokens before a span get "
                                   "no credit from the final reward.")
    return Check(7, t, OK, "No mask-0 span before an actor token: the final reward reaches every token.")


def outside(value: float | None, limit: Mapping[str, Any]) -> bool:
    """Whether ``value`` is on the unhealthy side of a rule's ``limit`` (``rldiag.api.rule_limits()``)."""
    if value is None or not math.isfinite(value):
        return False
    v = abs(value) if limit.get("abs") else value
    return (limit.get("above") is not None and v > limit["above"]) or (limit.get("below") is not None and v < limit["below"])


def limit_text(metric: str, limit: Mapping[str, Any]) -> str:
    """``pg_clipfrac above 0.3 (rule clipfrac_high)``."""
    name = metric.split("/")[-1]
    name = f"|{name}|" if limit.get("abs") else name
    sides = [f"above {limit['above']:g}" if limit.get("above") is not None else "",
             f"below {limit['below']:g}" if limit.get("below") is not None else ""]
    return f"{name} {' or '.join(s for s in sides if s)} (rule {limit['rule']})"


def check_ratio(f: StepFacts, at_step: dict[str, dict[str, float | None]],
                limits: Mapping[str, Mapping[str, Any]] | None = None) -> Check:
    """``at_step``: source (logged / scenario) -> metric -> value at this step; ``limits``: the
    doctor's rules' healthy sides (``rldiag.api.rule_limits()``; None: nothing judged)."""
    t = "Only then: PPO ratio, clip fraction, loss"
    parts = []
    status = INFO
    judged = {m: (limits or {})[m] for m in JUDGED if m in (limits or {})}
    hit: list[str] = []
    if f.ratio_tokens:
        parts.append(f"ratio over {f.ratio_tokens} actor tokens: mean {_g(f.ratio_mean)}, "
                     f"range [{_g(f.ratio_min)}, {_g(f.ratio_max)}]")
    for source, values in at_step.items():
        shown = ", ".join(f"{k.split('/')[-1]} {_g(v)}" for k, v in values.items() if v is not None)
        if shown:
            parts.append(f"{source}: {shown}")
        for metric, limit in judged.items():
            if outside(values.get(metric), limit) and limit_text(metric, limit) not in hit:
                status = WARN
                hit.append(limit_text(metric, limit))
    if not parts:
        return Check(8, t, NA, "No ratio or actor metrics for this step (needs log_probs and old_log_probs).")
    tail = f" {'; '.join(hit)}: the update moves the policy a lot." if hit else ""
    return Check(8, t, status, "; ".join(parts) + "." + tail + " Problems before the advantages are not fixed by "
                                                           "tuning the clip ratio.")


def evaluate(
    facts: StepFacts,
    estimator: str,
    rollout_n: int | None = None,
    at_step: dict[str, dict[str, float | None]] | None = None,
    limits: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Check]:
    """The eight checks, in order; ``limits``: the doctor's healthy sides (``rldiag.api.rule_limits()``)."""
    return [
        check_scores(facts),
        check_rewards(facts),
        check_masks(facts),
        check_group_sizes(facts, estimator, rollout_n),
        check_flat_groups(facts, estimator),
        check_advantages(facts),
        check_reset(facts, estimator),
        check_ratio(facts, at_step or {}, limits),
    ]


#: the actor metrics check 8 shows
RATIO_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss", "actor/pg_clipfrac_lower")
