"""verify on a run captured under a capture policy: the step metrics of a sampled step are
estimates, placed in their delete-a-group jackknife band (rldiag.analysis.sample_band), never
mismatches; the band is as wide as the sample's spread, not wider."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rldiag.analysis.sample_band import Z_BAND
from rldiag.analysis.verify import verify_run
from rldiag.io.capture_record import META_KEY
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run

GROUPS, KEPT, N, STEPS = 64, 16, 4, 6


def _with_logged_tokens(t: pa.Table) -> pa.Table:
    """The token columns a GRPO trainer's batch carries, from the whole batch: the score at each
    row's last token, and the score standardised within its prompt group (Shao et al. 2024,
    arXiv:2402.03300, eq. 3; unbiased std + 1e-6 as verl's compute_grpo_outcome_advantage) on
    the response tokens."""
    score = np.asarray(t["score"].to_numpy(), dtype=np.float64)
    uid = np.asarray(t["uid"].to_pylist())
    adv = np.empty_like(score)
    for u in np.unique(uid):
        g = uid == u
        adv[g] = (score[g] - score[g].mean()) / (score[g].std(ddof=1) + 1e-6)
    masks = t["response_mask"].to_pylist()
    rewards = [[0.0] * (len(m) - 1) + [float(s)] for m, s in zip(masks, score)]
    advantages = [[float(a) * x for x in m] for m, a in zip(masks, adv)]
    t = t.append_column("token_level_rewards", pa.array(rewards, pa.list_(pa.float32())))
    return t.append_column("advantages", pa.array(advantages, pa.list_(pa.float32())))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(whole run, sampled run): the sampled run's batch files hold 16 of each step's 64 prompt
    groups (with the capture record a capture writes), and its metrics.jsonl holds the whole
    batch's metrics, as the trainer logged them."""
    base = tmp_path_factory.mktemp("band")
    cfg = {"algorithm": {"adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0},
           "actor_rollout_ref": {"actor": {"loss_agg_mode": "token-mean", "clip_ratio": 0.2}},
           "data": {"max_response_length": 48}}
    whole = write_synth_run(base / "whole", SynthSpec(steps=STEPS, prompts=GROUPS, n=N, max_len=48, seed=3,
                                                      config=cfg, write_metrics=False))
    assert recompute(whole).ok
    table = pq.read_table(whole / "rldiag" / "scenarios" / "baseline" / "metrics.parquet").to_pylist()
    logged = [{"step": r.pop("step"), "data": {k: v for k, v in r.items()
                                               if isinstance(v, float) and math.isfinite(v)}} for r in table]
    for f in sorted((whole / "batches").glob("*.parquet")):
        pq.write_table(_with_logged_tokens(pq.read_table(f)), f)
    sampled = base / "sampled"
    shutil.copytree(whole, sampled, ignore=shutil.ignore_patterns("rldiag"))
    (sampled / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in logged))
    cfg_s = {**cfg, "rldiag": {"capture": {"groups": KEPT / GROUPS, "seed": 11}}}
    (sampled / "run.yaml").write_text(yaml.safe_dump(cfg_s, sort_keys=False))
    rng = np.random.default_rng(11)
    for f in sorted((sampled / "batches").glob("*.parquet")):
        t = pq.read_table(f)
        uids = sorted(set(t["uid"].to_pylist()))
        keep = set(rng.choice(uids, KEPT, replace=False).tolist())
        t = t.filter(pa.array([u in keep for u in t["uid"].to_pylist()]))
        record = {"policy": {"groups": KEPT / GROUPS, "seed": 11}, "groups": GROUPS, "groups_kept": KEPT,
                  "rows": GROUPS * N, "rows_kept": t.num_rows}
        t = t.replace_schema_metadata({**(t.schema.metadata or {}), META_KEY: json.dumps(record).encode()})
        pq.write_table(t, f)
    return whole, sampled, {x["step"]: x["data"] for x in logged}


def test_estimates_sit_in_their_band_and_the_band_is_as_wide_as_the_sample(runs):
    _, sampled, logged = runs
    report = verify_run(sampled, candidates=False)
    assert report.status == "match"
    assert report.sampled_steps == {s: KEPT / GROUPS for s in range(1, STEPS + 1)}
    bands = report.estimate_bands
    # the estimates that vary with the sample are placed in a band on every step
    for name in ("critic/score/mean", "critic/rewards/mean", "response_length/mean", "actor/entropy"):
        assert bands[name]["steps"] == STEPS and bands[name]["kind"] == "band", (name, bands.get(name))
    banded = {n: b for n, b in bands.items() if b["kind"] == "band"}
    assert len(banded) >= 10
    inside = sum(b["inside"] for b in banded.values())
    total = sum(b["steps"] for b in banded.values())
    assert not any(b["outside"] for b in banded.values()), {n: b for n, b in banded.items() if b["outside"]}
    # a step where the kept groups happen not to vary (no clipped reply among them) is not placed
    assert inside >= 0.98 * total, {n: b for n, b in banded.items() if b["not_placed"]}
    # a band far too wide would contain anything: the largest distance of the logged value, in
    # standard errors, is of the order of a normal deviate (not ~0), and none reaches Z_BAND
    zs = sorted(b["max_z"] for b in banded.values())
    assert 0.5 < zs[len(zs) // 2] < Z_BAND, zs
    assert "critic/score/mean" in report.estimates and "inside its sampling band on 6 of 6" in \
        report.estimates["critic/score/mean"]
    # a maximum is checked one way: the kept rows' maximum is at most the whole step's
    assert bands["response_length/max"]["kind"] == "max"
    assert bands["response_length/max"]["inside"] == STEPS


def test_a_logged_value_far_from_the_estimate_is_outside_its_band_but_never_a_mismatch(runs, tmp_path, capsys):
    _, sampled, logged = runs
    run = tmp_path / "run"
    shutil.copytree(sampled, run)
    wrong = {s: dict(v) for s, v in logged.items()}
    wrong[3]["critic/score/mean"] += 5.0  # the scores are in [0, 1]: five is no sampling error
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in wrong.items()))
    report = verify_run(run, candidates=False)
    assert report.status == "match" and report.exit_code == 0
    b = report.estimate_bands["critic/score/mean"]
    assert (b["inside"], b["outside"], b["worst_step"]) == (STEPS - 1, 1, 3)
    assert b["max_z"] > 50
    from rldiag.cli.main import main

    assert main(["verify", str(run), "--no-candidates"]) == 0
    out = capsys.readouterr().out
    assert "critic/score/mean: the logged value outside the sample's band on 1 of 6 steps" in " ".join(out.split())
