"""Synthetic verl steps for the capture tests: batches in verl's own layouts, and the trainer
step bodies that run verl's own trainer-side functions in the order its trainers call them.

No model and no GPU: log-probabilities, values and scores are random numbers. The legacy body
follows ``RayPPOTrainer.fit``'s advantage block (``apply_kl_penalty``, rollout correction,
``compute_advantage``, ``compute_data_metrics``, ``Tracking.log``); the V1 body calls the V1
trainer's own ``_compute_advantage`` against an in-memory TransferQueue and computes the data
metrics as ``PPOTrainer._compute_metrics`` does.
"""

from __future__ import annotations

import sys
import threading
import types

import numpy as np
import torch

P, R = 4, 6  # prompt and response widths (the caps: one row of each step reaches each)


def lengths(rows: int, cap: int, g: torch.Generator) -> torch.Tensor:
    out = torch.randint(1, cap + 1, (rows,), generator=g)
    out[0] = cap
    return out


def tensors(step: int, rows: int, n: int) -> dict:
    """Padded tensors of one step, rows grouped by ``n`` (verl's ``rollout.n``)."""
    g = torch.Generator().manual_seed(1000 + step)
    pl, rl = lengths(rows, P, g), lengths(rows, R, g)
    prompt_attn = (torch.arange(P).flip(0)[None, :] < pl[:, None]).long()  # left-padded
    resp_attn = (torch.arange(R)[None, :] < rl[:, None]).long()  # right-padded
    scores = torch.zeros(rows, R)
    scores[torch.arange(rows), rl - 1] = torch.randint(0, 2, (rows,), generator=g).float()
    old = -torch.rand(rows, R, generator=g) * 2
    out = {
        "prompts": torch.randint(3, 50, (rows, P), generator=g) * prompt_attn,
        "responses": torch.randint(3, 50, (rows, R), generator=g) * resp_attn,
        "attention_mask": torch.cat([prompt_attn, resp_attn], 1),
        "response_mask": resp_attn,
        "token_level_scores": scores,
        "old_log_probs": old * resp_attn,
        "ref_log_prob": (old + 0.3 * torch.randn(rows, R, generator=g)) * resp_attn,
        "rollout_log_probs": (old + 0.6 * torch.randn(rows, R, generator=g)) * resp_attn,
        "values": torch.randn(rows, R, generator=g) * resp_attn,
    }
    out["uid"] = np.array([f"s{step}-p{i // n}" for i in range(rows)], dtype=object)
    out["_lengths"] = (pl, rl)
    return out


def weight_versions(step: int, rows: int) -> tuple[list[int], list[int]]:
    """``(min_global_steps, max_global_steps)`` per row, as verl's rollout reports them: the
    updates the weights had seen when the row's generation began and ended (on-policy: step - 1;
    here some rows lag and some span a weight update)."""
    newest = [max(step - 1 - i % 3, 0) for i in range(rows)]
    return [max(v - i % 2, 0) for i, v in enumerate(newest)], newest


def reward_inputs(step: int, rows: int) -> dict[str, list]:
    """What a verl dataset row gives a reward function: ``data_source``, ``reward_model`` (its
    ``ground_truth``: a string, or a number on odd rows) and ``extra_info``."""
    return {"data_source": ["openai/gsm8k" if i % 3 else "math" for i in range(rows)],
            "reward_model": [{"ground_truth": str(step * 100 + i) if i % 2 == 0 else step * 100 + i, "style": "rule"}
                             for i in range(rows)],
            "extra_info": [{"index": i, "split": "train"} for i in range(rows)]}


def dataproto(step: int, rows: int, n: int, fields: tuple[str, ...], versions: bool = False, reward: bool = False):
    from verl import DataProto

    t = tensors(step, rows, n)
    non = {"uid": t["uid"]}
    if reward:
        non.update({k: np.array(v, dtype=object) for k, v in reward_inputs(step, rows).items()})
        non["acc"] = np.arange(rows, dtype=np.float64) / rows  # a reward component (reward_extra_keys)
    if versions:  # as verl's agent loop leaves them: object arrays in the non-tensor batch
        for key, values in zip(("min_global_steps", "max_global_steps"), weight_versions(step, rows)):
            non[key] = np.array(values, dtype=object)
    return DataProto.from_dict(tensors={k: t[k] for k in fields}, non_tensors=non)


def legacy_fit(n_steps: int, rows: int, hang_at: int | None = None, marker: str | None = None,
               versions: bool = False, extra=None, reward: bool = False):
    """A ``RayPPOTrainer.fit`` body: the advantage block of each step, then ``Tracking.log``.
    ``hang_at``: at that step, after the advantage block, create ``marker`` and wait forever
    (the step in flight when the test kills the process). ``versions``: the batches carry the
    agent loop's per-row ``min_global_steps`` / ``max_global_steps``. ``extra(step)``: more metrics
    logged with the step's (the actor's, say). The loop ends as ``RayPPOTrainer.fit``'s does:
    ``is_last_step = global_steps >= total_training_steps`` taken at the start of a step, and
    the return after the step's log when it was the last (``n_steps`` is the initial
    ``total_training_steps``)."""
    import verl.trainer.ppo.ray_trainer as rt
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    def fit(self):
        algo = self.config.algorithm
        fields = ("prompts", "responses", "attention_mask", "response_mask", "token_level_scores", "old_log_probs",
                  "ref_log_prob", "values", "rollout_log_probs")
        self.total_training_steps = n_steps
        self.global_steps = 1
        while True:
            step = self.global_steps
            is_last_step = self.global_steps >= self.total_training_steps
            metrics: dict = {}
            batch = dataproto(step, rows, self.config.actor_rollout_ref.rollout.n, fields, versions, reward)
            if algo.use_kl_in_reward:
                batch, kl_metrics = rt.apply_kl_penalty(batch, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=algo.kl_penalty)
                metrics.update(kl_metrics)
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            rc = algo.get("rollout_correction", None)
            if rc is not None and not rc.get("bypass_mode", False):
                from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

                batch, is_metrics = compute_rollout_correction_and_add_to_batch(batch, rc)
                metrics.update(is_metrics)
            batch = rt.compute_advantage(batch, adv_estimator=algo.adv_estimator, gamma=algo.gamma, lam=algo.lam,
                                         num_repeat=self.config.actor_rollout_ref.rollout.n,
                                         norm_adv_by_std_in_grpo=algo.get("norm_adv_by_std_in_grpo", True),
                                         config=algo)
            metrics.update(compute_data_metrics(batch=batch, use_critic=self.use_critic))
            if step == hang_at:
                open(marker, "w").close()
                threading.Event().wait()
            metrics["training/global_step"] = step
            if extra is not None:
                metrics.update(extra(step))
            self.logger.log(data=metrics, step=step)
            self.global_steps += 1
            if is_last_step:
                return

    return fit


# ---- V1 -----------------------------------------------------------------------------------------


def stub_transfer_queue() -> types.ModuleType:
    """A stand-in ``transfer_queue`` module, so that verl's V1 trainer module imports where the
    real TransferQueue is not installed; the tests replace its ``tq`` by :class:`FakeTQ`."""
    mod = types.ModuleType("transfer_queue")

    class KVBatchMeta:  # only a type annotation in verl's module
        pass

    def unavailable(**_):
        raise RuntimeError("the stub TransferQueue is replaced by FakeTQ in these tests")

    mod.KVBatchMeta = KVBatchMeta
    mod.kv_batch_get = mod.kv_batch_put = mod.kv_clear = unavailable
    return mod


class Meta:
    """What verl's V1 trainer passes around for a batch (``KVBatchMeta``): keys, partition, tags."""

    def __init__(self, keys: list[str], tags: list[dict]):
        self.keys, self.partition_id, self.tags = keys, "train", tags

    def __len__(self) -> int:
        return len(self.keys)


class FakeTQ:
    """An in-memory TransferQueue with the two calls the trainer and the capture use: rows are
    stored per key; ``kv_batch_get`` returns the selected fields as verl's TensorDict of nested
    (jagged) tensors, leaving out fields the rows do not have (as the real one does)."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def put_rows(self, keys: list[str], fields: dict) -> None:
        for i, key in enumerate(keys):
            self.rows.setdefault(key, {}).update({name: values[i] for name, values in fields.items()})

    def kv_batch_get(self, keys, partition_id, select_fields):
        from verl.utils import tensordict_utils as tu

        out = {}
        for name in select_fields:
            if not all(name in self.rows[k] for k in keys):
                continue
            values = [self.rows[k][name] for k in keys]
            if isinstance(values[0], torch.Tensor):
                out[name] = torch.nested.as_nested_tensor(values, layout=torch.jagged)
            else:
                out[name] = np.array(values, dtype=object)
        return tu.get_tensordict(out)

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        if fields is not None:
            self.put_rows(list(keys), {name: list(fields[name].unbind()) for name in fields.keys()})
        return Meta(list(keys), [{}] * len(keys))


def v1_rows(tq: FakeTQ, step: int, part: int, rows: int, n: int, padding: int = 0, versions: bool = False,
            reward: bool = False) -> Meta:
    """One batch of a V1 step put into ``tq`` as the rollout leaves it: nested rows per key.
    ``versions``: each row's tags carry ``min_global_steps`` / ``max_global_steps`` (the padding
    rows a copy of a real row's, as verl's padding template copies its tag)."""
    t = tensors(step * 10 + part, rows, n)
    pl, rl = t["_lengths"]
    uids = [f"s{step}-part{part}-p{i // n}" for i in range(rows)]
    keys = [f"{u}_{i % n}_0" for i, u in enumerate(uids)]
    fields = {"uid": uids,
              "prompts": [t["prompts"][i, P - pl[i]:] for i in range(rows)],
              "responses": [t["responses"][i, : rl[i]] for i in range(rows)],
              "response_mask": [t["response_mask"][i, : rl[i]] for i in range(rows)],
              "rm_scores": [t["token_level_scores"][i, : rl[i]] for i in range(rows)],
              "old_log_probs": [t["old_log_probs"][i, : rl[i]] for i in range(rows)],
              "rollout_log_probs": [t["rollout_log_probs"][i, : rl[i]] for i in range(rows)]}
    if reward:  # the dataset's fields and the reward loop's per-row extras
        fields.update(reward_inputs(step, rows))
        fields["extra_fields"] = [{"reward_extra_info": {"acc": i / rows, "pred": f"x{i}"}} for i in range(rows)]
    tags = [{"is_padding": i >= rows - padding} for i in range(rows)]
    if versions:
        low, high = weight_versions(step, rows)
        for i, tag in enumerate(tags):
            real = min(i, rows - padding - 1)
            tag.update(min_global_steps=low[real], max_global_steps=high[real])
    tq.put_rows(keys, fields)
    return Meta(keys, tags)


def v1_fit(tq: FakeTQ, n_steps: int, rows: int, parts: int = 1, padding: int = 0, versions: bool = False,
           extra=None, reward: bool = False):
    """A V1 ``PPOTrainer.fit`` body: ``parts`` batches per step through the V1 trainer's own
    ``_compute_advantage`` (``separate_async`` hands over ``parameter_sync_step`` of them), then
    the data metrics of the last one as ``_compute_metrics`` computes them, then ``Tracking.log``.
    ``versions``: the rows' tags carry their weight versions (:func:`v1_rows`). ``extra(step)``:
    more metrics logged with the step's. The loop runs while ``global_steps <=
    total_training_steps`` and returns after the log of the step it found last, as V1's
    ``PPOTrainer.fit`` (``n_steps`` is the initial ``total_training_steps``)."""
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    def fit(self, agent_loop_manager=None):
        n = self.config.actor_rollout_ref.rollout.n
        self.total_training_steps = n_steps
        self.global_steps = 1
        while self.global_steps <= self.total_training_steps:
            step = self.global_steps
            is_last_step = self.global_steps >= self.total_training_steps
            metrics: dict = {}
            for part in range(parts):
                meta = v1_rows(tq, step, part, rows, n, padding, versions, reward)
                self._compute_advantage(meta, metrics=metrics)
            keep = np.array([not t["is_padding"] for t in meta.tags])
            data = tq.kv_batch_get(keys=meta.keys, partition_id="train",
                                   select_fields=["prompts", "responses", "response_mask", "advantages", "returns",
                                                  "rm_scores", "token_level_rewards", "values"])
            prompt_length, response_length = data["prompts"].offsets().diff(), data["responses"].offsets().diff()
            data = data.to_padded_tensor()
            data["token_level_scores"] = data["rm_scores"]
            if "token_level_rewards" not in data:
                data["token_level_rewards"] = data["rm_scores"]
            data["prompt_length"], data["response_length"] = prompt_length.float(), response_length.float()
            batch = DataProto(batch=data).select_idxs(keep)
            metrics.update(compute_data_metrics(batch=batch, use_critic=self.use_critic))
            metrics["training/global_step"] = step
            if extra is not None:
                metrics.update(extra(step))
            self.logger.log(data=metrics, step=step)
            self.global_steps += 1
            if is_last_step:
                return

    return fit


def import_v1(monkeypatch):
    """verl's V1 trainer module, importing it against a stub TransferQueue if needed."""
    try:
        import transfer_queue  # noqa: F401
    except ImportError:
        monkeypatch.setitem(sys.modules, "transfer_queue", stub_transfer_queue())
    import importlib

    import pytest

    try:
        return importlib.import_module("verl.trainer.ppo.v1.trainer_base")
    except ModuleNotFoundError as exc:  # one of the V1 trainer's own imports is not installed
        pytest.skip(f"verl's V1 trainer module does not import here: {exc}")


def v1_trainer(monkeypatch):
    """``(module, tq, Trainer)``: verl's V1 trainer module with :class:`FakeTQ` as its TransferQueue,
    and a ``PPOTrainer`` subclass with the hooks the test bodies do not need left empty."""
    tb = import_v1(monkeypatch)
    tq = FakeTQ()
    monkeypatch.setattr(tb, "tq", tq)

    class Trainer(tb.PPOTrainer):
        def on_step_end(self):
            pass

        def on_sample_end(self):
            pass

    return tb, tq, Trainer
