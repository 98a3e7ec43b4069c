"""verl's V1 update loop on the batching settings, against ``rldiag recompute``.

The loop is driven here in verl's order, each piece being verl's own function: the trainer's
``trainer.balance_batch`` (``calculate_workload`` + ``get_seqlen_balanced_partitions``), the
dispatch of one contiguous chunk per DP rank, each rank's mini-batches of
``mini_batch_size / dp`` rows and micro-batches (``train_mini_batch``), per micro-batch the
policy loss, ``agg_loss`` and ``compute_value_loss`` with the global batch info the engine sets
(``dp_size``, the mini-batch's token count over all ranks, ``global_batch_size``), tensors padded
to the micro-batch's longest row (V1's nested tensors), and verl's metric reduction
(``Metric.aggregate_dp`` over ranks, SUM / MEAN over micro-batches, ``reduce_metrics`` over
mini-batches).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.verl.harness import assert_close, long_tail_table, padded, run_rldiag, scalar, write_run

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.utils.metric import AggregationType, Metric, reduce_metrics  # noqa: E402
from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

ACTOR = "actor_rollout_ref.actor."
SUM_METRICS = {"actor/pg_loss", "actor/entropy_loss", "critic/vf_loss"}


def _order(table, dp: int, balance: bool) -> list[int]:
    rows = table.num_rows
    if not (balance and dp > 1):
        return list(range(rows))
    seq_len = torch.tensor(scalar(table, "prompt_length")) + torch.tensor(
        np.diff(table["response_mask"].combine_chunks().offsets.to_numpy()))
    parts = get_seqlen_balanced_partitions(calculate_workload(seq_len).tolist(), k_partitions=dp, equal_size=True)
    return [j for p in parts for j in p]


def verl_update_metrics(table, tokens, dp, mini, micro, agg, loss_mode="vanilla", balance=True) -> dict[str, float]:
    """The metrics verl's V1 loop logs for one step (one epoch)."""
    full = {c: padded(table, c) for c in ("old_log_probs", "log_probs", "entropy", "values", "vpreds", "response_mask")}
    full["advantages"], full["returns"] = padded(tokens, "advantages"), padded(tokens, "returns")
    lengths = np.diff(table["response_mask"].combine_chunks().offsets.to_numpy())
    order = _order(table, dp, balance)
    ranks = [c.tolist() for c in torch.tensor(order).chunk(dp)]  # DataProto.chunk: contiguous, ceil(R / dp)
    per_rank = (mini // dp) if mini else len(ranks[0])
    n_mini = len(ranks[0]) // per_rank
    cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                      loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=loss_mode))
    logged: dict[str, list[float]] = {}
    for k in range(n_mini):
        minis = [r[k * per_rank:(k + 1) * per_rank] for r in ranks]
        rows_k = [j for m in minis for j in m]
        info = dict(dp_size=dp, batch_num_tokens=full["response_mask"][rows_k].sum(), global_batch_size=len(rows_k))
        cfg.global_batch_info.update(info, loss_scale_factor=None)
        per_rank_metrics = []
        for m in minis:
            step = micro or len(m)
            out: dict[str, Metric] = {}
            for a in range(0, len(m), step):
                idx = m[a:a + step]
                width = int(lengths[idx].max())
                t = {c: v[idx, :width] for c, v in full.items()}
                mask = t["response_mask"].bool()
                pg, pg_metrics = core_algos.get_policy_loss_fn(loss_mode)(
                    old_log_prob=t["old_log_probs"], log_prob=t["log_probs"], advantages=t["advantages"],
                    response_mask=mask, loss_agg_mode=agg, config=cfg, rollout_is_weights=None)
                vf, vf_clip = core_algos.compute_value_loss(
                    vpreds=t["vpreds"], returns=t["returns"], values=t["values"], response_mask=mask,
                    cliprange_value=0.5, loss_agg_mode=agg, **info)
                values = {
                    **pg_metrics, "actor/pg_loss": float(pg),
                    "actor/entropy_loss": float(core_algos.agg_loss(t["entropy"], mask, agg, **info)),
                    "critic/vf_loss": float(vf), "critic/vf_clipfrac": float(vf_clip),
                    "critic/vpred_mean": float((t["vpreds"] * mask).sum() / mask.sum()),
                }
                for name, v in values.items():
                    kind = AggregationType.SUM if name in SUM_METRICS else AggregationType.MEAN
                    out.setdefault(name, Metric(kind)).append(float(v))
            per_rank_metrics.append(out)
        for name in per_rank_metrics[0]:
            logged.setdefault(name, []).append(Metric.aggregate_dp([r[name] for r in per_rank_metrics]))
    return reduce_metrics(logged)


CASES = [  # (dp, mini rows, micro rows): 24 rows per step
    (1, None, None), (1, None, 3), (1, 8, 2), (1, 12, 4), (2, None, 4), (2, 8, 2), (2, 24, 3), (4, 8, 1),
    (4, 24, 2), (3, 12, 2),
]


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm", "seq-mean-token-mean"])
@pytest.mark.parametrize("dp, mini, micro", CASES)
def test_batching_matches_verls_update_loop(tmp_path, dp, mini, micro, agg, balance):
    rng = np.random.default_rng(dp * 1000 + (mini or 0) * 10 + (micro or 0))
    tables = [long_tail_table(rng, s) for s in (1, 2)]
    run = write_run(tmp_path / "run", tables, {"algorithm": {"adv_estimator": "gae", "lam": 0.9}})
    metrics, tokens = run_rldiag(run, {
        "rldiag.dp_size": dp, "rldiag.mini_batch_size": mini, "rldiag.micro_batch_size": micro,
        # balance off: the rows are taken as already in the trainer's dispatch order (the V1 trainer
        # balances every step; rldiag then deals them as stored)
        ACTOR + "loss_agg_mode": agg, "rldiag.rows_balanced": not balance,
    })
    for table in tables:
        step = int(table["step"][0].as_py())
        want = verl_update_metrics(table, tokens[step], dp, mini, micro, agg, balance=balance)
        for name, value in want.items():
            assert_close(metrics[step][name], value, f"dp={dp} mini={mini} micro={micro} {agg} {name}, step {step}",
                         atol=5e-5, rtol=5e-5)
