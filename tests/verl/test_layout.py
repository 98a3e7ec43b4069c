"""verl's batch layout, as its V1 trainer and its workers build it, against rldiag's segments.

verl's side is driven with verl's own functions, in the trainer's order: ``PPOTrainer.
_balance_batch`` (which calls ``_get_required_batch_multiple`` and
``upsample_batch_to_divisible_size`` for the padding rows, then ``calculate_workload`` and
``get_seqlen_balanced_partitions``), the dispatch of contiguous chunks, each rank's
``tensordict_utils.make_iterator`` (the shuffle, seeded ``data_loader_seed + rank``) and
``prepare_micro_batches`` (fixed micro-batches or ``rearrange_micro_batches`` under
``use_dynamic_bsz``; its all-reduces over the DP group are served by the ranks running in threads
that meet at a barrier). The legacy trainer's ``RayPPOTrainer._balance_batch`` is called too.
Compared: the partition row for row (every micro-batch of every rank of every mini-batch, padding
rows included), and the step's actor and critic metrics computed by verl's loss functions on that
layout, against ``rldiag recompute``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rldiag.config.settings import resolve_settings
from tests.verl.harness import assert_close, long_tail_table, padded, run_rldiag, scalar, write_run

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo import padding_utils  # noqa: E402
from verl.utils import seqlen_balancing  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import AggregationType, Metric, reduce_metrics  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402

from tests.capture.verl_steps import import_v1  # noqa: E402

PAD = -1
N = 4  # rollout.n of long_tail_table
SUM_METRICS = {"actor/pg_loss", "actor/entropy_loss", "critic/vf_loss"}


class _Meta:
    """verl's ``KVBatchMeta`` as ``_balance_batch`` uses it: keys, tags, ``reorder``."""

    def __init__(self, keys, tags, partition_id="train", fields=None, extra_info=None):
        self.keys, self.tags, self.partition_id = list(keys), list(tags), partition_id
        self.fields, self.extra_info = fields, extra_info or {}

    def __len__(self) -> int:
        return len(self.keys)

    def reorder(self, idx) -> None:
        self.keys = [self.keys[i] for i in idx]
        self.tags = [self.tags[i] for i in idx]


class _TQ:
    """The TransferQueue calls of ``upsample_batch_to_divisible_size``: the first row as the
    padding template's source, and the write of the padding rows (not needed here)."""

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        return [{"prompts": torch.ones(3, dtype=torch.long), "responses": torch.ones(2, dtype=torch.long),
                 "response_mask": torch.ones(2, dtype=torch.long)}]

    def kv_batch_put(self, **_):
        return None


def _config(c: dict) -> dict:
    """verl's config keys of one layout case ``c``."""
    actor = {"ppo_mini_batch_size": c["mini"] // N, "ppo_micro_batch_size_per_gpu": c.get("micro"),
             "use_dynamic_bsz": c.get("dynamic", False), "ppo_max_token_len_per_gpu": c.get("budget", 16384),
             "shuffle": c.get("shuffle", False), "data_loader_seed": c.get("seed", 42)}
    critic = {"ppo_mini_batch_size": c.get("critic_mini", c["mini"]) // N,
              "ppo_micro_batch_size_per_gpu": c.get("critic_micro", c.get("micro")),
              "use_dynamic_bsz": c.get("dynamic", False), "ppo_max_token_len_per_gpu": c.get("critic_budget", 32768),
              "shuffle": c.get("critic_shuffle", c.get("shuffle", False)), "data_loader_seed": c.get("critic_seed", 42)}
    return {"algorithm": {"adv_estimator": "gae", "lam": 0.9},
            "actor_rollout_ref": {"actor": actor, "rollout": {"n": N}},
            "critic": critic, "trainer": {"critic_warmup": c.get("warmup", 0), "use_v1": c.get("v1", True)}}


def verl_dispatch(monkeypatch, seq_lens: list[int], dp: int, config: dict, step: int) -> list[list[int]]:
    """Each rank's rows after verl's ``_balance_batch`` (V1: with its padding rows, ``PAD``)."""
    cfg = OmegaConf.create(config)
    if cfg.trainer.use_v1:
        tb = import_v1(monkeypatch)
        monkeypatch.setattr(padding_utils, "tq", _TQ())
        monkeypatch.setattr(padding_utils, "KVBatchMeta", _Meta)
        fake = SimpleNamespace(actor_rollout_wg=SimpleNamespace(_dispatch_info={"actor": list(range(dp))}),
                               tokenizer=SimpleNamespace(eos_token_id=0), use_critic=True, config=cfg, global_steps=step)
        fake._get_required_batch_multiple = lambda d: tb.PPOTrainer._get_required_batch_multiple(fake, d)
        meta = _Meta([f"r{i}" for i in range(len(seq_lens))], [{"seq_len": s} for s in seq_lens])
        out = tb.PPOTrainer._balance_batch(fake, meta, metrics={})
        order = [int(k[1:]) if k.startswith("r") else PAD for k in out.keys]
    else:
        from verl import DataProto
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        width = max(seq_lens)
        mask = (torch.arange(width)[None, :] < torch.tensor(seq_lens)[:, None]).long()
        batch = DataProto.from_dict({"attention_mask": mask, "row": torch.arange(len(seq_lens))})
        fake = SimpleNamespace(_get_dp_size=lambda wg, role: dp, actor_rollout_wg=None, config=cfg)
        RayPPOTrainer._balance_batch(fake, batch, metrics={})
        order = batch.batch["row"].tolist()
    chunk = len(order) // dp
    return [order[r * chunk:(r + 1) * chunk] for r in range(dp)]


class _DPGroup:
    """The all-reduces of ``rearrange_micro_batches`` over ranks that run in threads."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, dp: int):
        self.barrier = threading.Barrier(dp)
        self.slots: list[torch.Tensor | None] = [None] * dp
        self.local = threading.local()

    def is_initialized(self) -> bool:
        return True

    def all_reduce(self, tensor, op=None, group=None):
        self.slots[self.local.rank] = tensor.clone()
        self.barrier.wait()
        stacked = torch.stack([s for s in self.slots if s is not None])
        value = stacked.min(0).values if op == self.ReduceOp.MIN else stacked.max(0).values
        self.barrier.wait()
        tensor.copy_(value)

    def run(self, fns):
        out: list = [None] * len(fns)

        def one(r):
            self.local.rank = r
            try:
                out[r] = fns[r]()
            except (AssertionError, ValueError, threading.BrokenBarrierError) as exc:  # the others must not wait
                out[r] = exc
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(len(fns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


def verl_worker_layout(monkeypatch, ranks, seq_of, dp, mini, micro, dynamic, budget, shuffle, seed):
    """``[mini-batch][rank] -> micro-batches (row lists)`` as ``train_mini_batch`` and
    ``prepare_micro_batches`` cut each rank's rows; raises what verl raises."""
    per_rank = []
    for r, rows in enumerate(ranks):
        td = TensorDict({"row": torch.tensor(rows)}, batch_size=[len(rows)])
        it = tu.make_iterator(td, mini_batch_size=mini // dp, epochs=1, seed=seed + r,
                              dataloader_kwargs={"shuffle": shuffle})
        per_rank.append([mb["row"].tolist() for mb in it])
    group = _DPGroup(dp)
    monkeypatch.setattr(seqlen_balancing, "dist", group)
    monkeypatch.setattr(seqlen_balancing, "get_device_name", lambda: "cpu")  # the all-reduces' tensors
    layout = []
    for k in range(len(per_rank[0])):
        def cut(rows):
            ids = torch.nested.as_nested_tensor([torch.zeros(seq_of(j), dtype=torch.long) for j in rows],
                                                layout=torch.jagged)
            td = TensorDict({"row": torch.tensor(rows), "input_ids": ids}, batch_size=[len(rows)])
            tu.assign_non_tensor(td, use_dynamic_bsz=dynamic, max_token_len_per_gpu=budget,
                                 micro_batch_size_per_gpu=micro or len(rows))
            micro_batches, _ = prepare_micro_batches(data=td, dp_group=object(), same_micro_num_in_dp=True)
            return [mb["row"].tolist() for mb in micro_batches]

        results = group.run([lambda rows=per_rank[r][k]: cut(rows) for r in range(dp)])
        for res in results:
            if isinstance(res, Exception) and not isinstance(res, threading.BrokenBarrierError):
                raise res
        group.barrier.reset()
        layout.append(results)
    return layout


def verl_layouts(monkeypatch, seq_lens, dp, c, step=1):
    """(actor, critic) layouts: ``[mini][rank] -> [micro row lists]``, padding rows ``PAD``."""
    config = _config(c)
    ranks = verl_dispatch(monkeypatch, seq_lens, dp, config, step)
    pad_len = padding_utils.SYNTHETIC_PADDING_SEQ_LEN

    def seq_of(j):
        return pad_len if j == PAD else seq_lens[j]

    out = []
    for role in ("actor", "critic"):
        rc = config["actor_rollout_ref"]["actor"] if role == "actor" else config["critic"]
        out.append(verl_worker_layout(
            monkeypatch, ranks, seq_of, dp, rc["ppo_mini_batch_size"] * N, rc["ppo_micro_batch_size_per_gpu"],
            rc["use_dynamic_bsz"], rc["ppo_max_token_len_per_gpu"], rc["shuffle"], rc["data_loader_seed"]))
    return out


def _verl_cells(layout) -> list[tuple[int, int, tuple[int, ...], int]]:
    """(mini, rank, real rows, padding rows) of every micro-batch, sorted."""
    return sorted((k, r, tuple(sorted(j for j in mb if j != PAD)), sum(j == PAD for j in mb))
                  for k, ranks in enumerate(layout) for r, micros in enumerate(ranks) for mb in micros)


def _rldiag_cells(seg, rows: int) -> list[tuple[int, int, tuple[int, ...], bool]]:
    members: dict[int, list[int]] = {i: [] for i in range(seg.n_seg)}
    for j, s in enumerate(seg.seg_ids.tolist()[:rows]):
        members[s].append(j)
    mini_of = seg.seg_mini.tolist()
    first = {}
    for k in mini_of:  # mini-batch index within the step
        first.setdefault(k, len(first))
    return sorted((first[mini_of[i]], int(seg.seg_rank[i]), tuple(sorted(members[i])), bool(seg.seg_pad[i]))
                  for i in range(seg.n_seg))


CASES = [  # rows, dp and the config's batching (mini / micro in rows; budget in tokens)
    dict(rows=20, dp=2, mini=8, micro=2),  # 4 padding rows (to a multiple of 8)
    dict(rows=21, dp=4, mini=8, micro=1, shuffle=True, seed=7),  # 3 padding rows, shuffled ranks
    dict(rows=24, dp=3, mini=12, micro=2, shuffle=True, critic_shuffle=False),
    dict(rows=22, dp=2, mini=8, dynamic=True, budget=200, critic_budget=420),  # token budgets
    dict(rows=23, dp=4, mini=8, dynamic=True, budget=300, shuffle=True, seed=3),
    dict(rows=18, dp=2, mini=12, critic_mini=4, micro=3, critic_micro=1),  # the critic's own batching
    dict(rows=21, dp=3, mini=12, micro=2, warmup=5),  # the actor not updating yet: pad to the critic's
    dict(rows=24, dp=4, mini=8, micro=1, v1=False),  # the legacy trainer: its in-rank order
]


def _case_table(c, seed):
    rng = np.random.default_rng(seed)
    table = long_tail_table(rng, 1, prompts=(c["rows"] + N - 1) // N, n=N)
    return table.slice(0, c["rows"])


def _seq_lens(table) -> list[int]:
    lengths = np.diff(table["response_mask"].combine_chunks().offsets.to_numpy())
    return (scalar(table, "prompt_length") + lengths).astype(int).tolist()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_partition_matches_verl_row_for_row(monkeypatch, case, seed):
    from rldiag.engine.microbatch import segmentations_for

    c = CASES[case]
    table = _case_table(c, 100 * case + seed)
    seq = _seq_lens(table)
    actor_v, critic_v = verl_layouts(monkeypatch, seq, c["dp"], c)
    s = resolve_settings(config=_config(c), overrides={"rldiag.dp_size": c["dp"], "rldiag.verl_version": "0.9.1"})
    rows = table.num_rows
    actor, critic = segmentations_for(torch.zeros(rows, dtype=torch.long), 1, s, torch.tensor(seq), steps=[1])
    for name, mine, theirs in (("actor", actor, actor_v), ("critic", critic, critic_v)):
        want = [(k, r, rows_, pads > 0) for k, r, rows_, pads in _verl_cells(theirs)]
        assert _rldiag_cells(mine, rows) == want, f"{name} {c} seed {seed}"
        n_rows = {k: sum(len(mb) for micros in ranks for mb in micros) for k, ranks in enumerate(theirs)}
        assert sorted(set(mine.batch_size().tolist())) == sorted(set(map(float, n_rows.values())))


def test_dynamic_bsz_errors_where_verl_raises(monkeypatch):
    from rldiag.engine.microbatch import segmentations_for

    c = dict(rows=20, dp=2, mini=8, dynamic=True, budget=60)  # shorter than the longest rows
    table = _case_table(c, 1)
    seq = _seq_lens(table)
    with pytest.raises(AssertionError, match="max_token_len"):
        verl_layouts(monkeypatch, seq, c["dp"], c)
    s = resolve_settings(config=_config(c), overrides={"rldiag.dp_size": 2, "rldiag.verl_version": "0.9.1"})
    actor, _ = segmentations_for(torch.zeros(20, dtype=torch.long), 1, s, torch.tensor(seq), steps=[1])
    assert [bad.tolist() for bad in actor.failed.values()] == [[True]]
    assert "exceeds the token budget 60" in next(iter(actor.failed))


# ---- the metrics verl logs on that layout ------------------------------------------------------


def verl_metrics(table, tokens, actor_layout, critic_layout, dp, agg, loss_mode="vanilla") -> dict[str, float]:
    """verl's update metrics of one step on the given layouts; a padding row is one masked token."""
    cols = ("old_log_probs", "log_probs", "entropy", "values", "vpreds", "response_mask")
    full = {c: padded(table, c) for c in cols}
    full["advantages"], full["returns"] = padded(tokens, "advantages"), padded(tokens, "returns")
    rows = table.num_rows
    full = {c: torch.cat([v, torch.zeros(1, v.shape[1])]) for c, v in full.items()}  # row `rows`: the padding row
    lengths = np.append(np.diff(table["response_mask"].combine_chunks().offsets.to_numpy()), 1)
    cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                      loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=loss_mode))
    logged: dict[str, list[float]] = {}
    for role, layout in (("actor", actor_layout), ("critic", critic_layout)):
        for ranks in layout:
            ids = [[[rows if j == PAD else j for j in mb] for mb in micros] for micros in ranks]
            mini_rows = [j for micros in ids for mb in micros for j in mb]
            info = dict(dp_size=dp, batch_num_tokens=full["response_mask"][mini_rows].sum(),
                        global_batch_size=len(mini_rows))
            cfg.global_batch_info.update(info, loss_scale_factor=None)
            per_rank = []
            for micros in ids:
                out: dict[str, Metric] = {}
                for idx in micros:
                    width = int(lengths[idx].max())
                    t = {c: v[idx, :width] for c, v in full.items()}
                    mask = t["response_mask"].bool()
                    if role == "actor":
                        pg, pg_metrics = core_algos.get_policy_loss_fn(loss_mode)(
                            old_log_prob=t["old_log_probs"], log_prob=t["log_probs"], advantages=t["advantages"],
                            response_mask=mask, loss_agg_mode=agg, config=cfg, rollout_is_weights=None)
                        values = {**pg_metrics, "actor/pg_loss": float(pg),
                                  "actor/entropy_loss": float(core_algos.agg_loss(t["entropy"], mask, agg, **info))}
                    else:
                        vf, vf_clip = core_algos.compute_value_loss(
                            vpreds=t["vpreds"], returns=t["returns"], values=t["values"], response_mask=mask,
                            cliprange_value=0.5, loss_agg_mode=agg, **info)
                        values = {"critic/vf_loss": float(vf), "critic/vf_clipfrac": float(vf_clip),
                                  "critic/vpred_mean": float((t["vpreds"] * mask).sum() / (mask.sum() + 1e-8))}
                    for name, v in values.items():
                        kind = AggregationType.SUM if name in SUM_METRICS else AggregationType.MEAN
                        out.setdefault(name, Metric(kind)).append(float(v))
                per_rank.append(out)
            for name in per_rank[0]:
                logged.setdefault(name, []).append(Metric.aggregate_dp([r[name] for r in per_rank]))
    return reduce_metrics(logged)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_metrics_match_verl_on_its_layout(monkeypatch, tmp_path, case, agg):
    c = CASES[case]
    table = _case_table(c, 1000 + case)
    seq = _seq_lens(table)
    actor_v, critic_v = verl_layouts(monkeypatch, seq, c["dp"], c)
    config = _config(c)
    config["actor_rollout_ref"]["actor"]["loss_agg_mode"] = agg
    run = write_run(tmp_path / "run", [table], config)
    metrics, tokens = run_rldiag(run, {"rldiag.dp_size": c["dp"]})
    want = verl_metrics(table, tokens[1], actor_v, critic_v, c["dp"], agg)
    if not c.get("v1", True) and agg == "seq-mean-token-sum-norm":
        for name in ("actor/pg_loss", "actor/entropy_loss", "critic/vf_loss"):  # legacy: the step's width
            want.pop(name)
    for name, value in want.items():
        if np.isnan(value):  # a mini-batch of padding rows only: 0 / 0 tokens, in verl too
            assert np.isnan(metrics[1][name]), f"{c} {agg} {name}"
            continue
        assert_close(metrics[1][name], value, f"{c} {agg} {name}", atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("case", [0, 1, 3, 4])
def test_a_captured_run_in_dispatch_order_matches_verl(monkeypatch, tmp_path, case):
    """What rldiag's V1 capture writes: the rows in the trainer's order after ``_balance_batch``,
    padding rows dropped, each row's place in the padded batch as ``batch_position``; rldiag
    deals them as stored (``rldiag.capture.trainer`` in run.yaml), ties in workload included."""
    import pyarrow as pa

    c = CASES[case]
    table = _case_table(c, 2000 + case)
    seq = _seq_lens(table)
    seq[1] = seq[2] = seq[3]  # equal workloads: re-balancing the stored order could swap these rows
    table = table.set_column(table.column_names.index("prompt_length"), "prompt_length",
                             pa.array(np.array(seq) - np.diff(table["response_mask"].combine_chunks().offsets.to_numpy())))
    actor_v, critic_v = verl_layouts(monkeypatch, seq, c["dp"], c)
    placed = [j for rank in verl_dispatch(monkeypatch, seq, c["dp"], _config(c), 1) for j in rank]
    kept = [j for j in placed if j != PAD]
    stored = table.take(kept).append_column("batch_position", pa.array(
        [i for i, j in enumerate(placed) if j != PAD], pa.int64()))
    new = {old: i for i, old in enumerate(kept)}

    def renumber(layout):
        return [[[[new.get(j, PAD) for j in mb] for mb in micros] for micros in ranks] for ranks in layout]

    config = _config(c)
    config["rldiag"] = {"capture": {"trainer": "v1"}}
    config["actor_rollout_ref"]["actor"]["loss_agg_mode"] = "seq-mean-token-mean"
    run = write_run(tmp_path / "run", [stored], config)
    metrics, tokens = run_rldiag(run, {"rldiag.dp_size": c["dp"]})
    want = verl_metrics(stored, tokens[1], renumber(actor_v), renumber(critic_v), c["dp"], "seq-mean-token-mean")
    for name, value in want.items():
        assert_close(metrics[1][name], value, f"{c} {name}", atol=5e-5, rtol=5e-5)
