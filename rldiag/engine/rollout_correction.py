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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rldiag.engine.layout import Rows
from rldiag.engine.segments import (
    MEAN_EPS,
    masked_square_sum_rows,
    masked_sum_rows,
    row_mask_count,
    seg_count,
    seg_max,
    seg_mean,
    seg_min,
    seg_std,
    seg_sum,
    step_mask_count,
    step_masked_extrema,
    step_masked_mean,
)
from rldiag.errors import ConfigError, UnknownKeyError
from rldiag.registry import Registry

#: verl's SAFETY_BOUND: log-ratios are clamped to +-20 before exp.
SAFETY_BOUND = 20.0
_EXP_LO = float(torch.exp(torch.tensor(-SAFETY_BOUND, device="cpu")))  # float32 exp(-20), exp(20)
_EXP_HI = float(torch.exp(torch.tensor(SAFETY_BOUND, device="cpu")))
#: verl's message when a batch reaches rollout correction without a single actor token.
EMPTY_MESSAGE = "rollout correction: response_mask must contain at least one valid token (1) (verl raises here)"
#: when every IS weight of a batch is 0 (IcePop), verl's ESS is ``1.0 / 0.0`` in Python.
ZERO_WEIGHTS_MESSAGE = (
    "rollout correction: every IS weight of the batch is 0 (all outside the IcePop band), so "
    "rollout_is_eff_sample_size divides by zero (verl raises ZeroDivisionError here)"
)

Metrics = dict[str, torch.Tensor]


# ---- configuration ---------------------------------------------------------------------------


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """``rollout_is_threshold`` -> ``(upper, lower)``; ``lower`` is None for TIS (one number)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ConfigError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower: float | None = None
    try:
        if isinstance(spec, str):
            text = spec.strip()
            if not text:
                raise ConfigError("rollout_is_threshold must not be an empty string")
            if "_" in text:
                lo, up = text.split("_", 1)
                lower, upper = float(lo), float(up)
            else:
                upper = float(text)
        else:
            upper = float(spec)
    except ValueError:
        raise ConfigError(f"invalid rollout_is_threshold {spec!r}") from None
    if not upper > 0:
        raise ConfigError(f"rollout_is_threshold upper bound must be positive, got {upper}")
    if lower is not None:
        if not lower > 0:
            raise ConfigError(f"rollout_is_threshold lower bound must be positive, got {lower}")
        if lower > upper:
            raise ConfigError("rollout_is_threshold lower bound must be <= upper bound")
    return upper, lower


def parse_rs(options_spec: Any, threshold_spec: Any) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs`` (comma list, duplicates dropped) and ``rollout_rs_threshold`` (one value
    for all, or one per option) -> ``{option: (lower, upper)}`` in verl's units: k1 options
    carry ratio bounds (``lower`` = ``1/upper`` unless given as ``lower_upper``); the others an
    upper bound only."""
    if not isinstance(options_spec, str):
        raise ConfigError(f"rollout_rs must be a string of comma separated options, got {options_spec!r}")
    options = list(dict.fromkeys(o.strip() for o in options_spec.split(",") if o.strip()))
    if not options:
        raise ConfigError("rollout_rs must contain at least one option")
    for opt in options:
        if opt not in RS_OPTIONS:
            raise UnknownKeyError("rollout_rs option", opt, RS_OPTIONS.names())
    if threshold_spec is None:
        raise ConfigError("rollout_rs_threshold must be provided when rollout_rs is set")
    if isinstance(threshold_spec, (int, float)):
        specs = [str(threshold_spec)]
    elif isinstance(threshold_spec, str):
        specs = [p.strip() for p in threshold_spec.split(",") if p.strip()]
    else:
        raise ConfigError(f"rollout_rs_threshold must be a number or a string, got {threshold_spec!r}")
    if not specs:
        raise ConfigError("rollout_rs_threshold must contain at least one threshold value")
    if len(specs) not in (1, len(options)):
        raise ConfigError(
            f"rollout_rs_threshold needs one threshold shared by all options or exactly {len(options)} "
            f"(one per rollout_rs option {options}), got {len(specs)}"
        )
    if len(specs) == 1:
        specs = specs * len(options)
    out: dict[str, tuple[float | None, float]] = {}
    for opt, spec in zip(options, specs):
        try:
            if opt.endswith("k1"):
                lo_s, up_s = spec.split("_", 1) if "_" in spec else (str(1.0 / float(spec)), spec)
                lower, upper = float(lo_s), float(up_s)
                if lower <= 0 or upper <= 0:
                    raise ConfigError(f"rollout_rs_threshold for {opt!r} must be positive, got {spec!r}")
                out[opt] = (lower, upper)
            else:
                if "_" in spec:
                    raise ConfigError(f"rollout_rs_threshold for {opt!r} takes a single upper bound, got {spec!r}")
                upper = float(spec)
                if upper <= 0:
                    raise ConfigError(f"rollout_rs_threshold for {opt!r} must be positive, got {spec!r}")
                out[opt] = (None, upper)
        except (ValueError, ZeroDivisionError):
            raise ConfigError(f"invalid rollout_rs_threshold {spec!r} for option {opt!r}") from None
    return out


@dataclass(frozen=True)
class CorrectionConfig:
    """A parsed rollout-correction block (verl's ``RolloutCorrectionConfig``)."""

    rollout_is: str | None = None
    is_upper: float = 2.0
    is_lower: float | None = None
    batch_normalize: bool = False
    rs: dict[str, tuple[float | None, float]] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | Any, prefix: str) -> CorrectionConfig:
        """Read ``<prefix>.rollout_is``, ``.rollout_is_threshold``, ``.rollout_is_batch_normalize``,
        ``.rollout_rs``, ``.rollout_rs_threshold``; errors as verl raises them, as ConfigError."""
        level = settings[f"{prefix}.rollout_is"]
        threshold = settings[f"{prefix}.rollout_is_threshold"]
        if level is not None and threshold is not None:  # verl skips IS when either is null
            IS_LEVELS.get(level)
            upper, lower = parse_is_threshold(threshold)
        else:
            level, upper, lower = None, 2.0, None
        rs_spec = settings[f"{prefix}.rollout_rs"]
        rs = parse_rs(rs_spec, settings[f"{prefix}.rollout_rs_threshold"]) if rs_spec is not None else {}
        return cls(level, upper, lower, bool(settings[f"{prefix}.rollout_is_batch_normalize"]), rs)

    @property
    def active(self) -> bool:
        """IS weights or rejection enabled (diagnostics are computed either way)."""
        return self.rollout_is is not None or bool(self.rs)


# ---- small per-row / per-segment helpers -----------------------------------------------------


def _row_mean(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """verl's ``masked_mean(values, mask, axis=-1)``: ``(rows,)``, 0 for a row without tokens."""
    return masked_sum_rows(values, mask, rows) / (rows.sum(mask) + MEAN_EPS)


def _seq_std0(x: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """Bessel std per segment, 0 where the segment has a single value (verl's guard)."""
    _, std, cnt = seg_std(x, seg, n)
    return torch.where(cnt > 1, std, torch.zeros_like(std))


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, rows: Rows, seg: torch.Tensor, n: int, lo: float,
                 hi: float) -> torch.Tensor:
    """``sqrt(max(E[c^2] - E[c]^2, 0))`` of ``c = clamp(values, lo, hi)`` over masked tokens; 0
    where a segment has at most one token. Computed two-pass, ``E[(c - E[c])^2]``: verl's one-pass
    float32 form agrees to float32 precision except when the spread is below ~3e-4 of the values'
    size, where verl's result is rounding noise (and the 1e-8 of its masked means adds up to
    ``sqrt(1e-8 / n)`` of the size); the two-pass value is the spread itself."""
    c = torch.clamp(values, min=lo, max=hi)
    mean = step_masked_mean(c, mask, rows, seg, n)
    var = step_masked_mean((c - rows.expand(mean[seg])).square(), mask, rows, seg, n)
    std = torch.sqrt(torch.clamp(var, min=0.0))
    return torch.where(step_mask_count(mask, rows, seg, n) > 1, std, torch.zeros_like(std))


# ---- importance-sampling weights -------------------------------------------------------------

ISLevelFn = Callable[[torch.Tensor, torch.Tensor, Rows], tuple[torch.Tensor, torch.Tensor | None]]
IS_LEVELS: Registry[ISLevelFn] = Registry("rollout_is level")


@IS_LEVELS.register("token", source="verl rollout_corr_helper.compute_rollout_correction_weights (token level)")
def is_token(log_ratio: torch.Tensor, mask: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw masked weights ``exp(clamp(log r, +-20)) * m`` ``(tokens,)``; no row statistic."""
    return torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * mask, None


@IS_LEVELS.register("sequence", source="verl rollout_corr_helper.compute_rollout_correction_weights (sequence level)")
def is_sequence(log_ratio: torch.Tensor, mask: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw weights ``exp(clamp(sum_t m log r, +-20))`` on every masked token of the row, and the
    unclamped row sums ``(rows,)`` verl's metrics read."""
    row = masked_sum_rows(log_ratio, mask, rows)
    w = rows.expand(torch.exp(torch.clamp(row, -SAFETY_BOUND, SAFETY_BOUND)))
    return w * mask, row


def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig, rows: Rows, seg: torch.Tensor, n: int
) -> tuple[torch.Tensor, Metrics]:
    """IS weights ``(tokens,)`` (TIS / IcePop, optionally batch-normalised per segment) and
    verl's ``rollout_is_*`` metrics ``(n,)`` (computed before the batch normalisation)."""
    level = cfg.rollout_is
    assert level is not None, "IS weights asked for without rollout_is"
    raw, row_log = IS_LEVELS.get(level)(log_ratio, mask, rows)
    upper, lower = cfg.is_upper, cfg.is_lower
    if lower is None:
        w = raw.clamp(max=upper)  # TIS
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))  # IcePop
    lo_m = 1.0 / upper if lower is None else lower
    m: Metrics = {}
    if row_log is not None:  # sequence level: log-space row statistics over every row
        log_up = torch.log(torch.tensor(upper, dtype=torch.float32, device=raw.device))
        log_lo = torch.log(torch.tensor(lo_m, dtype=torch.float32, device=raw.device))
        m["rollout_is_max"] = torch.exp(torch.clamp(seg_max(row_log, seg, n), max=SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(seg_min(row_log, seg, n))
        m["rollout_is_mean"] = step_masked_mean(w, mask, rows, seg, n)
        m["rollout_is_ratio_fraction_high"] = seg_mean((row_log > log_up).float(), seg, n)
        m["rollout_is_ratio_fraction_low"] = seg_mean((row_log < log_lo).float(), seg, n)
    else:
        m["rollout_is_mean"] = step_masked_mean(w, mask, rows, seg, n)
        m["rollout_is_ratio_fraction_high"] = step_masked_mean((raw > upper).float(), mask, rows, seg, n)
        m["rollout_is_ratio_fraction_low"] = step_masked_mean((raw < lo_m).float(), mask, rows, seg, n)
        _, m["rollout_is_max"], m["rollout_is_min"] = step_masked_extrema(w, mask, rows, seg, n)
    m["rollout_is_std"] = _clamped_std(w, mask, rows, seg, n, 0.0, upper)
    ess_w = w.clamp(min=0.0, max=upper)
    ess_norm = ess_w / (rows.expand(step_masked_mean(ess_w, mask, rows, seg, n)[seg]) + MEAN_EPS)
    m["rollout_is_eff_sample_size"] = 1.0 / step_masked_mean(ess_norm.square(), mask, rows, seg, n)
    seq_w = _row_mean(w, mask, rows)  # every row, a row without tokens counts as 0
    m["rollout_is_seq_mean"] = seg_mean(seq_w, seg, n)
    m["rollout_is_seq_std"] = _seq_std0(seq_w, seg, n)
    m["rollout_is_seq_max"] = seg_max(seq_w, seg, n)
    m["rollout_is_seq_min"] = seg_min(seq_w, seg, n)
    m["rollout_is_seq_max_deviation"] = seg_max((seq_w - 1.0).abs(), seg, n)
    raw_seq = _row_mean(raw, mask, rows)
    m["rollout_is_seq_fraction_high"] = seg_mean((raw_seq > upper).float(), seg, n)
    m["rollout_is_seq_fraction_low"] = seg_mean((raw_seq < lo_m).float(), seg, n)
    if lower is not None:
        oob = (raw < lower) | (raw > upper)
        m["rollout_is_oob_ratio"] = step_masked_mean(oob.float(), mask, rows, seg, n)
    if cfg.batch_normalize:
        if row_log is None:
            mean_w = step_masked_mean(w, mask, rows, seg, n)
        else:
            valid = (rows.sum(mask) > 0).to(w.dtype)
            mean_w = seg_sum(seq_w * valid, seg, n) / seg_sum(valid, seg, n).clamp_min(1e-8)
        apply = mean_w > 1e-8
        w = torch.where(rows.expand(apply[seg]), w / rows.expand(mean_w[seg]), w)
        m["rollout_is_batch_norm_factor"] = torch.where(apply, mean_w, torch.ones_like(mean_w))
    return w, m


# ---- rejection sampling ----------------------------------------------------------------------


@dataclass
class RSContext:
    """Per-token divergence statistics shared by the rejection options ``(tokens,)``, and the
    row layout ``rows`` of the tokens."""

    log_ratio: torch.Tensor  # clamped to +-20
    mask: torch.Tensor
    train_log_prob: torch.Tensor
    rollout_log_prob: torch.Tensor
    rows: Rows

    @property
    def k1(self) -> torch.Tensor:
        return -self.log_ratio

    @property
    def k2(self) -> torch.Tensor:
        return 0.5 * self.log_ratio.square()

    @property
    def k3(self) -> torch.Tensor:
        return torch.exp(self.log_ratio) - 1.0 - self.log_ratio


#: fn(ctx) -> (per-token statistic, None) for token-level options, (None, per-row statistic) for
#: sequence-level ones; ``(tokens,)`` / ``(rows,)``.
RSFn = Callable[[RSContext], tuple[torch.Tensor | None, torch.Tensor | None]]
RS_OPTIONS: Registry[RSFn] = Registry("rollout_rs option")


def _row_max(v: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Max over the row's masked tokens ``(rows,)``; 0 for a row without tokens (verl)."""
    best = rows.amax(v.masked_fill(~mask.bool(), float("-inf")))
    return torch.where(best == float("-inf"), torch.zeros_like(best), best)


_ROW_REDUCTIONS = {
    "sum": masked_sum_rows,
    "mean": _row_mean,
    "max": _row_max,
}


def _rs_option(estimator: str, level: str) -> RSFn:
    """The rejection statistic ``estimator`` (k1/k2/k3 of the clamped log-ratio) per token
    (``level`` "token") or reduced over the row's masked tokens ("sum", "mean", "max")."""

    def option(ctx: RSContext) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        stat = getattr(ctx, estimator)
        if level == "token":
            return stat, None
        return None, _ROW_REDUCTIONS[level](stat, ctx.mask, ctx.rows)

    option.__name__ = f"rs_{level}_{estimator}"
    return option


for _est in ("k1", "k2", "k3"):
    RS_OPTIONS.register(f"token_{_est}", source="verl rollout_corr_helper")(_rs_option(_est, "token"))
    for _level in ("sum", "mean", "max"):
        if not (_level == "max" and _est == "k1"):  # verl has no seq_max_k1
            RS_OPTIONS.register(f"seq_{_level}_{_est}", source="verl rollout_corr_helper")(_rs_option(_est, _level))


def _binary_kl(log_p: torch.Tensor, log_q: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Bernoulli KL(P||Q) of ``p = exp(log_p)`` and ``q``, clamped into ``[eps, 1 - eps]``."""
    p = torch.clamp(torch.exp(log_p.float()), eps, 1.0 - eps)
    q = torch.clamp(torch.exp(log_q.float()), eps, 1.0 - eps)
    return (p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))).to(log_p.dtype)


@RS_OPTIONS.register("binary_kl", source="verl rollout_corr_helper (KPop)")
def rs_binary_kl(ctx: RSContext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``max(KL_bern(train||rollout), KL_bern(rollout||train))`` per token."""
    fwd = _binary_kl(ctx.train_log_prob, ctx.rollout_log_prob)
    rev = _binary_kl(ctx.rollout_log_prob, ctx.train_log_prob)
    return torch.maximum(fwd, rev), None


def rejection_mask(
    ctx: RSContext, options: Mapping[str, tuple[float | None, float]], seg: torch.Tensor, n: int
) -> tuple[torch.Tensor, Metrics]:
    """The mask with rejected tokens set to 0 ``(tokens,)`` and verl's ``rollout_rs_*``
    metrics ``(n,)``, each option judged on the original mask."""
    mask, rows = ctx.mask, ctx.rows
    mask_b = mask.bool()
    valid_row = rows.sum(mask) > 0
    vseg = seg[valid_row]
    n_valid = seg_count(vseg, n)
    combined = torch.ones_like(mask)
    m: Metrics = {}
    for opt, (lower, upper) in options.items():
        tok_stat, row_stat = RS_OPTIONS.get(opt)(ctx)
        is_k1 = opt.endswith("k1")
        assert upper is not None and (lower is not None or not is_k1), "thresholds resolved by CorrectionConfig"
        hi = math.log(upper) if is_k1 else upper
        lo = math.log(lower) if is_k1 and lower is not None else 0.0
        if row_stat is not None:
            stat = rows.expand(row_stat)
            keep_row = (row_stat >= lo) & (row_stat <= hi) if is_k1 else row_stat <= hi
            keep = rows.expand(keep_row)
        else:
            assert tok_stat is not None, "an RS option gives a token or a row statistic"
            stat = tok_stat
            keep = (stat >= lo) & (stat <= hi) if is_k1 else stat <= hi
        p = f"rollout_rs_{opt}"
        m[f"{p}_mean"] = step_masked_mean(stat, mask, rows, seg, n)
        seq_values = row_stat if row_stat is not None else _row_mean(stat, mask, rows)
        sv = seq_values[valid_row]
        if row_stat is not None:
            m[f"{p}_max"] = seg_max(sv, vseg, n)
            m[f"{p}_min"] = seg_min(sv, vseg, n)
            m[f"{p}_fraction_high"] = seg_mean((sv > hi).float(), vseg, n)
            m[f"{p}_fraction_low"] = seg_mean((sv < lo).float(), vseg, n) if is_k1 else torch.zeros(n, device=mask.device)
        else:
            _, m[f"{p}_max"], m[f"{p}_min"] = step_masked_extrema(stat, mask, rows, seg, n)
            m[f"{p}_fraction_high"] = step_masked_mean((stat > hi).float(), mask, rows, seg, n)
            low = step_masked_mean((stat < lo).float(), mask, rows, seg, n)
            m[f"{p}_fraction_low"] = low if is_k1 else torch.zeros_like(low)
        m[f"{p}_std"] = _clamped_std(stat, mask, rows, seg, n, lo, hi)
        m[f"{p}_seq_mean"] = seg_mean(sv, vseg, n)
        m[f"{p}_seq_std"] = _seq_std0(sv, vseg, n)
        m[f"{p}_seq_max"] = seg_max(sv, vseg, n)
        m[f"{p}_seq_min"] = seg_min(sv, vseg, n)
        m[f"{p}_seq_max_deviation"] = seg_max(sv.abs(), vseg, n)
        m[f"{p}_seq_fraction_high"] = seg_mean((sv > hi).float(), vseg, n)
        if is_k1:
            m[f"{p}_seq_fraction_low"] = seg_mean((sv < lo).float(), vseg, n)
        keep_f = keep.to(mask.dtype)
        combined = combined * keep_f
        m[f"{p}_masked_fraction"] = step_masked_mean(1 - keep_f, mask, rows, seg, n)
        row_kept = ~rows.any((~keep) & mask_b)
        dropped = seg_sum((~row_kept[valid_row]).float(), vseg, n)
        m[f"{p}_seq_masked_fraction"] = torch.where(n_valid > 0, dropped / n_valid.clamp_min(1), torch.zeros_like(dropped))
    m["rollout_rs_masked_fraction"] = step_masked_mean(1 - combined, mask, rows, seg, n)
    row_hit = rows.any((~((combined > 0.5) & mask_b)) & mask_b)
    m["rollout_rs_seq_masked_fraction"] = seg_mean(row_hit.float(), seg, n)
    return (mask * combined).to(mask.dtype), m


# ---- off-policy diagnostics ------------------------------------------------------------------


def offpolicy_metrics(
    train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, rows: Rows, seg: torch.Tensor,
    n: int, log_ratio: torch.Tensor | None = None,
) -> Metrics:
    """KL(pi_rollout || pi_train) (k1 and k3), perplexities and their log differences (per-row
    means, then the mean over every row), chi-squared of token and sequence ratios ``(n,)``.
    ``log_ratio``: ``train - rollout`` when the caller has it."""
    m: Metrics = {}
    if log_ratio is None:
        log_ratio = train_log_prob - rollout_log_prob
    count = row_mask_count(mask, rows) + MEAN_EPS
    lp_train = masked_sum_rows(train_log_prob, mask, rows) / count
    lp_roll = masked_sum_rows(rollout_log_prob, mask, rows) / count
    m["training_ppl"] = seg_mean(torch.exp(-lp_train), seg, n)
    m["training_log_ppl"] = seg_mean(-lp_train, seg, n)
    # rollout - train is exactly -(train - rollout), and so are their sums
    row_sum = masked_sum_rows(log_ratio, mask, rows)
    m["kl"] = seg_sum(-row_sum, seg, n) / (step_mask_count(mask, rows, seg, n) + MEAN_EPS)
    ratio = torch.exp(log_ratio)
    m["k3_kl"] = step_masked_mean(torch.sub(ratio, log_ratio).sub_(1.0), mask, rows, seg, n)
    m["rollout_ppl"] = seg_mean(torch.exp(-lp_roll), seg, n)
    m["rollout_log_ppl"] = seg_mean(-lp_roll, seg, n)
    diff = lp_roll - lp_train
    m["log_ppl_diff"] = seg_mean(diff, seg, n)
    m["log_ppl_abs_diff"] = seg_mean(diff.abs(), seg, n)
    m["log_ppl_diff_max"] = seg_max(diff, seg, n)
    m["log_ppl_diff_min"] = seg_min(diff, seg, n)
    m["ppl_ratio"] = seg_mean(torch.exp(diff), seg, n)
    # exp(clamp(x, -b, b)) as clamp(exp(x), exp(-b), exp(b)): exp is monotone, one exp serves both
    rho = ratio.clamp_(min=_EXP_LO, max=_EXP_HI)
    count = step_mask_count(mask, rows, seg, n) + MEAN_EPS
    m["chi2_token"] = seg_sum(masked_square_sum_rows(rho, mask, rows), seg, n) / count - 1.0
    row_sum = torch.clamp(row_sum, -SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = seg_mean(torch.exp(2.0 * row_sum), seg, n) - 1.0
    return m


# ---- the whole correction --------------------------------------------------------------------


@dataclass
class CorrectionResult:
    """What :func:`correct` produced for a packed batch."""

    weights: torch.Tensor | None  # (tokens,) IS weights, None when rollout_is is off
    mask: torch.Tensor  # (tokens,) response_mask after rejection
    metrics: Metrics  # "rollout_corr/<name>" -> (n,)
    empty: torch.Tensor  # (n,) bool: segments without a single masked token (verl raises)
    failed: dict[str, torch.Tensor] = field(default_factory=dict)  # message -> (n,) bool, verl raises



def correct(
    train_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    cfg: CorrectionConfig,
    rows: Rows,
    seg: torch.Tensor,
    n: int,
) -> CorrectionResult:
    """verl's ``compute_rollout_correction_and_rejection_mask`` on each segment of ``seg``:
    IS weights (if ``rollout_is``), rejection (if ``rollout_rs``), off-policy diagnostics always.
    Inputs ``(tokens,)`` in the layout ``rows``; ``seg`` ``(rows,)`` the segment of each row;
    metric values for segments in ``empty`` are not meaningful."""
    log_ratio = train_log_prob - rollout_log_prob
    metrics: Metrics = {}
    weights = None
    if cfg.rollout_is is not None:
        weights, im = is_weights(log_ratio, mask, cfg, rows, seg, n)
        metrics.update(im)
    new_mask = mask
    if cfg.rs:
        ctx = RSContext(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND), mask, train_log_prob, rollout_log_prob,
                        rows)
        new_mask, rm = rejection_mask(ctx, cfg.rs, seg, n)
        metrics.update(rm)
    metrics.update(offpolicy_metrics(train_log_prob, rollout_log_prob, mask, rows, seg, n, log_ratio))
    empty = step_mask_count(mask, rows, seg, n) == 0
    failed = {EMPTY_MESSAGE: empty}
    if weights is not None:
        failed[ZERO_WEIGHTS_MESSAGE] = torch.isinf(metrics["rollout_is_eff_sample_size"]) & ~empty
    return CorrectionResult(weights, new_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}, empty, failed)
