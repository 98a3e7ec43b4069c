"""Synthetic runs with a planted cause of rollout-vs-trainer log-prob mismatch.

``rollout_log_probs`` (the inference engine's, pi_rollout) and ``old_log_probs`` (the trainer's,
pi_old) of a real run differ for a handful of reasons, each with its own fingerprint on the
per-token differences ``d = old - rollout``. :func:`write_mismatch_run` writes a run directory
with one of them planted (:data:`MISMATCH_CAUSES`), from real softmax distributions: every actor
token has logits ``z = scale * g`` over ``vocab`` entries (``g ~ N(0, 1)``, ``scale ~
exp(N(1.0, 0.7))``: confident and flat distributions mixed), the trainer scores the token at
temperature 1.0 in float32, and the rollout samples it from its own distribution and reports its
own log-prob:

- ``clean``: the same distribution; the two columns are equal.
- ``float_noise``: equal, plus ``N(0, 1e-7)`` (far below bf16's resolution).
- ``sampling_truncation``: top-p sampling, log-probs renormalised over the kept set (vLLM's
  processed logprobs): ``d = log(kept mass) <= 0``.
- ``temperature``: the rollout samples and scores at ``rollout_temperature``, the trainer at 1.0
  (``temperature_mode="raw"``: verl's raw_logprobs instead, the rollout samples at the temperature
  and reports T=1 log-probs, the trainer scores at the temperature).
- ``precision``: the rollout scores from bf16-rounded logits.
- ``misaligned``: the rollout series shifted by ``shift`` positions within each row.
- ``policy_lag``: each row sampled by an older policy (``policy_version = step - 1 - lag``); the
  policy of version ``v`` has logits ``z + drift * (v - (step - 1)) * D`` (``D ~ N(0, 1)`` a fixed
  direction per token), the trainer's being version ``step - 1``: lag-0 rows are exact, the gap
  grows with the lag.
- ``outlier_tokens``: clean, but for ``outliers_per_step`` actor tokens a step (special tokens in
  ``response_tokens``) the rollout's log-prob is far off, both ways.

The other columns follow :func:`rldiag.synth.batches.synth_step_table`, so the run recomputes
under rldiag's defaults; ``run.yaml`` describes the sampling that was planted (or the default
sampling with ``config_matches=False``). At tool-observation positions (``response_mask`` 0)
``rollout_log_probs`` is 0.0, as verl's agent loop stores it. Vectorised numpy, deterministic
under the seed.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from rldiag.errors import ConfigError
from rldiag.io.run_layout import RunLayout
from rldiag.io.staged import replace_file
from rldiag.synth.batches import list_array

MISMATCH_CAUSES = ("clean", "float_noise", "sampling_truncation", "temperature", "precision", "misaligned",
                   "policy_lag", "outlier_tokens")
#: The text of the outlier tokens (``response_tokens``), by kind: the rollout's log-prob far
#: below the trainer's, then far above (a forced token the engine reports as certain).
OUTLIER_TEXT = ("</s>", "<|tool_call|>")


@dataclass
class MismatchSpec:
    cause: str = "clean"
    steps: int = 8
    rows: int = 64  # rows per step, in groups of n sharing a uid
    n: int = 8
    tokens: int = 200  # response length of every row, unless min_len and max_len are given
    min_len: int | None = None  # with max_len: lengths uniform in [min_len, max_len]
    max_len: int | None = None
    vocab: int = 64
    seed: int = 0
    first_step: int = 1
    tool_prob: float = 0.2  # share of rows with a tool-observation span (response_mask 0)
    text: bool = True  # write response_tokens (list<string>) too
    #: run.yaml's sampling settings describe the planted cause; False: the defaults whatever was planted
    config_matches: bool = True
    #: write policy_version / policy_version_min for every cause (on-policy rows: step - 1);
    #: policy_lag always writes them
    versions: bool = False
    # the causes' parameters (the defaults plant a clearly visible cause)
    rollout_temperature: float = 0.7  # temperature
    #: temperature: "rollout" (the rollout samples and scores at rollout_temperature, the trainer at
    #: 1.0) or "raw" (verl's raw_logprobs: sampled at rollout_temperature, the rollout reports the
    #: T=1 log-prob, the trainer scores at rollout_temperature)
    temperature_mode: str = "rollout"
    top_p: float = 0.9  # sampling_truncation
    shift: int = 1  # misaligned: rollout[t] = old[t + shift] within each row
    max_lag: int = 3  # policy_lag: each row's lag uniform in 0..max_lag (at most step - 1)
    drift: float = 0.15  # policy_lag: the logits move by drift * versions * D
    outliers_per_step: int = 5  # outlier_tokens
    noise: float = 1e-7  # float_noise: the noise's std


def _check(spec: MismatchSpec) -> None:
    problems = []
    if spec.cause not in MISMATCH_CAUSES:
        problems.append(f"unknown cause {spec.cause!r}; use one of {', '.join(MISMATCH_CAUSES)}")
    if spec.n < 1 or spec.rows < 1 or spec.rows % spec.n:
        problems.append(f"rows ({spec.rows}) must be a positive multiple of n ({spec.n})")
    lo, hi = _length_bounds(spec)
    if lo < 1 or hi < lo:
        problems.append(f"response lengths must be 1 <= min_len <= max_len, not {lo}..{hi}")
    if spec.vocab < 2 or spec.steps < 1:
        problems.append("vocab must be at least 2 and steps at least 1")
    if not 0 < spec.top_p <= 1 or spec.rollout_temperature <= 0:
        problems.append("top_p must be in (0, 1] and rollout_temperature positive")
    if spec.temperature_mode not in ("rollout", "raw"):
        problems.append(f"temperature_mode {spec.temperature_mode!r}: use rollout or raw")
    if spec.cause == "misaligned" and (spec.shift == 0 or abs(spec.shift) >= lo):
        problems.append(f"shift ({spec.shift}) must be non-zero and shorter than every row ({lo} tokens)")
    if spec.max_lag < 0 or spec.outliers_per_step < 0:
        problems.append("max_lag and outliers_per_step must be non-negative")
    if problems:
        raise ConfigError("MismatchSpec: " + "; ".join(problems))


def _length_bounds(spec: MismatchSpec) -> tuple[int, int]:
    if spec.min_len is not None and spec.max_len is not None:
        return spec.min_len, spec.max_len
    return spec.tokens, spec.tokens


def _softmax(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise log-softmax and softmax of float32 ``(T, V)`` logits, in float32."""
    s = z - z.max(axis=1, keepdims=True)
    e = np.exp(s)
    total = e.sum(axis=1, keepdims=True)
    return s - np.log(total), e / total


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to bfloat16 (round to nearest even), as float32: torch's
    ``x.to(torch.bfloat16).float()`` for finite values."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def _sample(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of probabilities ``p`` ``(T, V)``, by the inverse of its CDF."""
    cdf = np.cumsum(p, axis=1)
    u = rng.random(len(p)) * cdf[:, -1]
    return np.minimum((cdf < u[:, None]).sum(axis=1), p.shape[1] - 1)


def _at(lp: np.ndarray, tok: np.ndarray) -> np.ndarray:
    return np.take_along_axis(lp, tok[:, None], axis=1)[:, 0]


def _top_p(p32: np.ndarray, top_p: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Top-p sampling from probabilities ``p32`` ``(T, V)``: the smallest set of most probable tokens whose mass
    reaches ``top_p`` (the one crossing it kept), renormalised. (tokens, log of the kept mass)."""
    p = p32.astype(np.float64)
    ps = np.sort(p, axis=1)[:, ::-1]
    cs = np.cumsum(ps, axis=1)
    n_keep = ((cs - ps) < top_p).sum(axis=1)
    kept = np.where(p >= ps[np.arange(len(p)), n_keep - 1][:, None], p, 0.0)
    cdf = np.cumsum(kept, axis=1)
    mass = cdf[:, -1]
    tok = np.minimum((cdf < (rng.random(len(p)) * mass)[:, None]).sum(axis=1), p.shape[1] - 1)
    return tok, np.log(mass)


def _step_table(spec: MismatchSpec, step: int) -> pa.Table:
    rng = np.random.default_rng([spec.seed, step])
    rows, vocab, cause = spec.rows, spec.vocab, spec.cause
    lo, hi = _length_bounds(spec)
    lengths = rng.integers(lo, hi + 1, size=rows)
    total = int(lengths.sum())
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    row_of = np.repeat(np.arange(rows), lengths)
    pos = np.arange(total) - offsets[:-1][row_of]
    # tool span: positions [a, a + w) of some rows get mask 0 (never the first or last token)
    has_tool = rng.random(rows) < spec.tool_prob
    a = np.maximum(1, (lengths * rng.uniform(0.2, 0.5, rows)).astype(np.int64))
    w = np.maximum(1, (lengths * rng.uniform(0.1, 0.3, rows)).astype(np.int64))
    in_tool = has_tool[row_of] & (pos >= a[row_of]) & (pos < np.minimum(a + w, lengths - 1)[row_of])
    actor = ~in_tool

    # the trainer's distribution per token (version step - 1 for policy_lag), temperature 1.0
    scale = np.exp(rng.normal(1.0, 0.7, total)).astype(np.float32)
    z = (scale[:, None] * rng.standard_normal((total, vocab), dtype=np.float32)).astype(np.float32)
    lp_train, p_train = _softmax(z)
    lp_roll, p_roll = lp_train, p_train  # the rollout's distribution, where it samples from a different one
    tok = None
    shifted_logmass = None
    lag = np.zeros(rows, dtype=np.int64)
    if cause == "sampling_truncation":
        tok, shifted_logmass = _top_p(p_train, spec.top_p, rng)
    elif cause == "temperature":
        lp_temp, p_temp = _softmax((z / np.float32(spec.rollout_temperature)).astype(np.float32))
        if spec.temperature_mode == "raw":  # sampled at T, reported raw (T=1); the trainer at T
            lp_roll, lp_train, p_train, tok = lp_train, lp_temp, p_temp, _sample(p_temp, rng)
        else:
            lp_roll, p_roll = lp_temp, p_temp
    elif cause == "precision":
        lp_roll, p_roll = _softmax(bf16_round(z))
    elif cause == "policy_lag":
        lag = np.floor(rng.random(rows) * (np.minimum(spec.max_lag, step - 1) + 1)).astype(np.int64)
        d = rng.standard_normal((total, vocab), dtype=np.float32)
        shift_l = (np.float32(spec.drift) * lag[row_of].astype(np.float32))[:, None]
        lp_roll, p_roll = _softmax((z - shift_l * d).astype(np.float32))
    if tok is None:
        tok = _sample(p_roll, rng)
    # tool-observation tokens are not sampled by the policy: any token, the trainer scores it anyway
    tok = np.where(actor, tok, rng.integers(0, vocab, total))
    old = _at(lp_train, tok)
    rollout = _at(lp_roll, tok)
    if shifted_logmass is not None:  # renormalised over the kept set: >= old, a log-prob still
        rollout = np.minimum(old.astype(np.float64) - shifted_logmass, 0.0).astype(np.float32)
    elif cause == "policy_lag":
        rollout = np.where(lag[row_of] == 0, old, rollout)
    elif cause == "float_noise":
        rollout = (old + rng.normal(0.0, spec.noise, total)).astype(np.float32)
    elif cause == "misaligned":
        src = offsets[:-1][row_of] + np.clip(pos + spec.shift, 0, lengths[row_of] - 1)
        rollout = old[src]
    text_id = tok
    if cause == "outlier_tokens" and spec.outliers_per_step:
        rollout, text_id = _outliers(spec, old, tok, actor, rng)
    rollout = np.where(actor, rollout, np.float32(0.0)).astype(np.float32)

    entropy = -(p_train * lp_train).sum(axis=1, dtype=np.float32)
    p_success = np.repeat(rng.uniform(0, 1, rows // spec.n), spec.n)
    score = (rng.random(rows) < p_success).astype(np.float32)
    uid = np.repeat([f"s{step}-p{i}" for i in range(rows // spec.n)], spec.n)
    cols = {
        "uid": pa.array(uid, pa.string()),
        "step": pa.array(np.full(rows, step, dtype=np.int64)),
        "score": pa.array(score, pa.float32()),
        "prompt_length": pa.array(rng.integers(8, 64, rows).astype(np.int64)),
        "response_mask": list_array(actor.astype(np.int8), lengths, pa.int8()),
        "old_log_probs": list_array(old, lengths, pa.float32()),
        "log_probs": list_array((old + rng.normal(0, 0.02, total)).astype(np.float32), lengths, pa.float32()),
        "ref_log_prob": list_array((old + rng.normal(0, 0.05, total)).astype(np.float32), lengths, pa.float32()),
        "rollout_log_probs": list_array(rollout, lengths, pa.float32()),
        "entropy": list_array(entropy.astype(np.float32), lengths, pa.float32()),
    }
    if cause == "policy_lag" or spec.versions:
        version = step - 1 - lag
        cols["policy_version"] = pa.array(version, pa.int64())
        cols["policy_version_min"] = pa.array(np.maximum(version - rng.integers(0, 2, rows), 0), pa.int64())
    if spec.text:
        words = pa.array([f"tok{i}" for i in range(vocab)] + list(OUTLIER_TEXT), pa.string())
        cols["response_tokens"] = list_array(words.take(pa.array(text_id, pa.int64())), lengths, pa.string())
    return pa.table(cols)


def _outliers(spec: MismatchSpec, old: np.ndarray, tok: np.ndarray, actor: np.ndarray,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """outlier_tokens: ``outliers_per_step`` actor tokens with a corrupted rollout log-prob, about
    half far below the trainer's (``old - U(4, 8)``, text ``</s>``) and the others forced ones the
    rollout reports as near certain while the trainer finds them unlikely (``old < -2``, text
    ``<|tool_call|>``). (rollout log-probs, text ids: the token's, or ``vocab`` + its index in :data:`OUTLIER_TEXT`)."""
    k = spec.outliers_per_step
    rollout = old.copy()
    text_id = tok.copy()
    forced_pool = np.flatnonzero(actor & (old < -2.0))
    n_forced = min(len(forced_pool), k // 2)
    forced = rng.choice(forced_pool, size=n_forced, replace=False)
    rest = np.setdiff1d(np.flatnonzero(actor), forced)
    if len(rest) < k - n_forced:
        raise ConfigError(f"MismatchSpec: {k} outliers per step need more actor tokens than a step has")
    low = rng.choice(rest, size=k - n_forced, replace=False)
    rollout[low] = (old[low] - rng.uniform(4.0, 8.0, len(low))).astype(np.float32)
    rollout[forced] = (-rng.uniform(1e-4, 1e-2, n_forced)).astype(np.float32)
    text_id[low] = spec.vocab
    text_id[forced] = spec.vocab + 1
    return rollout, text_id


def _config(spec: MismatchSpec) -> dict:
    rollout = {"n": spec.n, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "calculate_log_probs": True,
               "logprobs_mode": "processed_logprobs"}
    if spec.config_matches and spec.cause == "temperature":
        rollout.update(temperature=spec.rollout_temperature, logprobs_mode="raw_logprobs")
    elif spec.config_matches and spec.cause == "sampling_truncation":
        rollout.update(top_p=spec.top_p)
    return {
        "algorithm": {"adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0},
        "actor_rollout_ref": {"actor": {"loss_agg_mode": "token-mean", "clip_ratio": 0.2}, "rollout": rollout},
        "data": {"max_response_length": _length_bounds(spec)[1]},
    }


def _write_text(text: str, path: Path) -> None:
    path.write_text(text)


def write_mismatch_run(path: str | Path, spec: MismatchSpec | None = None) -> Path:
    """Write a run directory with ``spec.cause`` planted between ``rollout_log_probs`` and
    ``old_log_probs``; return its path."""
    spec = spec or MismatchSpec()
    _check(spec)
    root = Path(path)
    layout = RunLayout(root)
    layout.batches_dir.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_dump(_config(spec), sort_keys=False)
    replace_file(layout.run_config, functools.partial(_write_text, config))
    lines = []
    for step in range(spec.first_step, spec.first_step + spec.steps):
        table = _step_table(spec, step)
        replace_file(layout.batch_file(step, width=1), functools.partial(pq.write_table, table))
        score = float(np.mean(table["score"].to_numpy()))
        lines.append(json.dumps({"step": step, "data": {"critic/score/mean": score}}))
    text = "\n".join(lines) + "\n"
    replace_file(layout.metrics_file, functools.partial(_write_text, text))
    return root
