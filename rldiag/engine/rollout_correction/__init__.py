"""Rollout correction: IS weights, rejection sampling and off-policy diagnostics.

verl's ``algorithm.rollout_correction`` (``verl/trainer/ppo/rollout_corr_helper.py``).
``log r = log pi_train - log pi_rollout`` per token, where pi_train is ``old_log_probs`` at the
trainer (and the *current* policy inside ``loss_mode=bypass_mode``).

- IS weights (:data:`IS_LEVELS`, keyed by ``rollout_is``): ``token`` ``w = exp(clamp(log r,
  +-20))``; ``sequence`` ``w = exp(clamp(sum_t log r, +-20))`` on every token of the row.
  ``rollout_is_threshold`` a number: TIS, ``min(w, upper)`` (truncated IS, arXiv:2506.09477's
  "TIS"); a ``"lower_upper"`` string: IcePop, ``w`` outside ``[lower, upper]`` set to 0.
  ``rollout_is_batch_normalize`` divides by the step's mean weight.
- Rejection (:data:`RS_OPTIONS`, keyed by each ``rollout_rs`` option; comma lists AND the
  options): a token or a whole row whose divergence statistic leaves its threshold gets
  ``response_mask`` 0. k1 ``-log r`` (ratio bounds ``lower_upper``, upper alone means
  ``1/upper_upper``), k2 ``0.5 (log r)^2``, k3 ``e^{log r} - 1 - log r``; per token, or per row
  as sum / mean / max.
- Off-policy diagnostics: KL, k3 KL, perplexities, log-PPL differences, chi-squared.

All functions are vectorised over a packed batch: every "over the batch" reduction of verl is a
segment reduction keyed by ``seg`` ``(rows,)`` (a step, or a micro-batch inside the actor).
Metric names are verl's, without the ``rollout_corr/`` prefix that :func:`correct` adds.

The package: :mod:`.config` (the settings parsed, :class:`CorrectionConfig`), :mod:`.weights`
(:data:`IS_LEVELS`, the IS weights and their metrics), :mod:`.rejection` (:data:`RS_OPTIONS`, the
rejection mask and its metrics), :mod:`.diagnostics` (the off-policy metrics), :mod:`.correction`
(:func:`correct`: the three on a batch) and :mod:`.common` (the clamp bound and the statistics
they share). Importing the package registers every IS level and rejection option.
"""


from __future__ import annotations

from rldiag.engine.rollout_correction.common import SAFETY_BOUND, Metrics
from rldiag.engine.rollout_correction.config import CorrectionConfig, parse_is_threshold, parse_rs
from rldiag.engine.rollout_correction.correction import (
    EMPTY_MESSAGE,
    ZERO_WEIGHTS_MESSAGE,
    CorrectionResult,
    correct,
)
from rldiag.engine.rollout_correction.diagnostics import offpolicy_metrics
from rldiag.engine.rollout_correction.rejection import RS_OPTIONS, RSContext, RSFn, rejection_mask
from rldiag.engine.rollout_correction.weights import IS_LEVELS, ISLevelFn, is_weights

__all__ = [
    "EMPTY_MESSAGE", "IS_LEVELS", "RS_OPTIONS", "SAFETY_BOUND", "ZERO_WEIGHTS_MESSAGE", "CorrectionConfig",
    "CorrectionResult", "ISLevelFn", "Metrics", "RSContext", "RSFn", "correct", "is_weights", "offpolicy_metrics",
    "parse_is_threshold", "parse_rs", "rejection_mask",
]
