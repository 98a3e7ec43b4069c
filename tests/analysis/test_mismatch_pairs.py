"""The mismatch diagnosis on gaps made by a generator of their own (numpy, neither rldiag.synth
nor the toy), for the three failure classes issue 35 found: bf16 noise with a handful of
corrupted tokens named outlier_tokens only (precision disappeared); a policy lag's heavy-tailed
gaps read as outlier_tokens; a colder rollout temperature (0.75-0.8) named at about 0.7. Each
cause is now decided on its own fingerprint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rldiag.analysis.mismatch import diagnose_mismatch
from rldiag.engine.layout import Rows
from rldiag.engine.mismatch import mismatch_stats

STEPS, ROWS, LENGTH, VOCAB = 6, 48, 10, 16


def _softmax_tokens(rng: np.random.Generator, n: int, temperature: float = 1.0, scale: float = 1.5):
    """``n`` tokens sampled at ``temperature`` from flat-ish softmax distributions over VOCAB;
    returns the log-probs of the sampled tokens at T=1 and at ``temperature``."""
    z = rng.normal(0, scale, (n, VOCAB))

    def logsoftmax(a):
        a = a - a.max(-1, keepdims=True)
        return a - np.log(np.exp(a).sum(-1, keepdims=True))

    at_t = logsoftmax(z / temperature)
    tok = np.array([rng.choice(VOCAB, p=np.exp(row)) for row in at_t])
    pick = np.arange(n), tok
    return logsoftmax(z)[pick], at_t[pick]


def _diagnose(old: np.ndarray, roll: np.ndarray, lag: np.ndarray | None = None):
    """Diagnose ``(STEPS * ROWS * LENGTH,)`` log-probs laid out as STEPS steps of ROWS rows."""
    rows = Rows.from_lengths(torch.full((STEPS * ROWS,), LENGTH, dtype=torch.long))
    step_ids = torch.arange(STEPS).repeat_interleave(ROWS)
    stats = mismatch_stats(torch.from_numpy(old.astype(np.float32)), torch.from_numpy(roll.astype(np.float32)),
                           torch.ones(len(old)), rows, step_ids, STEPS,
                           lag=None if lag is None else torch.from_numpy(lag))
    return diagnose_mismatch(list(range(1, STEPS + 1)), {k: v.numpy() for k, v in stats.items()}, {})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_noise_and_a_handful_of_corrupted_tokens_are_both_named(seed):
    rng = np.random.default_rng(seed)
    n = STEPS * ROWS * LENGTH
    old, _ = _softmax_tokens(rng, n)
    roll = old + rng.normal(0, 0.004, n)  # bf16-level noise
    per_step = ROWS * LENGTH
    for s in range(STEPS):  # 3 corrupted tokens a step, both ways
        at = s * per_step + rng.choice(per_step, 3, replace=False)
        roll[at] += rng.choice([-3.0, 2.5], 3)
    diag = _diagnose(old, roll)
    assert diag.confidences["outlier_tokens"] >= 0.8 and diag.confidences["precision"] >= 0.8, diag.confidences
    assert {c.cause: c.severity for c in diag.causes} == {"outlier_tokens": "warning", "precision": "info"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_lags_heavy_tailed_gaps_are_the_lag_not_outlier_tokens(seed):
    rng = np.random.default_rng(seed)
    n = STEPS * ROWS * LENGTH
    old, _ = _softmax_tokens(rng, n)
    lag = rng.integers(0, 4, STEPS * ROWS)
    token_lag = np.repeat(lag, LENGTH)
    drift = 0.03 * token_lag * rng.standard_t(1.5, n)  # heavy-tailed, growing with the lag
    roll = old + rng.normal(0, 0.004, n) + drift
    diag = _diagnose(old, roll, lag)
    assert diag.confidences["policy_lag"] >= 0.8, diag.confidences
    assert diag.confidences["outlier_tokens"] < 0.5 and [c.cause for c in diag.causes] == ["policy_lag"]


@pytest.mark.parametrize("temperature", [0.75, 0.8])
def test_a_colder_rollout_temperature_is_named_with_confidence(temperature):
    """verl's trainer scores at the rollout temperature; the engine reports raw (T=1) log-probs. The
    distributions are flat (no token has probability 0.5: a small model's early steps), so only
    the unconfident tokens show the gap's sign."""
    rng = np.random.default_rng(int(temperature * 100))
    raw, at_t = _softmax_tokens(rng, STEPS * ROWS * LENGTH, temperature, scale=0.5)
    assert np.exp(raw).max() < 0.5
    diag = _diagnose(at_t, raw)
    assert diag.confidences["temperature"] >= 0.8, diag.confidences
    assert [c.cause for c in diag.causes] == ["temperature"]
