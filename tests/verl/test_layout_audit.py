"""The layout audit of the bundled samples against verl 0.9.1 itself.

``rldiag.layout_audit`` runs on copies of ``samples/grpo-tool`` and ``samples/ppo-gae`` (a few
steps). For each layout the audit recomputed, verl's side lays the same step out with verl's own
functions (the V1 trainer's ``_balance_batch`` with its padding, each rank's
``tensordict_utils.make_iterator`` and ``prepare_micro_batches``, as ``tests/verl/test_layout.py``
drives them), computes each micro-batch's losses and metrics with ``core_algos``
(``get_policy_loss_fn("vanilla")`` = ``compute_policy_loss_vanilla``, ``agg_loss``, ``kl_penalty``,
``compute_value_loss``) and the global batch info ``ppo_loss`` / ``value_loss`` of
``verl/workers/utils/losses.py`` put in the config, and combines them as the worker logs them
(``Metric`` with ``AggregationType.MEAN`` for the policy loss's metrics and the critic's clip
fraction and value mean, ``SUM`` for the globally normalised losses and the total ``loss``;
``Metric.aggregate_dp`` over ranks; ``reduce_metrics`` over mini-batches). Every metric the audit
calls layout-dependent must equal verl's under every layout; metrics it calls independent must be
equal across layouts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from tests.verl.harness import assert_close, padded, scalar

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.utils.metric import AggregationType, Metric, reduce_metrics  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

from rldiag import api  # noqa: E402
from rldiag.scenario.recompute import recompute  # noqa: E402
from tests.verl.test_layout import PAD, verl_dispatch, verl_worker_layout  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
STEPS = "1:3"
#: verl's actor metrics the worker logs with AggregationType.SUM (global batch info is set)
SUM = {"actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "actor/loss", "critic/vf_loss"}
#: what the audit must call layout-dependent on each sample (the log was made under the own layout)
DEPENDENT = {
    "grpo-tool": {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss"},
    "ppo-gae": {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss", "actor/entropy_loss", "critic/vf_loss",
                "critic/vpred_mean"},
}
INDEPENDENT = ("critic/advantages/mean", "response_length/mean", "critic/score/mean", "prompt_length/mean")


@pytest.fixture(scope="module", params=sorted(DEPENDENT))
def audited(request, tmp_path_factory):
    """(sample name, run copy, audit, step tables, rldiag's advantages and returns per step)."""
    name = request.param
    run = tmp_path_factory.mktemp("audit") / name
    shutil.copytree(SAMPLES / name, run, ignore=shutil.ignore_patterns("rldiag"))
    audit = api.layout_audit(run, steps=STEPS)
    # the advantages and returns do not depend on the layout: one recompute with the tokens
    rep = recompute(run, name="tokens", steps=STEPS, save_tokens=True, device="cpu")
    assert not rep.steps_failed
    sc = run / "rldiag" / "scenarios" / "tokens"
    tables, tokens = {}, {}
    for step in audit.steps:
        tables[step] = pq.read_table(next(p for p in (run / "batches").iterdir() if int(p.stem.split("_")[1]) == step))
        tokens[step] = pq.read_table(sc / "tokens" / f"step_{step:06d}.parquet")
    return name, run, audit, tables, tokens


def _config(run: Path) -> dict:
    return yaml.safe_load((run / "run.yaml").read_text())


def verl_params(layout: str, cfg: dict, rows: int) -> dict:
    """verl's own batch keys for the audit's layout ``layout`` of a run with config ``cfg``
    (mini-batches in prompts, micro-batches in rows per GPU), dp 1."""
    actor, n = cfg["actor_rollout_ref"]["actor"], cfg["actor_rollout_ref"]["rollout"]["n"]
    mini, micro = actor["ppo_mini_batch_size"], actor["ppo_micro_batch_size_per_gpu"]
    return {
        "own": dict(mini=mini, micro=micro, dynamic=False),
        "one_batch": dict(mini=rows // n, micro=rows, dynamic=False),  # ppo_mini_batch_size = train_batch_size
        "micro_batch_x0.5": dict(mini=mini, micro=micro // 2, dynamic=False),
        "dynamic_bsz=on": dict(mini=mini, micro=None, dynamic=True),
    }[layout]


def verl_layouts(monkeypatch, table, cfg: dict, p: dict, step: int):
    """(actor, critic) ``[mini][rank] -> [micro row lists]`` as verl's V1 trainer and workers cut
    the step (``PAD``: a padding row)."""
    n = cfg["actor_rollout_ref"]["rollout"]["n"]
    lengths = np.diff(table["response_mask"].combine_chunks().offsets.to_numpy())
    seq = (scalar(table, "prompt_length") + lengths).astype(int).tolist()
    config = {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": p["mini"]}, "rollout": {"n": n}},
              "critic": {"ppo_mini_batch_size": p["mini"]}, "trainer": {"critic_warmup": 0, "use_v1": True}}
    ranks = verl_dispatch(monkeypatch, seq, 1, config, step)

    def seq_of(j):
        return 128 if j == PAD else seq[j]

    return [verl_worker_layout(monkeypatch, ranks, seq_of, 1, p["mini"] * n, p["micro"], p["dynamic"], budget,
                               False, 42) for budget in (16384, 32768)]


def verl_update_metrics(table, tokens, actor_layout, critic_layout, cfg: dict, critic: bool) -> dict[str, float]:
    """One step's update metrics as verl's worker logs them on the given layouts."""
    a = cfg["actor_rollout_ref"]["actor"]
    agg = a["loss_agg_mode"]
    cols = ["old_log_probs", "log_probs", "entropy", "ref_log_prob", "response_mask"] + (["values", "vpreds"] if critic else [])
    full = {c: padded(table, c) for c in cols}
    full["advantages"], full["returns"] = padded(tokens, "advantages"), padded(tokens, "returns")
    rows = table.num_rows
    full = {c: torch.cat([v, torch.zeros(1, v.shape[1])]) for c, v in full.items()}  # row `rows`: a padding row
    lengths = np.append(np.diff(table["response_mask"].combine_chunks().offsets.to_numpy()), 1)
    clip = a["clip_ratio"]
    acfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                       loss_agg_mode=agg, clip_ratio=clip, clip_ratio_low=a["clip_ratio_low"] or clip,
                       clip_ratio_high=a["clip_ratio_high"] or clip, clip_ratio_c=a["clip_ratio_c"],
                       policy_loss=PolicyLossConfig(loss_mode=a["policy_loss"]["loss_mode"]))
    logged: dict[str, list[float]] = {}
    roles = [("actor", actor_layout)] + ([("critic", critic_layout)] if critic else [])
    for role, layout in roles:
        for ranks in layout:
            ids = [[[rows if j == PAD else j for j in mb] for mb in micros] for micros in ranks]
            mini_rows = [j for micros in ids for mb in micros for j in mb]
            info = dict(dp_size=1, batch_num_tokens=full["response_mask"][mini_rows].sum(), global_batch_size=len(mini_rows))
            acfg.global_batch_info.update(info, loss_scale_factor=None)
            per_rank = []
            for micros in ids:
                out: dict[str, Metric] = {}
                for idx in micros:
                    width = int(lengths[idx].max())
                    t = {c: v[idx, :width] for c, v in full.items()}
                    mask = t["response_mask"].bool()
                    if role == "actor":
                        pg, pg_metrics = core_algos.get_policy_loss_fn(a["policy_loss"]["loss_mode"])(
                            old_log_prob=t["old_log_probs"], log_prob=t["log_probs"], advantages=t["advantages"],
                            response_mask=mask, loss_agg_mode=agg, config=acfg, rollout_is_weights=None)
                        ent = core_algos.agg_loss(t["entropy"], mask, agg, **acfg.global_batch_info)
                        values = {**{k if k.startswith("actor/") else "actor/" + k: v for k, v in pg_metrics.items()},
                                  "actor/pg_loss": float(pg), "actor/entropy_loss": float(ent)}
                        loss = float(pg) - a["entropy_coeff"] * float(ent)
                        if a["use_kl_loss"]:
                            kld = core_algos.kl_penalty(t["log_probs"], t["ref_log_prob"], a["kl_loss_type"])
                            kl = core_algos.agg_loss(kld, mask, agg, **acfg.global_batch_info)
                            values["actor/kl_loss"] = float(kl)
                            loss += a["kl_loss_coef"] * float(kl)
                        values["actor/loss"] = loss  # the engine's "loss": the sum of each micro-batch's
                    else:
                        vf, vf_clip = core_algos.compute_value_loss(
                            vpreds=t["vpreds"], returns=t["returns"], values=t["values"], response_mask=mask,
                            cliprange_value=cfg["critic"]["cliprange_value"], loss_agg_mode=agg, **info)
                        values = {"critic/vf_loss": float(vf), "critic/vf_clipfrac": float(vf_clip),
                                  "critic/vpred_mean": float((t["vpreds"] * mask).sum() / (mask.sum() + 1e-8))}
                    for name, v in values.items():
                        kind = AggregationType.SUM if name in SUM else AggregationType.MEAN
                        out.setdefault(name, Metric(kind)).append(float(v))
                per_rank.append(out)
            for name in per_rank[0]:
                logged.setdefault(name, []).append(Metric.aggregate_dp([r[name] for r in per_rank]))
    return {k: float(v) for k, v in reduce_metrics(logged).items()}


def test_the_audit_names_the_layout_dependent_metrics_and_verl_agrees(monkeypatch, audited):
    name, run, audit, tables, tokens = audited
    cfg = _config(run)
    # verl's own metrics (rldiag's: a turn's share of the loss moves with the layout, verl logs no such thing)
    dependent = {m.metric for m in audit.dependent if not m.metric.startswith("rldiag/")}
    assert DEPENDENT[name] <= dependent, sorted(dependent)
    assert all(m.why for m in audit.dependent)
    ran = [x.name for x in audit.ran]
    assert ran == ["own", "one_batch", "micro_batch_x0.5", "dynamic_bsz=on"]
    assert {x.name for x in audit.skipped} == {"micro_batch_x2", "dp=2", "dp=4", "mini_batch_x0.5", "balance_batch=off"}
    checked: set[str] = set()
    verl_values: dict[tuple[str, int], list[float]] = {}
    for layout in ran:
        mine = {r["step"]: r for r in pq.read_table(run / "rldiag" / "sweeps" / "layout-audit" / layout
                                                    / "metrics.parquet").to_pylist()}
        for step, table in tables.items():
            p = verl_params(layout, cfg, table.num_rows)
            actor_v, critic_v = verl_layouts(monkeypatch, table, cfg, p, step)
            want = verl_update_metrics(table, tokens[step], actor_v, critic_v, cfg, critic=name == "ppo-gae")
            for metric in sorted(dependent):
                assert metric in want, f"{metric}: not a metric verl's update logs"
                assert_close(mine[step][metric], want[metric], f"{name} {layout} step {step} {metric}",
                             atol=5e-5, rtol=5e-5)
                checked.add(metric)
                verl_values.setdefault((metric, step), []).append(want[metric])
    assert checked == dependent
    # verl itself moves each of them: on some step its values under two layouts differ by more than 1e-5
    for metric in dependent:
        spreads = [(max(v) - min(v)) / (abs(v[0]) + 1e-12) for (m, _), v in verl_values.items() if m == metric]
        assert max(spreads) > 1e-5, (metric, spreads)


def test_metrics_the_audit_calls_independent_are_equal_across_layouts(audited):
    name, run, audit, _, _ = audited
    root = run / "rldiag" / "sweeps" / "layout-audit"
    frames = {x.name: {r["step"]: r for r in pq.read_table(root / x.name / "metrics.parquet").to_pylist()}
              for x in audit.ran}
    for metric in INDEPENDENT:
        m = audit.metric(metric)
        assert not m.layout_dependent and m.relative_spread == 0.0, metric
        for step in audit.steps:
            values = {layout: f[step][metric] for layout, f in frames.items()}
            assert len(set(values.values())) == 1, (metric, step, values)
    # the independent metrics are the data metrics and those computed where pi_old is
    for m in audit.metrics:
        if not m.layout_dependent and m.combination != "step":
            assert m.relative_spread <= 1e-5
    assert all(m.combination != "step" for m in audit.dependent)


def test_the_log_matches_the_run_s_own_layout_best(audited):
    """The samples' trainer updated on the own layout: where the layout matters, the log is
    closest to it."""
    _, _, audit, _, _ = audited
    for m in audit.dependent:
        if m.best_match is not None and m.metric != "actor/loss":
            assert m.best_match == "own", (m.metric, m.logged_errors)
