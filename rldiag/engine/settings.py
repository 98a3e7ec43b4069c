"""What the engine reads of a recompute's settings: a typed view, so the engine imports neither
the configuration layer nor the I/O layer.

:class:`rldiag.config.settings.Settings` (verl's dotted keys resolved from a run's config, the
defaults and the user's overrides) satisfies this protocol; a test may pass any object that
does. ``has(change)`` answers whether the verl release being reproduced has the new behaviour of
one of the changes listed in :mod:`rldiag.config.verl_versions`.
"""

from __future__ import annotations

from typing import Any, Protocol


class EngineSettings(Protocol):
    """The settings of one recompute as the engine reads them."""

    def __getitem__(self, key: str) -> Any:
        """The value of a verl dotted key (``algorithm.adv_estimator``); every known key has one."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def effective(self, key: str) -> Any:
        """The value of a key as verl reads it: a null takes the value of the key the settings
        schema says it inherits (``critic.ppo_mini_batch_size`` null: the actor's)."""

    def has(self, change: str) -> bool:
        """Whether the verl release reproduced has the new behaviour of ``change``."""

    @property
    def estimator(self) -> str: ...

    @property
    def actor_agg_mode(self) -> str: ...

    @property
    def critic_agg_mode(self) -> str: ...

    @property
    def critic_loss_scale_factor(self) -> float | None: ...

    @property
    def uses_critic(self) -> bool:
        """verl's ``need_critic``: ``critic.enable`` when set, else ``adv_estimator == "gae"``."""

    @property
    def clip_low(self) -> float: ...

    @property
    def clip_high(self) -> float: ...
