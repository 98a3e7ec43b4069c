"""Reference bands (rldiag/doctor/bands.py, bands.yaml): the table's checks, the conditions read
from a run's settings, the placement of a value, a finding's evidence.band, and docs/bands.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rldiag.doctor.bands import (
    BANDS_FILE,
    band_metrics,
    builtin_bands,
    parse_bands,
    place,
    place_means,
    read_bands,
    render_markdown,
    run_conditions,
)
from rldiag.doctor.evaluate import add_band
from rldiag.doctor.evaluators import Evidence, Finding
from rldiag.errors import ConfigError

DOC = Path(__file__).resolve().parents[2] / "docs" / "bands.md"
K3 = "rollout_corr/k3_kl"
EP = "actor_rollout_ref.actor.megatron.expert_model_parallel_size"


def _doc(**entry):
    base = {"metric": K3, "band": "b", "low": 0.0, "high": 1.0, "source": "https://example.org/x"}
    base.update(entry)
    return {"bands": [base]}


def test_the_shipped_table_loads_and_every_entry_has_a_source():
    bands = builtin_bands()
    assert len(bands) == 11 and all(b.source.strip() for b in bands)
    assert band_metrics()[:3] == [K3, "rldiag/mismatch/token_mult_prob_error", "rldiag/mismatch/gap_abs_mean"]
    dense, moe = [b for b in bands if b.metric == K3]
    assert (dense.low, dense.high, dense.conditions) == (1e-5, 1e-3, {"model": "dense"})
    assert (moe.low, moe.high, moe.conditions) == (1e-3, 1e-1, {"model": "moe"})
    assert read_bands(BANDS_FILE) == list(bands)


@pytest.mark.parametrize(("entry", "says"), [
    ({"metric": "actor/no_such_metric"}, "unknown metric 'actor/no_such_metric'"),
    ({"low": 2.0, "high": 1.0}, "low 2 is above high 1"),
    ({"conditions": {"hardware": "h100"}}, "unknown condition 'hardware'; valid: model, precision, policy"),
    ({"conditions": {"model": "sparse"}}, "condition 'model' takes dense or moe, got 'sparse'"),
    ({"conditions": {"ppo_epochs": 0}}, "condition 'ppo_epochs' takes a positive integer, got 0"),
    ({"low": None, "high": None}, "'low' and 'high' cannot both be null"),
    ({"low": "small"}, "'low' must be a finite number or null, got 'small'"),
    ({"source": ""}, "'source' is required"),
    ({"colour": "red"}, "unknown key(s) colour"),
])
def test_a_bad_entry_is_refused_naming_the_file_and_the_entry(entry, says):
    with pytest.raises(ConfigError) as err:
        parse_bands(_doc(**entry), "my_bands.yaml")
    assert "bands file my_bands.yaml, entry #1" in str(err.value) and says in str(err.value)


def test_a_file_that_is_not_a_band_list_is_refused(tmp_path):
    p = tmp_path / "b.yaml"
    p.write_text("bands: {metric: x}\n")
    with pytest.raises(ConfigError, match="must hold a mapping with a list under 'bands:'"):
        read_bands(p)
    p.write_text("bands: [&a [*a]]\n")  # a recursive alias: refused by the bounded loader, not expanded
    with pytest.raises(ConfigError):
        read_bands(p)


def test_conditions_from_the_resolved_settings():
    assert run_conditions({}) == {"model": None, "precision": None, "policy": None, "mini_batches": None,
                                  "ppo_epochs": None}
    got = run_conditions({"data.train_batch_size": 256, "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
                          "actor_rollout_ref.actor.ppo_epochs": 1, "actor_rollout_ref.rollout.dtype": "bfloat16",
                          EP: 8})
    assert got == {"model": "moe", "precision": "bf16", "policy": "off", "mini_batches": 4, "ppo_epochs": 1}
    one = run_conditions({"data.train_batch_size": 64, "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
                          "actor_rollout_ref.actor.ppo_epochs": 1, "rldiag.model": "dense", EP: 1})
    assert (one["policy"], one["model"], one["mini_batches"]) == ("on", "dense", 1)
    assert run_conditions({"actor_rollout_ref.actor.ppo_epochs": 2})["policy"] == "off"


def test_a_value_is_placed_in_the_bands_its_settings_select():
    both = place(K3, 3e-3, {})
    assert both["text"] == f"{K3} 0.003: above the dense band [1e-05, 0.001], inside the MoE band [0.001, 0.1]"
    assert [(b["band"], b["where"], b["assumed"]) for b in both["bands"]] == [("dense", "above", ["model"]),
                                                                               ("MoE", "inside", ["model"])]
    moe = place(K3, 3e-3, {EP: 8})
    assert [(b["band"], b["where"], b["assumed"]) for b in moe["bands"]] == [("MoE", "inside", [])]
    dense = place(K3, 5e-6, {"rldiag.model": "dense"})
    assert dense["text"] == f"{K3} 5e-06: below the dense band [1e-05, 0.001]"
    assert place(K3, 1e-3, {"rldiag.model": "dense"})["bands"][0]["where"] == "inside"  # bounds included
    none = place("actor/pg_clipfrac", 0.2, {})
    assert none["bands"] == [] and none["text"] == "actor/pg_clipfrac 0.2: no reference band"
    chi2 = place("rollout_corr/chi2_token", 1.5, {})
    assert chi2["text"] == "rollout_corr/chi2_token 1.5: above the verl health check band [-inf, 1]"


def test_means_over_steps_skip_non_finite_values_and_unbanded_metrics():
    got = place_means({"rollout_corr/rollout_is_eff_sample_size": [0.2, 0.3, float("nan"), 0.25],
                       "actor/pg_clipfrac": [0.1], "rollout_corr/kl": [float("nan")]}, {})
    assert len(got) == 1
    ess = got[0]
    assert ess["value"] == pytest.approx(0.25, abs=1e-15) and ess["steps"] == 3
    assert ess["statistic"] == "mean over 3 steps"
    assert ess["text"] == "rollout_corr/rollout_is_eff_sample_size 0.25: below the verl health check band [0.3, 1]"


def test_a_finding_on_a_banded_metric_carries_its_band():
    ev = Evidence(metric="rollout_corr/kl", steps=[3, 4], values=[0.1, 0.3])
    f = Finding("rollout_kl_growing", "t", "warning", "w", "m", ev)
    add_band(f, {})
    assert f.evidence.band is not None and f.evidence.band["value"] == pytest.approx(0.2)
    assert f.evidence.band["text"] == "rollout_corr/kl 0.2: above the verl health check band [-0.1, 0.1]"
    assert f.evidence.band["statistic"] == "mean of the evidence values"
    other = Finding("clipfrac_high", "t", "warning", "w", "m", Evidence(metric="actor/pg_clipfrac", values=[0.5]))
    add_band(other, {})
    assert other.evidence.band is None


def test_the_docs_table_is_the_yaml():
    text = DOC.read_text()
    table = re.search(r"<!-- bands-table:start -->\n(.*)<!-- bands-table:end -->", text, re.S)
    assert table, "docs/bands.md has lost its generated table's markers"
    assert table.group(1) == render_markdown(), "regenerate it: python -m rldiag.doctor.bands"
