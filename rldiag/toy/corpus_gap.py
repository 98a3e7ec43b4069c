"""The calibration corpus's rollout/trainer gap cases: each cause of a gap produced by the toy
rollout engine itself (:mod:`rldiag.toy.engine`, ``ToyConfig.max_lag``), alone and in pairs.

Imported by :mod:`rldiag.toy.corpus` (its ``EXTENSIONS``), it registers one family per entry of
:data:`GAP_CASES`. Every run samples on the bfloat16 copy of the policy, as every corpus run does
(its ``precision`` noise at severity ``info``); on top of it:

| family | the engine | labelled |
| --- | --- | --- |
| ``gap_precision`` | the log-softmax in bfloat16 | precision (expected severity ``info``: gap std about 0.006) |
| ``gap_truncation`` | top-p 0.95 / 0.9 / 0.8, or top-k 8 / 4 (of 16 tokens), processed log-probs | sampling_truncation |
| ``gap_temperature`` | raw log-probs at temperature 0.75 / 0.8 / 0.9 / 1.25 | temperature |
| ``gap_lag`` | each prompt group from weights 0..``max_lag`` updates old, ``max_lag`` 1 / 2 / 3 | policy_lag |
| ``gap_misaligned`` | the log-prob list off by one | misaligned |
| ``gap_outliers`` | one token id's log-prob read off by -4 / +3 logits, on 8-12 % of its occurrences | outlier_tokens |
| ``gap_precision_outliers`` | the two above (no lag: the outliers are in on-policy rows) | precision, outlier_tokens |
| ``gap_truncation_lag`` | top-p 0.9 and ``max_lag`` 2 / 3 | sampling_truncation, policy_lag |
| ``gap_temperature_precision`` | raw log-probs at 0.8 and the log-softmax in bfloat16 | temperature, precision |
| ``gap_lag_outliers`` | ``max_lag`` 2 and the outlier kernel | policy_lag; outlier_tokens ``implied_by`` policy_lag |
| ``gap_large_lag`` | ``max_lag`` 3, at a learning rate 3 times the default | policy_lag; precision ``implied_by`` policy_lag |

A pair is labelled with both causes when each keeps its own fingerprint (identifiable); where one
cause masks the other (outliers inside lagged rows; the bfloat16 noise under a large lag), with the
dominant cause and the other as ``implied_by`` it. :data:`SMALLEST` lists the smallest planted
effect each cause must be named at.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rldiag.toy.config import EngineOptions, ToyConfig, grpo_tool
from rldiag.toy.corpus import Case, Family, Series, register

#: the labels' kind of a rollout/trainer gap (as the bfloat16 copy's ``info`` label)
GAP_KIND = "rollout_gap"
#: the networks and batches of the gap runs: 8 prompts x 4 samples (about 200 actor tokens a step)
GAP_SIZE = dict(prompts_per_step=8, n=4, mini_batch_prompts=4, d_model=32, n_layers=1)
#: steps per gap run, every size (a gap is there from the first step; the lag from the second)
GAP_STEPS = 8
#: the token id the outlier kernel gets wrong (the digit 0: about 1 in 10 actor tokens)
OUTLIER_TOKEN = 0
#: (logit error, share of the token's occurrences hit) of the outlier kernel, cycled: about 2-3
#: tokens of a step's 200-300, 1 %
OUTLIERS = ((-4.0, 0.1), (3.0, 0.12), (-4.0, 0.08))
TRUNCATIONS = (dict(top_p=0.95), dict(top_p=0.9), dict(top_p=0.8), dict(top_k=8), dict(top_k=4))
TEMPERATURES = (0.75, 0.8, 0.9, 1.25)
LAGS = (1, 2, 3)
BF16_SOFTMAX = dict(softmax_dtype="bfloat16")

#: the smallest planted effect each cause must be named at (>= 0.8; docs/mismatch.md gives the
#: smaller ones measured on train seeds)
SMALLEST = {
    "precision": "the log-softmax in bfloat16 (gap std about 0.006 over the bfloat16 copy's 0.003)",
    "sampling_truncation": "top-p 0.95 (top-k 8 of 16 tokens)",
    "temperature": "raw log-probs at temperature 0.9 (and 1.25 above 1)",
    "policy_lag": "max_lag 1 (half the prompt groups one update old) at the default learning rate 1e-3",
    "misaligned": "an off-by-one in the log-prob list",
    "outlier_tokens": "one token id's logit read 3-4 off on 8 % of its occurrences (under 1 % of the actor tokens)",
}


def _outliers(index: int) -> dict[str, Any]:
    err, rate = OUTLIERS[index % len(OUTLIERS)]
    return dict(outlier_token=OUTLIER_TOKEN, outlier_rate=rate, outlier_logit_error=err)


@dataclass(frozen=True)
class GapCase:
    """One family: the engine's settings of its ``index``-th run (``engine``: the
    :class:`EngineOptions` fields; ``trainer``: other ToyConfig fields), the causes it is
    labelled with and the causes they imply (``implied``: cause -> the dominant cause)."""

    name: str
    settings: Callable[[int], tuple[dict[str, Any], dict[str, Any]]]
    causes: tuple[str, ...]
    implied: tuple[tuple[str, str], ...] = ()
    runs: tuple[int, int] = (2, 20)  # small (one run per split), full


GAP_CASES = (
    GapCase("gap_precision", lambda i: (BF16_SOFTMAX, {}), ("precision",)),
    GapCase("gap_truncation", lambda i: (TRUNCATIONS[i % len(TRUNCATIONS)], {}), ("sampling_truncation",)),
    GapCase("gap_temperature", lambda i: (dict(logprobs_mode="raw_logprobs"),
                                          dict(temperature=TEMPERATURES[i % len(TEMPERATURES)])), ("temperature",)),
    GapCase("gap_lag", lambda i: ({}, dict(max_lag=LAGS[i % len(LAGS)])), ("policy_lag",)),
    GapCase("gap_misaligned", lambda i: (dict(logprob_shift=1), {}), ("misaligned",)),
    GapCase("gap_outliers", lambda i: (_outliers(i), {}), ("outlier_tokens",)),
    GapCase("gap_precision_outliers", lambda i: ({**BF16_SOFTMAX, **_outliers(i)}, {}),
            ("precision", "outlier_tokens"), runs=(1, 10)),
    GapCase("gap_truncation_lag", lambda i: (dict(top_p=0.9), dict(max_lag=(2, 3)[i % 2])),
            ("sampling_truncation", "policy_lag"), runs=(1, 10)),
    GapCase("gap_temperature_precision", lambda i: (dict(logprobs_mode="raw_logprobs", **BF16_SOFTMAX),
                                                    dict(temperature=0.8)), ("temperature", "precision"), runs=(1, 10)),
    GapCase("gap_lag_outliers", lambda i: (_outliers(i), dict(max_lag=2)), ("policy_lag",),
            (("outlier_tokens", "policy_lag"),), runs=(1, 10)),
    GapCase("gap_large_lag", lambda i: ({}, dict(max_lag=3, actor_lr=3e-3)), ("policy_lag",),
            (("precision", "policy_lag"),), runs=(1, 10)),
)


def gap_config(case: GapCase, seed: int, steps: int, index: int) -> ToyConfig:
    """The ``index``-th run's trainer settings."""
    engine, trainer = case.settings(index)
    return grpo_tool(**{**GAP_SIZE, "steps": steps, "seed": seed, **trainer},
                     engine=EngineOptions(**engine))


def _builder(case: GapCase) -> Callable[[int, int, int], Case]:
    def build(seed: int, steps: int, index: int = 0) -> Case:
        cfg = gap_config(case, seed, steps, index)
        engine, trainer = case.settings(index)
        tags = {"causes": list(case.causes), **engine, **trainer}
        return Case(f"{case.name}-{index:02d}-s{seed}", case.name, cfg, tags)

    return build


#: how the onset of a gap cause is read: from the settings, which hold from the first step
ONSET_RULE = ("the rollout engine's settings hold from the first step; policy_lag from the first step with "
              "lagged rows (step 2: the first with older weights)")


def _labeller(case: GapCase) -> Callable[[Case, list[int], Series], list[dict[str, Any]]]:
    def label(c: Case, steps: list[int], series: Series) -> list[dict[str, Any]]:
        def onset(cause: str) -> int | None:
            first = 1 if cause == "policy_lag" else 0
            return steps[first] if len(steps) > first else None

        out = [{"kind": GAP_KIND, "cause": cause, "onset_step": onset(cause), "signal": "rldiag/mismatch/*",
                "onset_rule": ONSET_RULE} for cause in case.causes]
        out += [{"kind": GAP_KIND, "cause": cause, "implied_by": by, "onset_step": onset(by),
                 "signal": "rldiag/mismatch/*", "onset_rule": ONSET_RULE} for cause, by in case.implied]
        if "precision" in case.causes:
            out[case.causes.index("precision")]["expected_severity"] = "info"
        return out

    return label


def register_all() -> None:
    """Register every family of :data:`GAP_CASES` with the corpus."""
    for case in GAP_CASES:
        register(Family(case.name, _builder(case), {"small": case.runs[0], "full": case.runs[1]}, _labeller(case),
                        steps={"small": GAP_STEPS, "full": GAP_STEPS}))


#: the floors of issue 35: a labelled cause is named at this confidence or more, any other cause
#: stays below :data:`OTHER` (``precision`` at severity ``info`` excepted: the bfloat16 copy's)
NAMED, OTHER = 0.8, 0.5


def verdict(labels: dict[str, Any], causes: list[dict[str, Any]], confidences: dict[str, float]) -> list[str]:
    """What a diagnosis gets wrong about a labelled run, in words (empty: every floor holds).

    ``labels``: the run's ``labels.json``; ``causes``: the causes found, each ``{"cause",
    "confidence", "severity", "implied": [{"cause", ...}]}``; ``confidences``: every cause's run
    confidence. A labelled cause needs :data:`NAMED`; a cause implied by another must be listed
    in that cause's ``implied`` and stay below :data:`OTHER` on its own; every other cause stays
    below :data:`OTHER`, except ``precision`` at severity ``info``."""
    gap = [p for p in labels.get("pathologies", []) if p.get("kind") == GAP_KIND]
    named = {p["cause"] for p in gap if not p.get("implied_by")}
    implied = {p["cause"]: p["implied_by"] for p in gap if p.get("implied_by")}
    found = {c["cause"]: c for c in causes}
    wrong = [f"{c} named at {confidences.get(c, 0.0):.2f} < {NAMED}" for c in sorted(named)
             if confidences.get(c, 0.0) < NAMED]
    for c, by in sorted(implied.items()):
        listed = [i["cause"] for i in found.get(by, {}).get("implied", [])]
        if c not in listed:
            wrong.append(f"{c} not reported as implied by {by}")
        if confidences.get(c, 0.0) >= OTHER:
            wrong.append(f"{c} named on its own at {confidences[c]:.2f}, though implied by {by}")
    for c, v in sorted(confidences.items()):
        if c in named or c in implied or v < OTHER:
            continue
        if c == "precision" and found.get(c, {}).get("severity") == "info":
            continue
        wrong.append(f"{c} named at {v:.2f} ({found.get(c, {}).get('severity')}) but not planted")
    return wrong


register_all()
