"""What to do about a cause of the rollout-vs-trainer gap, from the run's resolved settings.

:func:`mismatch_remedy` writes a ``rollout_mismatch`` finding's remedy for the run at hand rather
than in general: it never suggests a setting the run already has (it says the setting is on and
what it did over the window: the rollout IS weights' effective sample size and the share they
truncate, the share rejection masks), names the exact verl keys, and when the config and the
fingerprint disagree it says where else the cause can come from and estimates the effective
value from the data:

- truncation under ``top_p=1`` and ``top_k=-1``: the engine's own sampling defaults (vLLM and
  SGLang read the model's ``generation_config.json``), a recipe or agent loop overriding the
  request's sampling parameters, ``min_p``. Top-p renormalises each step's log-probs over the kept
  mass M >= top_p, so ``log pi_old - log pi_rollout = log M`` (pi_old scores over the whole
  vocabulary), whose floor is about ``log top_p``: the effective top-p is about
  ``exp(-gap_abs_p99)`` (the median over steps of the per-step 99th percentile of ``|d|``);
- a temperature gap: the least-squares slope of the trainer's log-probs on the rollout's is about
  ``T_rollout / T_trainer`` (``rldiag/mismatch/slope``, :mod:`rldiag.engine.mismatch`), and verl's
  trainer divides the logits by ``actor_rollout_ref.rollout.temperature``, so the rollout's
  effective temperature is about ``slope x`` that temperature;
- policy lag: verl's fully asynchronous trainer bounds it with ``async_training.staleness_threshold``
  (the share of extra samples the rollouter may produce ahead of a weight sync; verl's
  ``fully_async_rollouter.py``, ``set_max_required_samples``) and
  ``async_training.trigger_parameter_sync_step`` (trainer steps between two weight syncs).

:func:`fold_implied` keeps a cause another implies (``evidence.details["implied_by"]``, the
classifier's label) inside the dominant cause's evidence rather than as a second finding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rldiag.doctor.evaluators import Finding

RO = "actor_rollout_ref.rollout"
RC = "algorithm.rollout_correction"
#: the rollout-correction metrics a remedy quotes (mean over the window): the IS weights' normalised
#: effective sample size, the share of weights above the threshold, the share rejection masks
CORRECTION_METRICS = ("rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_is_ratio_fraction_high",
                      "rollout_corr/rollout_rs_masked_fraction")
#: verl's fully async trainer's keys bounding the policy lag (verl/experimental/fully_async_policy)
STALENESS_KEY = "async_training.staleness_threshold"
SYNC_KEY = "async_training.trigger_parameter_sync_step"

#: window metric -> its mean (NaN when not recomputed)
MeanFn = Callable[[str], float]


def _g(v: float) -> str:
    return f"{v:.3g}"


def _on(v: Any) -> bool:
    return v not in (None, False, "", "null", "none", "None")


def correction_state(settings: Mapping[str, Any], mean: MeanFn) -> tuple[str, str]:
    """``(already, suggestion)``: what the run's rollout correction already does (empty when it is
    off) and the correction still to try (empty when both IS and rejection are on)."""
    is_level, rs = settings.get(f"{RC}.rollout_is"), settings.get(f"{RC}.rollout_rs")
    done, todo = [], []
    if _on(is_level):
        thr = settings.get(f"{RC}.rollout_is_threshold")
        ess, high = mean(CORRECTION_METRICS[0]), mean(CORRECTION_METRICS[1])
        what = [f"IS ESS {ess:.2f}" if math.isfinite(ess) else "",
                f"{high:.1%} of the weights truncated at the threshold" if math.isfinite(high) else ""]
        seen = " and ".join(w for w in what if w)
        done.append(f"the run already sets {RC}.rollout_is={is_level} (threshold {thr})" + (f": {seen}" if seen else ""))
    else:
        todo.append(f"{RC}.rollout_is=token with rollout_is_threshold=2.0 (truncated IS)")
    if _on(rs):
        masked = mean(CORRECTION_METRICS[2])
        seen = f": it masks {masked:.1%} of the tokens" if math.isfinite(masked) else ""
        done.append(f"the run already sets {RC}.rollout_rs={rs} (threshold {settings.get(f'{RC}.rollout_rs_threshold')}){seen}")
    else:
        todo.append(f"{RC}.rollout_rs=token_k1 with rollout_rs_threshold=2.0 (rejection of the worst tokens)")
    already = "; ".join(done)
    if done and not todo:
        already += "; both corrections are on, so what is left must be fixed at its source"
    return already, " or ".join(todo)


def _correct(settings: Mapping[str, Any], mean: MeanFn, lead: str = "or correct with") -> str:
    """``or correct with X; the run already sets Y: IS ESS 0.97 ...`` (either part may be absent)."""
    already, todo = correction_state(settings, mean)
    return "; ".join(p for p in (f"{lead} {todo}" if todo else "", already) if p)


def truncation(settings: Mapping[str, Any], stats: Mapping[str, np.ndarray], mean: MeanFn) -> str:
    top_p, top_k = settings.get(f"{RO}.top_p"), settings.get(f"{RO}.top_k")
    p = 1.0 if top_p is None else float(top_p)
    k = -1 if top_k is None else int(top_k)
    floor = _median(stats.get("gap_abs_p99"))
    est = (f" The gap's floor (the median per-step 99th percentile of |log pi_old - log pi_rollout|, "
           f"{_g(floor)}) puts the effective top-p near exp(-{_g(floor)}) = {math.exp(-floor):.3f}."
           if math.isfinite(floor) else "")
    if p < 1.0 or k > 0:
        change = [f"{RO}.top_p=1.0 (now {p:g})" if p < 1.0 else "", f"{RO}.top_k=-1 (now {k})" if k > 0 else ""]
        head = ("The engine samples from a truncated distribution and reports log-probs renormalised over the kept "
                f"tokens, while the trainer scores the whole vocabulary. Sample the training rollouts with "
                f"{' and '.join(c for c in change if c)}")
    else:
        head = (f"The run's config already samples without truncation ({RO}.top_p={p:g}, top_k={k}), yet the gap is "
                "one-sided, so the truncation comes from elsewhere: the inference engine's own sampling defaults, "
                "which run.yaml does not record (vLLM and SGLang apply the model's generation_config.json, often "
                "top_p / top_k), a recipe or agent loop that overrides the request's sampling parameters, or min_p."
                f"{est} Find where it is set and make it 1.0")
    return f"{head}, {_correct(settings, mean, 'or keep it and correct with')}."


def temperature(settings: Mapping[str, Any], stats: Mapping[str, np.ndarray], mean: MeanFn) -> str:
    t_cfg = settings.get(f"{RO}.temperature")
    t = 1.0 if t_cfg is None else float(t_cfg)
    mode = settings.get(f"{RO}.logprobs_mode")
    slope = _median(stats.get("slope"))
    est = (f"The slope of the trainer's log-probs on the rollout's is {slope:.3f}, about T_rollout / T_trainer: the "
           f"rollout's effective temperature is roughly {slope:.3f} x {t:g} = {slope * t:.2f} against the trainer's {t:g} "
           f"({RO}.temperature, by which verl's trainer divides the logits); the log-softmax's normalisation pulls "
           "the slope towards 1, so the real ratio lies further from 1. " if math.isfinite(slope) else "")
    if mode is None or str(mode).startswith("raw"):
        now = mode if mode is not None else "null: the engine default, raw"
        fix = (f"Set {RO}.logprobs_mode=processed_logprobs (now {now}): "
               "the engine then reports log-probs after temperature, as the trainer computes them")
    else:
        fix = (f"{RO}.logprobs_mode is already {mode}, so the other temperature comes from elsewhere: an engine-side "
               "or per-request temperature (an agent loop, a recipe) the config does not record; make it equal to "
               f"{RO}.temperature")
    return f"{est}{fix}. Rollout correction cannot fix a systematic bias of this size."


def policy_lag(settings: Mapping[str, Any], stats: Mapping[str, np.ndarray], mean: MeanFn) -> str:
    lag = _median(stats.get("lag_mean"))
    lag_text = f" (mean policy lag {lag:.2f} steps)" if math.isfinite(lag) else ""
    have = [f"{k}={settings[k]}" for k in (STALENESS_KEY, SYNC_KEY) if settings.get(k) is not None]
    now = f" (the run's config has {', '.join(have)})" if have else ""
    return (f"Rows generated by older weights{lag_text} drift from the trainer's policy. Lower the staleness the "
            f"asynchronous trainer allows: in verl's fully async trainer {STALENESS_KEY} (the share of samples the "
            f"rollouter may generate ahead of a weight sync; 0 for none) and {SYNC_KEY} (trainer steps between weight "
            f"syncs; 1 syncs every step){now}. Or use {RC}.bypass_mode=true with a policy loss that expects it"
            f"{'; ' + _correct(settings, mean) if _correct(settings, mean) else ''}.")


def precision(settings: Mapping[str, Any], stats: Mapping[str, np.ndarray], mean: MeanFn) -> str:
    return ("Numeric noise (bf16 inference, other kernels). At bf16's level it needs nothing; larger, compute the "
            f"lm_head / log-softmax in float32 on both sides, {_correct(settings, mean)}.")


def outlier_tokens(settings: Mapping[str, Any], stats: Mapping[str, np.ndarray], mean: MeanFn) -> str:
    rs = settings.get(f"{RC}.rollout_rs")
    if _on(rs):
        masked = mean(CORRECTION_METRICS[2])
        seen = f" and masks {masked:.1%} of the tokens" if math.isfinite(masked) else ""
        act = f"{RC}.rollout_rs={rs} is already set{seen}: lower its threshold, or fix the engine path that produces them"
    else:
        act = f"mask them with {RC}.rollout_rs=token_k2 and a threshold, or fix the engine path that produces them"
    return ("A few tokens carry most of the mismatch (special tokens, tool-call boundaries, a broken kernel path). "
            f"Look at the listed tokens; {act}.")


def misaligned(settings: Mapping[str, Any], stats: Mapping[str, np.ndarray], mean: MeanFn) -> str:
    return ("The rollout log-probs are shifted against the tokens (an off-by-one, a dropped BOS, a chat-template "
            "token). Fix where the engine's log-probs are gathered; no correction setting can repair it.")


REMEDIES: dict[str, Callable[[Mapping[str, Any], Mapping[str, np.ndarray], MeanFn], str]] = {
    "sampling_truncation": truncation, "temperature": temperature, "policy_lag": policy_lag,
    "precision": precision, "outlier_tokens": outlier_tokens, "misaligned": misaligned,
}


def _median(v: Any) -> float:
    if v is None:
        return math.nan
    a = np.asarray(v, dtype=np.float64)
    a = a[np.isfinite(a)]
    return float(np.median(a)) if len(a) else math.nan


def mismatch_remedy(cause: str, settings: Mapping[str, Any], stats: Mapping[str, np.ndarray], mean: MeanFn,
                    default: str) -> str:
    """The remedy for ``cause`` on this run (``default``, the classifier's, for a cause without its
    own); ``stats``: the per-step ``rldiag/mismatch/*`` statistics (names without the prefix),
    ``mean(metric)``: a metric's mean over the finding's window (NaN when not recomputed)."""
    fn = REMEDIES.get(cause)
    return default if fn is None else fn(settings, stats, mean)


def fold_implied(findings: list[Finding]) -> list[Finding]:
    """``findings`` less each cause another of them implies (``evidence.details["implied_by"]``
    naming that cause): the implied one is kept in the dominant finding's
    ``evidence.details["implies"]`` (``[{"cause", "confidence", "message", "statistic"}]``), and its
    remedy is the dominant one's."""
    by_cause = {f.evidence.cause: f for f in findings if f.evidence.cause is not None}
    out = []
    for f in findings:
        implied_by = f.evidence.details.get("implied_by") if f.evidence.details else None
        parent = by_cause.get(str(implied_by)) if implied_by is not None else None
        if parent is None or parent is f:
            out.append(f)
            continue
        parent.evidence.details.setdefault("implies", []).append(
            {"cause": f.evidence.cause, "confidence": f.evidence.confidence, "message": f.message,
             "statistic": f.evidence.statistic})
    return out
