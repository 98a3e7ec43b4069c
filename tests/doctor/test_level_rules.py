"""Rules on levels users ask about: the diagnostic sequence and token IS ESS (below verl's health
band, 0.3) and the absolute reference KL per token (above 0.5 nats); each finding placed in its
band, with its state; and the one source of healthy bands (rldiag.api.rule_limits)."""

from __future__ import annotations

import polars as pl

from rldiag import api
from rldiag.doctor.evaluate import evaluate_rules
from rldiag.doctor.rules import load_rules
from rldiag.doctor.signals import SignalTable

SEQ, TOK, REF = ("rldiag/diag_is/seq/eff_sample_size", "rldiag/diag_is/token/eff_sample_size",
                 "rldiag/ref_kl/old/k3")


def _run(series: dict[str, list[float]]):
    rules = [r for r in load_rules(()) if r.id in ("diag_is_seq_ess_low", "diag_is_token_ess_low", "ref_kl_high")]
    table = SignalTable()
    for i in range(len(next(iter(series.values())))):
        table.add_recomputed(i + 1, {k: v[i] for k, v in series.items()})
    return evaluate_rules(rules, table, {})


def test_each_fires_at_its_level_and_not_below():
    res = _run({SEQ: [0.9, 0.2, 0.14, 0.1, 0.12, 0.15], TOK: [0.9, 0.8, 0.7, 0.9, 0.95, 0.9],
                REF: [0.0, 0.2, 0.6, 1.1, 1.4, 1.6]})
    got = {f.rule: f for f in res.findings}
    assert set(got) == {"diag_is_seq_ess_low", "ref_kl_high"} and "diag_is_token_ess_low" in res.passed
    seq = got["diag_is_seq_ess_low"]
    assert seq.evidence.steps == [2, 3, 4, 5, 6] and seq.evidence.values == [0.2, 0.14, 0.1, 0.12, 0.15]
    band = seq.evidence.band["bands"][0]
    assert (band["band"], band["low"], band["where"]) == ("verl health check", 0.3, "below")
    ref = got["ref_kl_high"]
    assert ref.evidence.steps == [3, 4, 5, 6]  # above 0.5 at 4 of 6 steps (the rule fires at 30 %)
    # the mean of steps 4-6 (1.37) against 1-3 (0.27): worsening since the first of the last three
    assert (ref.evidence.state, ref.evidence.state_since) == ("worsening", 4)
    # at the level itself: nothing (strict comparisons)
    calm = _run({SEQ: [0.3] * 6, TOK: [0.3] * 6, REF: [0.5] * 6})
    assert not calm.findings


def test_the_truncation_run_has_a_low_sequence_ess(tmp_path):
    """Top-p 0.9 planted: every token's log-prob is renormalised, and the sequence weights (their
    product over 200 tokens) collapse; the token weights do not."""
    from rldiag.doctor import diagnose
    from rldiag.synth import MismatchSpec, write_mismatch_run

    run = write_mismatch_run(tmp_path / "run", MismatchSpec(cause="sampling_truncation", steps=4, rows=32))
    rep = diagnose(run, counterfactual=False)
    base = pl.read_parquet(run / "rldiag" / "scenarios" / "baseline" / "metrics.parquet")
    f = next(f for f in rep.findings if f.rule == "diag_is_seq_ess_low")
    assert f.evidence.values == base[SEQ].to_list() and max(f.evidence.values) < 0.3
    assert "diag_is_token_ess_low" in rep.passed


def test_the_step_checklists_bands_are_the_rules():
    limits = api.rule_limits()
    rules = {r.id: r for r in load_rules(())}
    for metric, limit in limits.items():
        rule = rules[limit["rule"]]
        assert rule.metric == metric and limit["above"] == rule.params.get("above")
        assert limit["below"] == rule.params.get("below")
    assert limits[SEQ]["below"] == 0.3 and limits[REF]["above"] == 0.5
