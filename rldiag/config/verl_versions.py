"""verl releases and the behaviours that differ between them: the one table of them.

``rldiag.verl_version`` picks the release whose numbers a recompute reproduces. Unset, it is the
version the run recorded (a top-level ``verl_version`` key of ``run.yaml``, as rldiag's capture
writes it), else the reference snapshot (:data:`SNAPSHOT`). Every behaviour that changed between
the releases users run is one :class:`Change` of :data:`CHANGES`; the engine asks
:func:`has` and never compares version strings itself. docs/verl-versions.md lists the table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

from rldiag.errors import ConfigError

#: the reference snapshot (verl commit cfacd76a0bdd, 2026-08), rldiag's default
SNAPSHOT = "0.10.0.dev"
#: the releases rldiag reproduces, oldest first
RELEASES = ("0.8.0", "0.9.0", "0.9.1", SNAPSHOT)
#: names accepted for the snapshot
ALIASES = {"main": SNAPSHOT, "snapshot": SNAPSHOT}


@dataclass(frozen=True)
class Change:
    """One behaviour that differs between releases.

    Attributes:
        key: the name the engine asks :func:`has` about.
        new: what the releases in ``versions`` do.
        old: what the other releases do.
        commit: the verl commit (or release) that changed it.
        versions: the releases with the ``new`` behaviour.
    """

    key: str
    new: str
    old: str
    commit: str
    versions: frozenset[str]


CHANGES: tuple[Change, ...] = (
    Change(
        key="v1_trainer",
        new="the V1 trainer by default (trainer.use_v1: true): nested tensors padded per micro-batch, so "
        "seq-mean-token-sum-norm without loss_scale_factor divides by the micro-batch's longest row; every "
        "step padded with masked rows to a multiple of lcm(dp, mini-batch rows) and balanced over the DP "
        "ranks whatever trainer.balance_batch says",
        old="only the legacy trainer: responses padded to data.max_response_length, the divisor of "
        "seq-mean-token-sum-norm without loss_scale_factor",
        commit="release v0.9.0 (2026-08-14), trainer/ppo/v1 and trainer.use_v1",
        versions=frozenset({"0.9.0", "0.9.1", SNAPSHOT}),
    ),
    Change(
        key="reinforce_pp_carry",
        new="REINFORCE++ carries the running return unchanged through mask-0 tokens; returns are 0 there",
        old="REINFORCE++ keeps a mask-0 token's own reward-to-go, then resets the running return to 0",
        commit="8a1bf6d5b (2026-08-09), compute_reinforce_plus_plus_outcome_advantage",
        versions=frozenset({"0.9.0", "0.9.1", SNAPSHOT}),
    ),
    Change(
        key="critic_global_norm",
        new="critic value loss normalised over the global mini-batch (dp_size, token count, batch size, "
        "critic.loss_scale_factor); critic/vf_loss summed over micro-batches",
        old="critic value loss normalised within each micro-batch; critic/vf_loss the mean over micro-batches",
        commit="2eb020aa9 (2026-07-07), workers/utils/losses.py value_loss",
        versions=frozenset({"0.9.0", "0.9.1", SNAPSHOT}),
    ),
    Change(
        key="v1_pad_rows_128",
        new="the V1 trainer's divisibility padding rows are 128 tokens long (127 prompt + 1 response): "
        "their workload in the DP balancing and their tokens in a use_dynamic_bsz budget",
        old="padding rows of 2 tokens (1 prompt + 1 response)",
        commit="release v0.9.1 (2026-09), trainer/ppo/padding_utils.py SYNTHETIC_PADDING_SEQ_LEN",
        versions=frozenset({"0.9.1"}),
    ),
    Change(
        key="dynamic_bsz_token_limit",
        new="use_dynamic_bsz: rearrange_micro_batches adds micro-batches (on every DP rank) until each one "
        "holds at most ppo_max_token_len_per_gpu tokens",
        old="use_dynamic_bsz: one partition into the ranks' largest ceil(tokens / budget), which a micro-batch "
        "may exceed",
        commit="release v0.9.1 (2026-09), utils/seqlen_balancing.py rearrange_micro_batches",
        versions=frozenset({"0.9.1"}),
    ),
    Change(
        key="gspo_agg_mode",
        new="gspo aggregates with actor.loss_agg_mode",
        old="gspo aggregates seq-mean-token-mean whatever loss_agg_mode says",
        commit="release v0.9.1 (2026-09), compute_policy_loss_gspo",
        versions=frozenset({"0.9.1"}),
    ),
    Change(
        key="filter_groups_reward_metric",
        new="algorithm.filter_groups is verl's own (the V1 trainer's replay buffer drops the groups before the "
        "step); its metric reward is the row's summed token_level_scores (rm_scores, before the KL penalty) and "
        "is the config's default; other names read the reward's extra info (a batch column)",
        old="only the DAPO recipe's trainer filters, after the reward and its KL penalty; it derives seq_reward "
        "(summed token_level_scores) and seq_final_reward (summed token_level_rewards) and reads any other name, "
        "reward included, from the batch; verl's FilterGroupsConfig default metric is null",
        commit="verl 0.9.1: trainer/ppo/v1/replay_buffer.py ReplayBuffer._dapo_filtered_keys, "
        "trainer_base._resolve_filter_groups_metric (0.9.0 and the snapshot taken as their V1 trainer)",
        versions=frozenset({"0.9.0", "0.9.1", SNAPSHOT}),
    ),
)

_BY_KEY = {c.key: c for c in CHANGES}


def _numbers(text: str) -> tuple[int, ...] | None:
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    return None if m is None else tuple(int(g or 0) for g in m.groups())


def _release_numbers(release: str) -> tuple[int, ...]:
    """The numbers of one of :data:`RELEASES` (each is readable: tests/config pins them)."""
    return cast(tuple[int, ...], _numbers(release))


def canonical(version: str) -> str:
    """The release of :data:`RELEASES` whose behaviour ``version`` has: itself, an alias of the
    snapshot, or the newest release at or below it (``0.9.2`` -> ``0.9.1``; a ``.dev`` of the
    snapshot's line is the snapshot)."""
    text = str(version).strip()
    text = ALIASES.get(text.lower(), text)
    if text in RELEASES:
        return text
    nums = _numbers(text)
    if nums is None or nums < _release_numbers(RELEASES[0]):
        raise ConfigError(
            f"rldiag.verl_version {version!r}: rldiag reproduces verl {', '.join(RELEASES)} (or main); not this one"
        )
    if nums >= _release_numbers(SNAPSHOT):
        return SNAPSHOT
    return [r for r in RELEASES if _release_numbers(r) <= nums][-1]


def version_of(settings) -> str:
    """The release a recompute reproduces: ``rldiag.verl_version`` (an unknown one is an error),
    else the version the run recorded (a top-level ``verl_version``, or the one rldiag's verl
    capture writes, ``rldiag.capture.verl_version``), else :data:`SNAPSHOT`. A recorded version
    older than every release rldiag knows takes the oldest's behaviour; an unreadable one the
    snapshot's."""
    chosen = settings.get("rldiag.verl_version")
    if chosen not in (None, ""):
        return canonical(chosen)
    recorded = settings.get("verl_version") or settings.get("rldiag.capture.verl_version")
    nums = _numbers(str(recorded)) if recorded not in (None, "") else None
    if nums is None:
        return canonical(recorded) if str(recorded).strip().lower() in ALIASES else SNAPSHOT
    if nums < _release_numbers(RELEASES[0]):
        return RELEASES[0]
    return canonical(recorded)


def has(settings, key: str) -> bool:
    """Whether the chosen release has the ``new`` behaviour of change ``key``."""
    try:
        change = _BY_KEY[key]
    except KeyError:
        raise KeyError(f"no verl version change {key!r}; known: {', '.join(_BY_KEY)}") from None
    return version_of(settings) in change.versions
