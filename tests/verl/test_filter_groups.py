"""verl's group filter (``algorithm.filter_groups``) against verl 0.9.1's own: the V1 trainer's
replay buffer decides which finished groups to evict in ``ReplayBuffer._dapo_filtered_keys``
(``verl/trainer/ppo/v1/replay_buffer.py``), reading the rows' ``rm_scores`` (metric ``reward``)
or their reward's extra info (any other name) from TransferQueue. Here TransferQueue is an
in-memory stand-in holding the same batch, and the groups verl evicts are the groups whose rows
``rldiag recompute`` takes out of the update (their response_mask all 0)."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pyarrow as pa
import pytest

from tests.capture.verl_steps import stub_transfer_queue
from tests.verl.harness import long_tail_table, padded, run_rldiag, scalar, write_run

pytest.importorskip("verl")
from omegaconf import OmegaConf  # noqa: E402

STEPS = 4


def _replay_buffer(monkeypatch):
    try:
        import transfer_queue  # noqa: F401
    except ImportError:
        monkeypatch.setitem(sys.modules, "transfer_queue", stub_transfer_queue())
    try:
        return importlib.import_module("verl.trainer.ppo.v1.replay_buffer")
    except ModuleNotFoundError as exc:  # one of its own imports is not installed
        pytest.skip(f"verl's V1 replay buffer does not import here: {exc}")


class _TQ:
    """TransferQueue's ``kv_batch_get`` over one step's rows: ``rm_scores`` (the row's token
    scores) or ``extra_fields`` (the reward's extra info: the row's scalar columns)."""

    def __init__(self, table: pa.Table, keys: list[str]):
        scores = padded(table, "token_level_scores")
        lengths = np.diff(table["token_level_scores"].combine_chunks().offsets.to_numpy())
        extra = {name: scalar(table, name) for name in ("acc",)}
        self.rows = {k: (scores[i, : lengths[i]], {n: float(v[i]) for n, v in extra.items()}) for i, k in enumerate(keys)}

    def kv_batch_get(self, keys, partition_id, select_fields):
        if select_fields == ["rm_scores"]:
            return {"rm_scores": [self.rows[k][0] for k in keys]}
        return {"extra_fields": [{"reward_extra_info": self.rows[k][1]} for k in keys]}


def _verl_evicted(rb, monkeypatch, table: pa.Table, metric: str) -> set[str]:
    """The uids verl's replay buffer evicts from one step's finished groups."""
    uids = [str(u) for u in scalar(table, "uid")]
    keys, seen = [], {}
    for u in uids:  # {uid}_{session}_{index}: one session per response, one output each
        keys.append(f"{u}_{seen.get(u, 0)}_0")
        seen[u] = seen.get(u, 0) + 1
    monkeypatch.setattr(rb, "tq", _TQ(table, keys))
    buf = rb.ReplayBuffer("sync", OmegaConf.create({}), None, "drop", OmegaConf.create({}), refill_fn=lambda n: n,
                          filter_groups_metric=metric, train_batch_size=len(seen), gen_batch_size=1)
    buf.finished_keys["train"] = set(uids)
    buf.partitions["train"] = {k: {} for k in keys}
    evicted, _ = buf._dapo_filtered_keys("train")
    return evicted


def _tables(seed: int) -> list[pa.Table]:
    """Steps of groups of 4 (and one singleton) with 0/1 outcomes, so that flat groups are common;
    ``acc`` a 0/1 column of its own."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(1, STEPS + 1):
        t = long_tail_table(rng, step, prompts=6, n=4)
        t = t.slice(0, t.num_rows - 3)  # the last prompt keeps a single response
        col = t["token_level_scores"].combine_chunks()
        offsets = col.offsets.to_numpy()
        values = np.zeros(len(col.values), dtype=np.float32)
        p = np.repeat(rng.choice([0.0, 0.5, 1.0], 6), 4)[: t.num_rows]
        values[offsets[1:] - 1] = (rng.random(t.num_rows) < p).astype(np.float32)
        t = t.set_column(t.schema.get_field_index("token_level_scores"), "token_level_scores",
                         pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values)))
        acc = (rng.random(t.num_rows) < np.repeat(rng.choice([0.0, 0.5, 1.0], 6), 4)[: t.num_rows]).astype(np.float32)
        out.append(t.append_column("acc", pa.array(acc)))
    return out


@pytest.mark.parametrize("metric", ["reward", "acc"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_groups_verl_evicts_are_the_groups_rldiag_drops(tmp_path, monkeypatch, metric, seed):
    rb = _replay_buffer(monkeypatch)
    tables = _tables(seed)
    run = write_run(tmp_path / "run", tables)
    _, tokens = run_rldiag(run, {"algorithm.adv_estimator": "grpo", "algorithm.filter_groups.enable": True,
                                 "algorithm.filter_groups.metric": metric})
    total = 0
    for table in tables:
        step = int(table["step"][0].as_py())
        want = _verl_evicted(rb, monkeypatch, table, metric)
        out = tokens[step]
        uids = scalar(table, "uid")
        mask = out["response_mask"].to_pylist()
        dropped = {str(uids[r]) for r, m in zip(out["row"].to_pylist(), mask) if not any(m)}
        assert dropped == want, step
        assert all(any(m) for r, m in zip(out["row"].to_pylist(), mask) if str(uids[r]) not in want)
        total += len(want)
    assert total > 0  # the batches have flat groups
