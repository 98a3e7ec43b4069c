"""How verl lays a step out for the update: the settings that decide it, resolved once.

A step goes through the trainer, then through each worker that trains on it (the actor and, with
a critic, the critic), in this order (:mod:`rldiag.engine.microbatch` builds the segments):

1. **padding rows** (V1 trainer only, ``PPOTrainer._balance_batch`` calling
   ``upsample_batch_to_divisible_size``, ``verl/trainer/ppo/padding_utils.py``): the step is
   topped up with fully masked rows to a multiple of ``lcm(dp, critic mini-batch rows if there is
   a critic, actor mini-batch rows if the actor updates this step)``
   (``_get_required_batch_multiple``). A padding row has one response token, masked, and a
   prompt of 127 tokens (verl 0.9.1) or 1 (0.9.0 and the snapshot): ``v1_pad_rows_128`` in
   :mod:`rldiag.config.verl_versions`. They carry no loss but count as rows.
2. **balancing** over the DP ranks (:mod:`rldiag.engine.balance`): the V1 trainer on every step
   whatever ``trainer.balance_batch`` says; the legacy trainer when it says so.
3. **dispatch**: contiguous chunks of ``ceil(rows / dp)``, one per rank.
4. per worker (:class:`RoleLayout`), on each rank: the rank's rows shuffled when the worker's
   ``shuffle`` is on (``train_mini_batch`` -> ``tensordict_utils.make_iterator``: a torch
   ``DataLoader`` with a ``torch.Generator`` seeded ``data_loader_seed + rank``, a fresh one each
   step), cut into mini-batches of ``mini / dp`` rows, each cut into micro-batches of a fixed row
   count or, with ``use_dynamic_bsz``, by token budget (:mod:`rldiag.engine.dynamic_bsz`).

Which trainer: ``trainer.use_v1`` (verl's key that selects it in ``main_ppo.py``), unset: the
release's default (V1 from 0.9.0 on). Whether rldiag balances: the batch files of rldiag's verl
capture hold the rows in the trainer's dispatch order already (the capture runs after the
balancing), so ``rldiag.rows_balanced`` (unset: true for a run the capture wrote, recognised by
``rldiag.capture.trainer`` in its config) deals them as they are; otherwise rldiag balances as
the trainer does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rldiag.engine.settings import EngineSettings
from rldiag.errors import ConfigError

ACTOR = "actor_rollout_ref.actor."
CRITIC = "critic."


@dataclass(frozen=True)
class RoleLayout:
    """One worker's cut of its share of a step.

    Attributes:
        mini: rows per mini-batch over all ranks (verl's ``ppo_mini_batch_size x rollout.n``);
            None: the whole step.
        micro: rows per micro-batch per rank; None: the whole mini-batch (or ``dynamic``).
        dynamic: micro-batches by token budget (``use_dynamic_bsz``).
        max_token_len: the budget per micro-batch (``ppo_max_token_len_per_gpu``; 0 unless ``dynamic``).
        shuffle: the rank's rows shuffled before the mini-batches are cut (``shuffle``).
        seed: ``data_loader_seed`` (rank ``r`` seeds ``seed + r``; 0 unless ``shuffle``).
    """

    mini: int | None = None
    micro: int | None = None
    dynamic: bool = False
    max_token_len: int = 0
    shuffle: bool = False
    seed: int = 0

    @property
    def trivial(self) -> bool:
        return self.mini is None and self.micro is None and not self.dynamic and not self.shuffle


@dataclass(frozen=True)
class BatchLayout:
    """The trainer's part (padding, balancing, dispatch) and each worker's.

    Attributes:
        dp: data-parallel ranks (``rldiag.dp_size``).
        v1: the V1 trainer (padding rows; balancing every step).
        balance: rldiag runs the trainer's balancing (the rows are in rollout order).
        pad_seq_len: a padding row's token count (prompt + response), 0: no padding rows.
        pad_multiples: ``(critic_warmup, multiple with the actor, multiple without it)``: a step
            ``s`` is padded to a multiple of the second when ``critic_warmup <= s``, else the third.
        until_within: verl 0.9.1's token-budget loop (:mod:`rldiag.engine.dynamic_bsz`).
        actor, critic: each worker's cut.
    """

    dp: int = 1
    v1: bool = True
    balance: bool = False
    pad_seq_len: int = 0
    pad_multiples: tuple[int, int, int] = (0, 1, 1)
    until_within: bool = True
    actor: RoleLayout = RoleLayout()
    critic: RoleLayout = RoleLayout()

    def pad_multiple(self, step: int) -> int:
        """The row count a step is padded to a multiple of (1: none)."""
        if not self.pad_seq_len:
            return 1
        warmup, with_actor, without = self.pad_multiples
        return with_actor if warmup <= step else without

    @property
    def trivial(self) -> bool:
        """Each step one segment: nothing to pad, balance, shuffle or cut."""
        return self.dp == 1 and self.pad_multiples[1:] == (1, 1) and self.actor.trivial and self.critic.trivial


def is_v1(settings: EngineSettings) -> bool:
    """``trainer.use_v1``, unset: the chosen release's default (``v1_trainer``)."""
    use_v1 = settings.get("trainer.use_v1")
    return settings.has("v1_trainer") if use_v1 is None else bool(use_v1)


def rows_balanced(settings: EngineSettings) -> bool:
    """``rldiag.rows_balanced``; unset: whether rldiag's verl capture wrote the run."""
    value = settings.get("rldiag.rows_balanced")
    return settings.get("rldiag.capture.trainer") is not None if value is None else bool(value)


def uses_critic(settings: EngineSettings) -> bool:
    """verl's ``need_critic`` (the settings' :attr:`~rldiag.engine.settings.EngineSettings.uses_critic`)."""
    return settings.uses_critic


def _role_key(settings: EngineSettings, role: str, name: str):
    """A worker's key; the critic's null ones take the actor's (the settings schema's ``inherits``:
    verl's interpolations for ``ppo_mini_batch_size``, ``use_dynamic_bsz``, ``shuffle``; rldiag's
    fallback for ``ppo_micro_batch_size_per_gpu``, which verl requires the config to set)."""
    return settings.effective((CRITIC if role == "critic" else ACTOR) + name)


def rollout_n(settings: EngineSettings) -> int:
    """``actor_rollout_ref.rollout.n``, responses per prompt; unset: verl's default 1."""
    return int(settings["actor_rollout_ref.rollout.n"] or 1)


def resolve_auto(settings: EngineSettings, key: str, role: str = "actor") -> int | None:
    """``rldiag.mini_batch_size`` / ``rldiag.micro_batch_size`` for one worker: an integer (or
    null) as given, applying to both workers; ``auto`` reads verl's keys (``ppo_mini_batch_size
    x rollout.n``, ``ppo_micro_batch_size_per_gpu``; for the critic its own, else the actor's);
    ``run`` (the default): the same when the config has them, else null (the whole step). With
    ``use_dynamic_bsz`` the micro size of ``auto`` / ``run`` is None (:func:`role_layout`)."""
    value = settings.get(key)
    if value == "run":
        value = "auto" if _run_has_batch_keys(settings, key, role) else None
    if value != "auto":
        return None if value is None else int(value)
    if key == "rldiag.mini_batch_size":
        mini = _role_key(settings, role, "ppo_mini_batch_size")
        if mini is None:
            raise ConfigError(f"{key}=auto needs {ACTOR}ppo_mini_batch_size in the run's config")
        return int(mini) * rollout_n(settings)
    if _dynamic(settings, role):
        return None
    micro = _role_key(settings, role, "ppo_micro_batch_size_per_gpu")
    if micro is None:
        raise ConfigError(f"{key}=auto needs {ACTOR}ppo_micro_batch_size_per_gpu (or use_dynamic_bsz) in the run's config")
    return int(micro)


def _dynamic(settings: EngineSettings, role: str) -> bool:
    return bool(_role_key(settings, role, "use_dynamic_bsz"))


def _run_has_batch_keys(settings: EngineSettings, key: str, role: str) -> bool:
    """Whether the run's config holds the verl keys ``auto`` reads for ``key``."""
    if key == "rldiag.mini_batch_size":
        return _role_key(settings, role, "ppo_mini_batch_size") is not None
    return _dynamic(settings, role) or _role_key(settings, role, "ppo_micro_batch_size_per_gpu") is not None


def role_layout(settings: EngineSettings, role: str) -> RoleLayout:
    """The cut of ``role`` (``actor`` or ``critic``) under the settings. Token-budget
    micro-batches when the worker's ``use_dynamic_bsz`` is on and ``rldiag.micro_batch_size``
    is ``run`` or ``auto`` (an integer there always means micro-batches of that many rows)."""
    micro_setting = settings.get("rldiag.micro_batch_size")
    dynamic = _dynamic(settings, role) and micro_setting in ("run", "auto")
    budget = settings.get((CRITIC if role == "critic" else ACTOR) + "ppo_max_token_len_per_gpu")
    seed = settings.get((CRITIC if role == "critic" else ACTOR) + "data_loader_seed")
    shuffle = bool(_role_key(settings, role, "shuffle"))
    return RoleLayout(  # a budget without dynamic batches, a seed without shuffling: 0, so equal cuts compare equal
        mini=resolve_auto(settings, "rldiag.mini_batch_size", role),
        micro=None if dynamic else resolve_auto(settings, "rldiag.micro_batch_size", role),
        dynamic=dynamic,
        max_token_len=int(budget if budget is not None else (32768 if role == "critic" else 16384)) if dynamic else 0,
        shuffle=shuffle,
        seed=int(seed if seed is not None else 42) if shuffle else 0,
    )


def batch_layout(settings: EngineSettings) -> BatchLayout:
    """The layout the settings describe (``ConfigError`` for one verl would refuse)."""
    dp = int(settings.get("rldiag.dp_size", 1) or 1)
    if dp < 1:
        raise ConfigError(f"rldiag.dp_size must be >= 1, got {dp}")
    actor = role_layout(settings, "actor")
    critic = role_layout(settings, "critic") if uses_critic(settings) else actor
    for role, lay in (("actor", actor), ("critic", critic)):
        if lay.micro is not None and lay.micro < 1:
            raise ConfigError(f"rldiag.micro_batch_size must be >= 1 or null, got {lay.micro!r}")
        if lay.mini is not None and lay.mini < 1:
            raise ConfigError(f"rldiag.mini_batch_size must be >= 1 or null, got {lay.mini!r}")
        if lay.mini is not None and lay.mini % dp:
            raise ConfigError(
                f"rldiag.mini_batch_size ({lay.mini}, the {role}'s) must be a multiple of rldiag.dp_size ({dp}), "
                "as verl asserts")
    v1 = is_v1(settings)
    given = rows_balanced(settings)
    balance = not given and dp > 1 and (v1 or bool(settings.get("trainer.balance_batch", True)))
    pad_seq_len, multiples = 0, (0, 1, 1)
    if v1:
        pad_seq_len = 128 if settings.has("v1_pad_rows_128") else 2
        base = dp
        if uses_critic(settings) and critic.mini is not None:
            base = math.lcm(base, critic.mini)
        with_actor = base if actor.mini is None else math.lcm(base, actor.mini)
        multiples = (int(settings.get("trainer.critic_warmup") or 0), with_actor, base)
    return BatchLayout(
        dp=dp, v1=v1, balance=balance, pad_seq_len=pad_seq_len, pad_multiples=multiples,
        until_within=settings.has("dynamic_bsz_token_limit"), actor=actor, critic=critic,
    )


def check_microbatch_settings(settings: EngineSettings) -> None:
    """Fail early on a layout that cannot be emulated (before any step is read)."""
    dp = settings.get("rldiag.dp_size", 1)
    if dp is None or int(dp) < 1:
        raise ConfigError(f"rldiag.dp_size must be >= 1, got {dp!r}")
    batch_layout(settings)


def describe_layout(layout: BatchLayout) -> str:
    """One line naming the layout, e.g. ``V1, dp 2, padded to a multiple of 8, balanced by
    rldiag; actor: mini 8 rows, micro 2 rows`` (the critic's too when it is cut differently)."""
    trainer = "V1" if layout.v1 else "legacy"
    parts = [f"{trainer}, dp {layout.dp}"]
    if layout.pad_seq_len and max(layout.pad_multiples[1:]) > 1:
        parts.append(f"padded to a multiple of {layout.pad_multiples[1]}")
    if layout.dp > 1:
        parts.append("balanced by rldiag" if layout.balance else "rows dealt as stored")
    roles = [("actor", layout.actor)] + ([("critic", layout.critic)] if layout.critic != layout.actor else [])
    text = ", ".join(parts)
    for name, lay in roles:
        mini = "whole step" if lay.mini is None else f"mini {lay.mini} rows"
        if lay.dynamic:
            micro = f"dynamic micro-batches of <= {lay.max_token_len} tokens"
        else:
            micro = "one micro-batch" if lay.micro is None else f"micro {lay.micro} rows"
        shuffle = f", shuffled (seed {lay.seed})" if lay.shuffle else ""
        text += f"; {name}: {mini}, {micro}{shuffle}"
    return text
